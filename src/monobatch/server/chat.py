"""``POST /v1/chat/completions``: messages through the chat template, streamed or not, with the
reasoning split of :mod:`monobatch.chat_output` and chat-shaped logprobs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Request as HttpRequest
from fastapi.responses import Response

from monobatch.chat_output import ChatDelta, ChatReply, split_reply
from monobatch.chat_prompt import ChatPrompt, prepare_chat
from monobatch.engine.params import resolve_sampling
from monobatch.errors import InvalidRequestError
from monobatch.server.client import ResponseReader
from monobatch.server.generation import (Choice, EventStream, RequestLog, build_requests, chat_logprobs,
                                         check_prompt_chars, compile_constraint, created, new_id, off_loop, respond,
                                         sse, stream_frame, usage)
from monobatch.server.protocol import ChatCompletionRequest
from monobatch.server.state import ServerState
from monobatch.tokenizer import Tokenizer

def message_chars(messages: list) -> int:
    """Characters of the messages' text (string content and text parts), for the cheap length
    bound checked before the template runs."""
    total = 0
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, str):
            total += len(content)
        elif isinstance(content, list):
            total += sum(len(part["text"]) for part in content
                         if isinstance(part, dict) and isinstance(part.get("text"), str))
    return total


def chat_prompt_ids(tok: Tokenizer, messages: list, add_generation_prompt: bool,
                    template_kwargs: dict[str, Any] | None, tools: Any = None, tool_choice: Any = None,
                    parallel_tool_calls: Any = None) -> list[int]:
    """The prompt ids of a conversation (``/tokenize`` with ``messages``, and its ``tools``): the
    ids a chat request with the same fields gets (:func:`monobatch.chat_prompt.prepare_chat`).
    Blocking: run it with :func:`off_loop`.

    Raises:
        InvalidRequestError: bad messages or tools, a template's ``raise_exception``, reserved kwargs.
    """
    return prepare_chat(tok, messages, tools=tools, tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls,
                        add_generation_prompt=add_generation_prompt, template_kwargs=template_kwargs).prompt_ids


@dataclass(slots=True)
class _Chat:
    """One chat request in flight: what shaping its response needs."""

    id: str
    model: str
    created: int
    body: ChatCompletionRequest
    tok: Tokenizer
    chat: ChatPrompt
    reasoning_format: str
    record: RequestLog

    @property
    def prompt_ids(self) -> list[int]:
        return self.chat.prompt_ids

    def splitter(self) -> ChatReply:
        """A fresh reply splitter for one choice: reasoning (this request's format, and whether
        the prompt left a ``<think>`` block open), content and tool calls."""
        return ChatReply(self.reasoning_format, self.chat.in_reasoning, self.chat.tools, self.chat.fmt)

    def finish_reason(self, c: Choice, reply: ChatReply) -> str | None:
        """``tool_calls`` when the reply called tools and ended normally (:meth:`ChatPrompt.finish_reason`);
        kept on ``c`` as the reason the response reports (the request log's)."""
        c.api_finish_reason = self.chat.finish_reason(c.finish_reason, bool(reply.tool_calls), reply.cut_call)
        return c.api_finish_reason

    def _chunk(self, choices: list[dict], usage_: dict | None = None) -> dict:
        chunk = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                 "choices": choices}
        if self.body.include_usage:
            chunk["usage"] = usage_
        return chunk

    async def collect(self, reader: ResponseReader) -> list[Choice]:
        """Read every output of ``reader`` into one Choice per sequence."""
        async with reader:
            choices = [Choice(i) for i in range(len(reader.index))]
            async for i, out in reader:
                choices[i].add(out)
        return choices

    def response(self, choices: list[Choice]) -> dict:
        """The non-streamed body."""
        rows = []
        for c in choices:
            parts, reply = split_reply("".join(c.text), c.finish_reason, self.reasoning_format,
                                       self.chat.in_reasoning, self.chat.tools, self.chat.fmt)
            message = {"role": "assistant", "content": parts.content}
            if reply.has_reasoning:
                message["reasoning_content"] = parts.reasoning
            if reply.tool_calls or reply.cut_call:  # OpenAI: content null when the reply is only calls (or
                message["content"] = parts.content or None  # a call cut before its name: no call, no content)
            if reply.tool_calls:
                message["tool_calls"] = [call.to_openai() for call in reply.tool_calls]
            row = {"index": c.index, "message": message,
                   "logprobs": chat_logprobs(self.tok, c.logprobs) if self.body.logprobs else None,
                   "finish_reason": self.finish_reason(c, reply)}
            if self.body.return_token_ids:
                row["token_ids"] = c.token_ids
            rows.append(row)
        out = {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
               "choices": rows, "usage": usage(choices, self.body.n)}
        if self.body.return_token_ids:
            out["prompt_token_ids"] = self.prompt_ids
        return out

    def stream(self, reader: ResponseReader) -> EventStream:
        """The SSE response: the role first per choice, one chunk per output with text, a final
        chunk per choice with its finish_reason, usage, ``[DONE]`` (case F1; the frame is
        :func:`stream_frame`)."""
        choices = [Choice(i) for i in range(len(reader.index))]
        frame = stream_frame(reader, self._events(reader, choices), choices, self.body.n, self.body.include_usage,
                             self._chunk, self.record)
        return EventStream(frame, reader, self.record, choices)

    async def _events(self, reader: ResponseReader, choices: list[Choice]) -> AsyncIterator[str]:
        """The body of :meth:`stream`: role chunks, then one chunk per output worth sending.

        Without tools each choice's role chunk (``content: ""``) comes first, before any token.
        With tools offered it waits for the choice's first piece, so that it says what OpenAI's
        says: a call first gets the role with ``content: null`` in the call's own delta; text
        first gets ``content: ""`` before it, and so does the end of a reply with no call. The
        logprobs rows of the tokens before that first piece wait with it (as their token ids do)
        and come in its chunk: the text's, or the call's. Reasoning first is streamed at once
        (it can be long), so its role chunk says ``content: null`` (DeepSeek's reasoning stream
        does too), and a reply that then ends with no content, no call and no cut call gets
        ``content: ""`` in its last delta. The ``openai`` client's accumulated message then has
        the non-streamed ``content`` (null for a reply of only calls) and logprobs.
        """
        n = len(choices)
        splitters = [self.splitter() for _ in range(n)]
        announced = [not self.chat.tools.active] * n  # role chunk sent (without tools: at once, below)
        null_role = [False] * n  # the role chunk said content null and no content came yet
        for i in range(n) if not self.chat.tools.active else ():
            yield sse(self._chunk([self._first(i, {"role": "assistant", "content": ""})]))
        pending = [[] for _ in range(n)]  # token ids not sent yet (their text is held back)
        held: list[list] = [[] for _ in range(n)]  # logprobs rows not sent yet (the role chunk waits)
        async for i, out in reader:
            choices[i].add(out)
            pending[i] += out.token_ids
            parts: ChatDelta = splitters[i].feed(out.text)
            if out.finished:
                parts += splitters[i].flush(choices[i].finish_reason)
            if self.body.logprobs and out.logprobs:
                held[i] += out.logprobs
            reason = self.finish_reason(choices[i], splitters[i]) if out.finished else None
            text = parts.content or parts.reasoning or announced[i] and held[i]
            if text or (out.finished and not parts.tool_calls):  # text before any call it preceded
                textual = not splitters[i].tool_calls and not splitters[i].cut_call  # content "", never null
                if not announced[i]:
                    announced[i], null_role[i] = True, not (parts.content or out.finished and textual)
                    yield sse(self._chunk([self._first(i, {"role": "assistant",
                                                           "content": None if null_role[i] else ""})]))
                null_role[i] = null_role[i] and not parts.content
                empty = out.finished and null_role[i] and textual
                yield self._row(i, parts, held[i], None if parts.tool_calls else reason, pending[i],
                                empty_content=empty)
                pending[i], held[i] = [], []
            for call in parts.tool_calls:  # id and name first, then the arguments (OpenAI's stream shape)
                first = call.to_openai()
                args = first["function"]["arguments"]
                first["function"]["arguments"] = ""
                if not announced[i]:  # OpenAI's first delta of a reply that starts with a call
                    announced[i] = True
                    row = self._first(i, {"role": "assistant", "content": None, "tool_calls": [first]})
                    row["logprobs"] = chat_logprobs(self.tok, held[i]) if held[i] else None
                    if self.body.return_token_ids:  # the tokens held with those logprobs
                        row["token_ids"], pending[i] = pending[i], []
                    held[i] = []
                else:
                    row = {"index": i, "delta": {"tool_calls": [first]}, "logprobs": None, "finish_reason": None}
                yield sse(self._chunk([row]))
                if args:
                    yield sse(self._chunk([{"index": i, "delta": {"tool_calls": [
                        {"index": call.index, "function": {"arguments": args}}]}, "logprobs": None,
                        "finish_reason": None}]))
            if out.finished and parts.tool_calls:
                yield self._row(i, ChatDelta(), None, reason, pending[i])
                pending[i] = []

    def _first(self, i: int, delta: dict) -> dict:
        """The choice object of choice ``i``'s first chunk (``delta`` carries the role); choice 0's
        has ``prompt_token_ids`` with ``return_token_ids``."""
        first = {"index": i, "delta": delta, "logprobs": None, "finish_reason": None}
        if self.body.return_token_ids and i == 0:
            first["prompt_token_ids"] = self.prompt_ids
        return first

    def _row(self, i: int, parts: ChatDelta, logprobs: list | None, reason: str | None, token_ids: list[int],
             empty_content: bool = False) -> str:
        """One SSE chunk of choice ``i``: its text, logprobs, finish_reason and token ids
        (``empty_content``: ``content: ""`` when there is no text, see :meth:`_events`)."""
        delta = {}
        if parts.content or empty_content:
            delta["content"] = parts.content
        if parts.reasoning:
            delta["reasoning_content"] = parts.reasoning
        row = {"index": i, "delta": delta, "logprobs": chat_logprobs(self.tok, logprobs) if logprobs else None,
               "finish_reason": reason}
        if self.body.return_token_ids:
            row["token_ids"] = token_ids
        return sse(self._chunk([row]))


async def create_chat_completion(body: ChatCompletionRequest, http: HttpRequest, state: ServerState) -> Response:
    """Validate, render, submit and answer one chat request (errors before any SSE byte)."""
    arrival = http.state.arrival_time
    client = state.require_client()
    model = state.check_model(body.model)
    tok = state.tokenizer
    client.check_size(body.n, "n")
    params = resolve_sampling(body.sampling_request(), state.sampling_flags, state.generation_defaults,
                              entry_point="chat")
    check_prompt_chars(message_chars(body.messages), state.max_prompt_chars, state.max_model_len, "messages")
    chat = await off_loop(prepare_chat, tok, body.messages, tools=body.tools, tool_choice=body.tool_choice,
                          parallel_tool_calls=body.parallel_tool_calls, add_generation_prompt=body.add_generation_prompt,
                          template_kwargs=body.chat_template_kwargs)
    params = chat.apply(params)  # the tool constraint; special tokens kept for a marker format
    await compile_constraint(state.grammars, params)
    chat_id = new_id("chatcmpl")
    requests = build_requests(chat_id, [chat.prompt_ids], params, body.n, arrival_time=arrival,
                              bypass_prefix_cache=not body.cache_prompt)
    try:
        reader = await client.submit(requests)
    except InvalidRequestError as exc:  # the engine names its input "prompt"; a chat request's is "messages"
        if exc.param == "prompt":
            exc.param = "messages"
        raise
    job = _Chat(chat_id, model, created(), body, tok, chat, body.reasoning_format or state.settings.reasoning_format,
                RequestLog(chat_id, http.url.path, arrival, body.stream, body.n))
    if body.stream:
        return job.stream(reader)
    return await respond(http, reader, job.collect(reader), job.response, job.record)
