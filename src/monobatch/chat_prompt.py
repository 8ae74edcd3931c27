"""The prompt side of a chat turn, shared by every chat door (the server's chat endpoint,
``generate --chat``, ``LLM.chat``): messages and tools through the chat template into prompt ids,
with the tool-call format and constraint that go with them.

The reply side (reasoning split, tool-call parsing) is :mod:`monobatch.chat_output`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from monobatch.errors import InvalidRequestError
from monobatch.tool_calls import ToolFormat, ToolSpec, check_tools, detect_format, prepare_messages, tool_constraint

if TYPE_CHECKING:
    from monobatch.engine.constraint import StructuredOutput
    from monobatch.tokenizer import Tokenizer

#: Template variables a request's chat_template_kwargs may not replace.
RESERVED_TEMPLATE_VARS = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token", "tools"})
#: Prompt tokens decoded to see whether the rendered prompt leaves a ``<think>`` block open.
TAIL_TOKENS = 16


@dataclass(slots=True)
class ChatPrompt:
    """A rendered chat turn.

    Attributes:
        prompt_ids: the prompt token ids (message text tokenized as data: ``Tokenizer.encode_chat``).
        tools: the checked tool request (``choice`` "none" and no tools when none were given).
        fmt: the model's tool-call format (from its chat template).
        structured: the constraint that enforces ``tool_choice`` ("required", a named function;
            the generic format's "auto"), or None.
        in_reasoning: the prompt leaves a ``<think>`` block open.
    """

    prompt_ids: list[int]
    tools: ToolSpec
    fmt: ToolFormat
    structured: "StructuredOutput | None"
    in_reasoning: bool

    @property
    def keep_special_tokens(self) -> bool:
        """Whether the reply must be decoded with its special tokens: a format whose call marker
        may be a control token (Mistral's ``[TOOL_CALLS]``, Llama's ``<|python_tag|>``)."""
        return self.tools.active and self.fmt in (ToolFormat.MISTRAL, ToolFormat.LLAMA3_JSON)


def template_messages(messages: list) -> list:
    """The request's messages as the chat template gets them: OpenAI's ``developer`` role (its
    newer name for ``system``) becomes ``system``; everything else is the template module's to
    check. The client's dicts are not modified."""
    return [{**m, "role": "system"} if isinstance(m, dict) and m.get("role") == "developer" else m
            for m in messages]


def prepare_chat(tok: "Tokenizer", messages: list, *, tools: Any = None, tool_choice: Any = None,
                 parallel_tool_calls: Any = None, add_generation_prompt: bool = True,
                 template_kwargs: dict[str, Any] | None = None) -> ChatPrompt:
    """Render and tokenize one chat turn. Blocking (the template and the tokenizer): the server
    runs it on a worker thread.

    Args:
        tok: the model's tokenizer (its chat template decides the tool-call format).
        messages: OpenAI-style messages (assistant ``tool_calls`` and ``tool`` results included).
        tools, tool_choice, parallel_tool_calls: OpenAI's fields (:func:`monobatch.tool_calls.check_tools`).
        add_generation_prompt: end with the assistant header.
        template_kwargs: extra template variables (``chat_template_kwargs``).

    Returns:
        The :class:`ChatPrompt`.

    Raises:
        InvalidRequestError: bad messages or tools, a template's ``raise_exception``, reserved kwargs.
    """
    kwargs = dict(template_kwargs or {})
    clash = sorted(RESERVED_TEMPLATE_VARS & kwargs.keys())
    if clash:
        raise InvalidRequestError(f"chat_template_kwargs: may not set {', '.join(clash)}", "chat_template_kwargs")
    spec = check_tools(tools, tool_choice, parallel_tool_calls)
    fmt = detect_format(tok.chat_template)
    rendered, extra = prepare_messages(template_messages(messages), spec, fmt)
    ids = tok.encode_chat(rendered, add_generation_prompt, **{**kwargs, **extra})
    from monobatch.chat_output import prompt_opens_reasoning

    tail = tok.decode(ids[-TAIL_TOKENS:], skip_special_tokens=False)
    return ChatPrompt(ids, spec, fmt, tool_constraint(spec, fmt, tok), prompt_opens_reasoning(tail))
