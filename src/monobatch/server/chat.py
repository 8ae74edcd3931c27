"""``POST /v1/chat/completions``: messages through the chat template, streamed or not, with the
reasoning split of :mod:`monobatch.chat_output` and chat-shaped logprobs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Request as HttpRequest
from fastapi.responses import Response

from monobatch.chat_output import ChatDelta, ReasoningSplitter, prompt_opens_reasoning
from monobatch.engine.params import resolve_sampling
from monobatch.errors import InvalidRequestError
from monobatch.server.client import ResponseReader
from monobatch.server.generation import (Choice, EventStream, build_requests, chat_logprobs, check_prompt_chars,
                                         compile_constraint, created, new_id, off_loop, respond, sse, stream_frame,
                                         usage)
from monobatch.server.protocol import ChatCompletionRequest
from monobatch.server.state import ServerState
from monobatch.tokenizer import Tokenizer

#: Template variables a request's chat_template_kwargs may not replace.
_RESERVED_TEMPLATE_VARS = frozenset({"messages", "add_generation_prompt", "bos_token", "eos_token"})
#: Prompt tokens decoded to see whether the rendered prompt leaves a ``<think>`` block open.
_TAIL_TOKENS = 16


def template_messages(messages: list) -> list:
    """The request's messages as the chat template gets them: OpenAI's ``developer`` role (its
    newer name for ``system``) becomes ``system``; everything else is the template module's to
    check. The client's dicts are not modified."""
    return [{**m, "role": "system"} if isinstance(m, dict) and m.get("role") == "developer" else m
            for m in messages]


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
                    template_kwargs: dict[str, Any] | None) -> list[int]:
    """The prompt ids of a conversation: :meth:`Tokenizer.encode_chat` (one BOS at most: case
    F2). Blocking (the template and the tokenizer): run it with :func:`off_loop`.

    Raises:
        InvalidRequestError: bad messages, a template's ``raise_exception``, reserved kwargs.
    """
    kwargs = template_kwargs or {}
    clash = sorted(_RESERVED_TEMPLATE_VARS & kwargs.keys())
    if clash:
        raise InvalidRequestError(f"chat_template_kwargs: may not set {', '.join(clash)}", "chat_template_kwargs")
    return tok.encode_chat(template_messages(messages), add_generation_prompt, **kwargs)


@dataclass(slots=True)
class _Chat:
    """One chat request in flight: what shaping its response needs."""

    id: str
    model: str
    created: int
    body: ChatCompletionRequest
    tok: Tokenizer
    prompt_ids: list[int]
    reasoning_format: str
    in_reasoning: bool

    def splitter(self) -> ReasoningSplitter:
        """A fresh reasoning splitter for one choice (this request's format, and whether the
        prompt left a ``<think>`` block open)."""
        return ReasoningSplitter(self.reasoning_format, self.in_reasoning)

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
            splitter = self.splitter()
            parts = splitter.feed("".join(c.text))
            parts += splitter.flush()
            message = {"role": "assistant", "content": parts.content}
            if splitter.has_reasoning:
                message["reasoning_content"] = parts.reasoning
            row = {"index": c.index, "message": message,
                   "logprobs": chat_logprobs(self.tok, c.logprobs) if self.body.logprobs else None,
                   "finish_reason": c.finish_reason}
            if self.body.return_token_ids:
                row["token_ids"] = c.token_ids
            rows.append(row)
        out = {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
               "choices": rows, "usage": usage(choices, self.body.n)}
        if self.body.return_token_ids:
            out["prompt_token_ids"] = self.prompt_ids
        return out

    def stream(self, reader: ResponseReader) -> AsyncIterator[str]:
        """The SSE events: the role first per choice, one chunk per output with text, a final
        chunk per choice with its finish_reason, usage, ``[DONE]`` (case F1; the frame is
        :func:`stream_frame`)."""
        choices = [Choice(i) for i in range(len(reader.index))]
        return stream_frame(reader, self._events(reader, choices), choices, self.body.n, self.body.include_usage,
                            self._chunk)

    async def _events(self, reader: ResponseReader, choices: list[Choice]) -> AsyncIterator[str]:
        """The body of :meth:`stream`: role chunks, then one chunk per output worth sending."""
        n = len(choices)
        splitters = [self.splitter() for _ in range(n)]
        for i in range(n):
            first = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                     "finish_reason": None}
            if self.body.return_token_ids and i == 0:
                first["prompt_token_ids"] = self.prompt_ids
            yield sse(self._chunk([first]))
        pending = [[] for _ in range(n)]  # token ids not sent yet (their text is held back)
        async for i, out in reader:
            choices[i].add(out)
            pending[i] += out.token_ids
            parts: ChatDelta = splitters[i].feed(out.text)
            if out.finished:
                parts += splitters[i].flush()
            wants_logprobs = self.body.logprobs and out.logprobs
            if not (parts or out.finished or wants_logprobs):
                continue
            delta = {}
            if parts.content:
                delta["content"] = parts.content
            if parts.reasoning:
                delta["reasoning_content"] = parts.reasoning
            row = {"index": i, "delta": delta,
                   "logprobs": chat_logprobs(self.tok, out.logprobs) if wants_logprobs else None,
                   "finish_reason": out.finish_reason.value if out.finished else None}
            if self.body.return_token_ids:
                row["token_ids"] = pending[i]
            pending[i] = []
            yield sse(self._chunk([row]))


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
    await compile_constraint(state.grammars, params)
    prompt_ids = await off_loop(chat_prompt_ids, tok, body.messages, body.add_generation_prompt,
                                body.chat_template_kwargs)
    in_reasoning = prompt_opens_reasoning(tok.decode(prompt_ids[-_TAIL_TOKENS:], skip_special_tokens=False))
    chat_id = new_id("chatcmpl")
    requests = build_requests(chat_id, [prompt_ids], params, body.n, arrival_time=arrival,
                              bypass_prefix_cache=not body.cache_prompt)
    reader = await client.submit(requests)
    job = _Chat(chat_id, model, created(), body, tok, prompt_ids,
                body.reasoning_format or state.settings.reasoning_format, in_reasoning)
    if body.stream:
        return EventStream(job.stream(reader), reader)
    return await respond(http, reader, job.collect(reader), job.response)
