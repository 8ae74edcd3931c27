"""monobatch: one batch-native LLM inference engine for every door — CLI, server, Python API.

Python API (vLLM's shape)::

    from monobatch import LLM, SamplingParams
    outputs = LLM().generate(["Hello"], SamplingParams(temperature=0, max_tokens=16))
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "SamplingParams", "StructuredOutput", "RequestOutput", "CompletionOutput"]

if TYPE_CHECKING:
    from monobatch.engine.constraint import StructuredOutput
    from monobatch.engine.params import SamplingParams
    from monobatch.llm import LLM, CompletionOutput, RequestOutput


def __getattr__(name: str):
    """Import torch-heavy parts lazily, so ``import monobatch`` (the CLI's --help) stays fast."""
    if name == "SamplingParams":
        from monobatch.engine.params import SamplingParams
        return SamplingParams
    if name == "StructuredOutput":
        from monobatch.engine.constraint import StructuredOutput
        return StructuredOutput
    if name in ("LLM", "RequestOutput", "CompletionOutput"):
        from monobatch import llm
        return getattr(llm, name)
    raise AttributeError(f"module 'monobatch' has no attribute {name!r}")
