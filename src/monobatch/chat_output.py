"""Chat output: a reply's text split into reasoning, content and tool calls, shared by every
chat client (the server's chat endpoint, ``generate --chat``, ``LLM.chat``).

:class:`ChatReply` runs the two splitters in order: the reasoning split below, then the tool-call
parser (:class:`monobatch.tool_calls.ToolCallParser`) on the content.

Reasoning models write their thinking inside a ``<think> ... </think>`` block before the answer.
Some templates open the block themselves (the rendered prompt ends with ``<think>``, as
DeepSeek-R1's does), others leave it to the model (Qwen3 writes ``<think>`` as its first token).
With ``reasoning_format="separate"`` the text inside the block goes to ``reasoning_content`` and
the rest to ``content`` (llama.cpp's ``--reasoning-format deepseek``, vLLM's reasoning parser);
with ``"none"`` everything is ``content``, tags included.

:class:`ReasoningSplitter` works on streamed text pieces: a piece that could still become a tag
(``"</thi"``) is held back until it can be decided, so streamed deltas joined equal the split of
the whole text. Whitespace right after an opening or closing tag is dropped (the template's
newline, the blank line before the answer).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from monobatch.tool_calls import ToolCall, ToolCallDelta, ToolCallParser, ToolFormat, ToolSpec
from monobatch.tool_calls.parser import partial_suffix

#: The values of ``--reasoning-format`` / the request field ``reasoning_format``.
REASONING_FORMATS = ("none", "separate")
OPEN_TAG = "<think>"
CLOSE_TAG = "</think>"


@dataclass(slots=True)
class ChatDelta:
    """A piece of a reply: new content and new reasoning text (either may be ""), and tool-call
    pieces (:class:`ChatReply` only)."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def __iadd__(self, other: "ChatDelta") -> "ChatDelta":
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls.extend(other.tool_calls)
        return self


class _State(enum.Enum):
    START = "start"          # nothing decided: the text may still open a block
    REASONING = "reasoning"  # inside <think> ... </think>
    CONTENT = "content"      # the answer (or everything, when format is "none")


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """Whether a rendered chat prompt leaves a ``<think>`` block open for the reply to continue."""
    return prompt_text.rstrip().endswith(OPEN_TAG)


class ReasoningSplitter:
    """Splits one reply's streamed text into content and reasoning.

    Args:
        reasoning_format: ``"separate"`` splits; ``"none"`` passes every piece through as content.
        in_reasoning: the prompt already opened a ``<think>`` block (see
            :func:`prompt_opens_reasoning`), so the reply starts inside it.

    Attributes:
        has_reasoning: a reasoning block was opened (the reply has ``reasoning_content``).
    """

    def __init__(self, reasoning_format: str = "separate", in_reasoning: bool = False) -> None:
        if reasoning_format not in REASONING_FORMATS:
            raise ValueError(f"reasoning_format must be one of {REASONING_FORMATS}, got {reasoning_format!r}")
        self._split = reasoning_format == "separate"
        if not self._split:
            self._state = _State.CONTENT
        else:
            self._state = _State.REASONING if in_reasoning else _State.START
        self.has_reasoning = self._state is _State.REASONING
        self._held = ""           # text not yet decided (a possible tag prefix)
        self._strip = self.has_reasoning  # drop whitespace before the next visible character

    def feed(self, text: str) -> ChatDelta:
        """Add the next piece of the reply; returns what can be shown now."""
        if not self._split:
            return ChatDelta(content=text)
        out = ChatDelta()
        self._held += text
        while self._held:
            if self._state is _State.START:
                stripped = self._held.lstrip()
                if stripped.startswith(OPEN_TAG):
                    self._held = stripped[len(OPEN_TAG):]
                    self._state, self.has_reasoning, self._strip = _State.REASONING, True, True
                elif stripped and OPEN_TAG.startswith(stripped) or not stripped:
                    break  # still possibly "<think>": wait
                else:
                    self._state = _State.CONTENT
            elif self._state is _State.REASONING:
                end = self._held.find(CLOSE_TAG)
                if end >= 0:
                    out.reasoning += self._visible(self._held[:end])
                    self._held = self._held[end + len(CLOSE_TAG):]
                    self._state, self._strip = _State.CONTENT, True
                    continue
                keep = partial_suffix(self._held, CLOSE_TAG)
                out.reasoning += self._visible(self._held[:len(self._held) - keep])
                self._held = self._held[len(self._held) - keep:]
                break
            else:
                out.content += self._visible(self._held)
                self._held = ""
        return out

    def flush(self) -> ChatDelta:
        """End of the reply: release held text (an unfinished tag is plain text)."""
        held, self._held = self._held, ""
        if not held:
            return ChatDelta()
        if self._state is _State.REASONING:
            return ChatDelta(reasoning=self._visible(held))
        return ChatDelta(content=self._visible(held))

    def _visible(self, text: str) -> str:
        if self._strip:
            text = text.lstrip()
            self._strip = not text
        return text


def split_reasoning(text: str, reasoning_format: str = "separate", in_reasoning: bool = False) -> ChatDelta:
    """The whole-text form of :class:`ReasoningSplitter` (non-streamed replies)."""
    splitter = ReasoningSplitter(reasoning_format, in_reasoning)
    out = splitter.feed(text)
    out += splitter.flush()
    return out


class ChatReply:
    """One reply's streamed text as the chat API shows it: reasoning, content and tool calls.

    Args:
        reasoning_format / in_reasoning: as :class:`ReasoningSplitter`.
        tools / fmt: the request's checked tools and the model's tool-call format; None (or
            ``choice`` "none") passes content through.

    Attributes:
        has_reasoning: a reasoning block was opened.
    """

    def __init__(self, reasoning_format: str = "separate", in_reasoning: bool = False,
                 tools: ToolSpec | None = None, fmt: ToolFormat = ToolFormat.GENERIC) -> None:
        self._reasoning = ReasoningSplitter(reasoning_format, in_reasoning)
        self._tools = ToolCallParser(tools, fmt) if tools is not None and tools.active else None

    @property
    def has_reasoning(self) -> bool:
        return self._reasoning.has_reasoning

    @property
    def tool_calls(self) -> list[ToolCall]:
        """The tool calls (after :meth:`flush`): the complete ones, and one ``max_tokens`` cut after
        its name, its arguments as far as they came (``ToolCallParser.flush``)."""
        return self._tools.tool_calls if self._tools is not None else []

    @property
    def cut_call(self) -> bool:
        """The reply ended inside a tool call (after :meth:`flush`; ``ToolCallParser.cut``): the
        ``finish_reason`` is the engine's, and an empty ``content`` is null (OpenAI's shape)."""
        return self._tools is not None and self._tools.cut

    def feed(self, text: str) -> ChatDelta:
        """Add the next piece of the reply; returns what can be shown now."""
        return self._calls(self._reasoning.feed(text))

    def flush(self, finish_reason: str) -> ChatDelta:
        """End of the reply: everything still held. ``finish_reason``: the engine's (``stop``,
        ``length``, ...), which decides what a call the end cut becomes (:meth:`ToolCallParser.flush`).

        Raises:
            TypeError: ``finish_reason`` is not a str (None: the reply has not ended).
        """
        if not isinstance(finish_reason, str):
            raise TypeError(f"flush needs the engine's finish_reason (a str), got {finish_reason!r}")
        out = self._calls(self._reasoning.flush())
        if self._tools is not None:
            end = self._tools.flush(finish_reason)
            out += ChatDelta(end.content, "", end.calls)
        return out

    def _calls(self, parts: ChatDelta) -> ChatDelta:
        """``parts``' content through the tool-call parser (which holds what may be a call)."""
        if self._tools is None:
            return parts
        tools = self._tools.feed(parts.content)
        return ChatDelta(tools.content, parts.reasoning, tools.calls)


def split_reply(text: str, finish_reason: str, reasoning_format: str = "separate", in_reasoning: bool = False,
                tools: ToolSpec | None = None, fmt: ToolFormat = ToolFormat.GENERIC) -> tuple[ChatDelta, ChatReply]:
    """The whole-text form of :class:`ChatReply` (non-streamed replies): the split and the reply
    object (``has_reasoning``, ``tool_calls``); ``finish_reason``: the engine's (:meth:`ChatReply.flush`)."""
    reply = ChatReply(reasoning_format, in_reasoning, tools, fmt)
    out = reply.feed(text)
    out += reply.flush(finish_reason)
    return out, reply
