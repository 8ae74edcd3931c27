"""The prompt side of a chat turn, shared by every chat door (the server's chat endpoint,
``generate --chat``, ``LLM.chat``): messages and tools through the chat template into prompt ids,
with the tool-call format and constraint that go with them.

The reply side (reasoning split, tool-call parsing) is :mod:`monobatch.chat_output`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from monobatch.errors import InvalidRequestError
from monobatch.tool_calls import (ToolFormat, ToolSpec, check_tools, detect_format, history_calls, prepare_messages,
                                  tool_constraint)

if TYPE_CHECKING:
    from monobatch.engine.constraint import StructuredOutput
    from monobatch.engine.params import SamplingParams
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
        may be a control token (Mistral's ``[TOOL_CALLS]``, Llama's ``<|python_tag|>``, a
        vocabulary where ``<tool_call>`` is special)."""
        return self.tools.active and self.fmt is not ToolFormat.GENERIC

    def apply(self, params: "SamplingParams") -> "SamplingParams":
        """``params`` for this turn: the tool constraint (``tool_choice`` "required", a named
        function, the generic format's "auto") and the special tokens the parser must see.

        Raises:
            InvalidRequestError: a tool constraint and another output constraint in one request.
        """
        changes: dict[str, Any] = {}
        if self.structured is not None:
            if params.structured is not None:
                why = ("this model's chat template has no tool-call format, so with tools its reply is "
                       "constrained to the generic tool JSON" if self.tools.choice == "auto" else
                       f"tool_choice {self.tools.choice!r} constrains the reply to tool calls")
                raise InvalidRequestError(f"tool_choice: {why}, which cannot be combined with "
                                          f"{params.structured.param} (set tool_choice to \"none\" for a "
                                          "constrained answer)", "tool_choice")
            changes["structured"] = self.structured
        if self.keep_special_tokens:
            changes["skip_special_tokens"] = False
        return dataclasses.replace(params, **changes) if changes else params

    def finish_reason(self, engine_reason: str | None, has_calls: bool, cut: bool = False) -> str | None:
        """OpenAI's ``finish_reason`` of a reply: ``tool_calls`` when it holds complete calls and
        generation ended normally (``stop``: the end of generation, the grammar's end, a stop
        string after the calls) with no call left unfinished (``cut``, ``ChatReply.cut_call``),
        unless ``tool_choice`` named the function (OpenAI answers ``stop`` then). Otherwise the
        engine's reason: ``length`` whenever ``max_tokens`` or the context cut the reply, even
        after complete calls (they are still returned; a stream has sent them already), ``stop``
        when a stop string cut a further call."""
        named = self.tools.choice not in ("none", "auto", "required")
        return "tool_calls" if has_calls and engine_reason == "stop" and not cut and not named else engine_reason


def template_messages(messages: list) -> list:
    """The request's messages as the chat template gets them: OpenAI's ``developer`` role (its
    newer name for ``system``) becomes ``system``; everything else is the template module's to
    check. The client's dicts are not modified."""
    return [{**m, "role": "system"} if isinstance(m, dict) and m.get("role") == "developer" else m
            for m in messages]


def check_tool_results(messages: Any) -> None:
    """OpenAI's rules for ``tool`` messages, checked for every chat door before the template runs
    (with or without tools), on the ids as the client sent them (before any format rewrites them,
    as Mistral's does): each ``tool`` message carries the ``tool_call_id`` (a string) of a call it
    answers; it follows, directly or after other ``tool`` messages, an assistant message with
    ``tool_calls``, and its id is one of that message's call ids; and an assistant message with
    ``tool_calls`` is followed by ``tool`` messages answering each of its ids, once each. These
    are OpenAI's 400s for a tool message without a preceding call and for ids left without a
    response, worded as its messages.

    Raises:
        InvalidRequestError: param ``messages[i].tool_call_id`` (missing, null, not a string, not
            an id of the calls it follows, or an id an earlier tool message answered already),
            ``messages[i]`` (a tool message that follows no assistant ``tool_calls``; an assistant
            message whose calls are not all answered), or as
            :func:`monobatch.tool_calls.history_calls` (a malformed call; a call id missing or
            repeated within the message; arguments that are not JSON text).
    """
    owner, pending, ids = None, {}, ()  # the assistant message answered now, its unanswered ids, all its ids
    for i, m in enumerate(messages if isinstance(messages, list) else ()):
        if not isinstance(m, dict):
            continue  # normalize_messages refuses it, naming it
        if m.get("role") == "tool":
            call_id = m.get("tool_call_id")
            if not isinstance(call_id, str):
                what = "is missing" if call_id is None else "must be a string"
                raise InvalidRequestError(f"messages[{i}].tool_call_id {what}: a message with role 'tool' must "
                                          "carry the id of the tool call it answers", f"messages[{i}].tool_call_id")
            if owner is None:
                raise InvalidRequestError(f"messages[{i}]: messages with role 'tool' must be a response to a "
                                          "preceding message with 'tool_calls'", f"messages[{i}]")
            if call_id not in ids:
                raise InvalidRequestError(f"messages[{i}].tool_call_id {call_id!r} is not the id of a tool call of "
                                          f"messages[{owner}] (its ids: {', '.join(ids)})",
                                          f"messages[{i}].tool_call_id")
            if call_id not in pending:
                raise InvalidRequestError(f"messages[{i}].tool_call_id {call_id!r}: the call was answered already "
                                          f"(each call of messages[{owner}] gets one tool message)",
                                          f"messages[{i}].tool_call_id")
            del pending[call_id]
            continue
        _check_answered(owner, pending)
        owner, pending, ids = None, {}, ()
        if m.get("role") == "assistant" and m.get("tool_calls"):
            ids = tuple(call_id for call_id, _, _ in history_calls(m["tool_calls"], i))
            owner, pending = i, dict.fromkeys(ids)
    _check_answered(owner, pending)


def _check_answered(owner: int | None, pending: dict) -> None:
    """Refuse an assistant message (index ``owner``) whose call ids in ``pending`` got no tool message."""
    if owner is not None and pending:
        raise InvalidRequestError(f"messages[{owner}]: an assistant message with 'tool_calls' must be followed by "
                                  "tool messages responding to each 'tool_call_id'. The following tool_call_ids did "
                                  f"not have response messages: {', '.join(pending)}", f"messages[{owner}]")


def _has_tool_history(messages: Any) -> bool:
    """True when an assistant message carries ``tool_calls`` (a tool history: its calls and the
    tool results after them are the tool format's to render; :func:`check_tool_results` has
    refused tool messages that answer no call)."""
    return isinstance(messages, list) and any(
        isinstance(m, dict) and m.get("role") == "assistant" and m.get("tool_calls") for m in messages)


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
        InvalidRequestError: bad messages or tools (``tool`` messages that answer no call, calls
            left unanswered: :func:`check_tool_results`), a template's ``raise_exception``,
            ``template_kwargs`` not a dict or setting a reserved variable.
    """
    check_tool_results(messages)
    if template_kwargs is not None and not isinstance(template_kwargs, dict):
        raise InvalidRequestError("chat_template_kwargs must be an object of template variables, not "
                                  f"{type(template_kwargs).__name__}", "chat_template_kwargs")
    kwargs = dict(template_kwargs or {})
    clash = sorted(RESERVED_TEMPLATE_VARS & kwargs.keys())
    if clash:
        raise InvalidRequestError(f"chat_template_kwargs: may not set {', '.join(clash)}", "chat_template_kwargs")
    spec = check_tools(tools, tool_choice, parallel_tool_calls)
    fmt = detect_format(tok.chat_template)
    if spec.tools or _has_tool_history(messages):
        # tools in the request, or a tool history without them (vLLM's clients send one): the
        # format renders the tools and the history (a template that knows no tools gets the
        # generic format's rewrite, not a tool message it cannot render)
        rendered, extra = prepare_messages(template_messages(messages), spec, fmt)
    else:  # none: the messages reach the template as they are (its own rules, raise_exception too)
        rendered, extra = template_messages(messages), {}
    ids = tok.encode_chat(rendered, add_generation_prompt, **{**kwargs, **extra})
    from monobatch.chat_output import prompt_opens_reasoning

    tail = tok.decode(ids[-TAIL_TOKENS:], skip_special_tokens=False)
    return ChatPrompt(ids, spec, fmt, tool_constraint(spec, fmt, tok), prompt_opens_reasoning(tail))
