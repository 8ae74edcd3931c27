"""``POST /v1/completions``: raw prompts (text or token ids), streamed or not, with echo and
legacy-shaped logprobs (echo + logprobs: the prompt's logprobs come from the engine's prefill,
``Request.prompt_logprobs``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request as HttpRequest
from fastapi.responses import Response

from monobatch.engine.finish import RowOutput
from monobatch.engine.params import resolve_sampling
from monobatch.engine.sequence import FinishReason
from monobatch.errors import InvalidRequestError
from monobatch.server.client import ResponseReader
from monobatch.server.generation import (Choice, EventStream, RequestLog, TextOffsets, build_requests,
                                         check_prompt_chars, compile_constraint, completion_logprobs, created, new_id,
                                         off_loop, respond, sse, stream_frame, usage)
from monobatch.server.protocol import CompletionRequest
from monobatch.server.state import ServerState
from monobatch.tokenizer import Tokenizer


def _prompt_list(prompt: str | list) -> list[str] | list[list[int]]:
    """The request's prompts: strings, or token-id lists (ids are the engine's to check)."""
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise InvalidRequestError("the prompt is empty (it must contain at least one token)", param="prompt")
    return [prompt] if isinstance(prompt[0], int) else list(prompt)


def _encode_all(tok: Tokenizer, texts: list[str]) -> list[list[int]]:
    """Each prompt's ids (blocking: run with :func:`off_loop`)."""
    return [tok.encode(t) for t in texts]


def _decode_all(tok: Tokenizer, prompts: list[list[int]]) -> list[str]:
    """Each id prompt's text, for ``echo`` (blocking: run with :func:`off_loop`)."""
    return [tok.decode(ids, skip_special_tokens=False) for ids in prompts]


@dataclass(slots=True)
class _Completion:
    """One completions request in flight: what shaping its response needs.

    ``prompt_texts`` is set with ``echo``. ``scoring`` marks echo + logprobs with
    ``max_tokens: 0`` (scoring a prompt, as lm-eval-harness does): the engine draws one token to
    deliver the prompt logprobs, and the client is shown none (vLLM does the same).
    """

    id: str
    model: str
    created: int
    body: CompletionRequest
    tok: Tokenizer
    prompts: list[list[int]]
    prompt_texts: list[str] | None
    scoring: bool
    record: RequestLog

    def _prompt_of(self, index: int) -> int:
        return index // self.body.n

    def _echo_text(self, index: int) -> str:
        return self.prompt_texts[self._prompt_of(index)] if self.body.echo else ""

    def _shown(self, out: RowOutput) -> RowOutput:
        """``out`` as the client sees it (the scoring draw hidden)."""
        if not self.scoring:
            return out
        return dataclasses.replace(out, token_ids=[], text="", logprobs=None, num_output_tokens=0,
                                   finish_reason=FinishReason.LENGTH if out.finished else None)

    def _choice(self, index: int, text: str, logprobs: dict | None, finish_reason: str | None,
                token_ids: list[int] | None) -> dict:
        out = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        if self.body.return_token_ids and token_ids is not None:
            out["token_ids"] = token_ids
        return out

    def _chunk(self, choices: list[dict], usage_: dict | None = None) -> dict:
        chunk = {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                 "choices": choices}
        if self.body.include_usage:
            chunk["usage"] = usage_
        return chunk

    def _prompt_logprobs(self, entries: list | None) -> dict:
        """The echoed prompt's logprobs (offsets from 0; the first token has none)."""
        return completion_logprobs(self.tok, entries or [], TextOffsets(self.tok))

    async def collect(self, reader: ResponseReader) -> list[Choice]:
        """Read every output of ``reader`` into one Choice per sequence."""
        async with reader:
            choices = [Choice(i) for i in range(len(reader.index))]
            async for i, out in reader:
                choices[i].add(self._shown(out))
        return choices

    def response(self, choices: list[Choice]) -> dict:
        """The non-streamed body."""
        rows = []
        for c in choices:
            prefix, logprobs = self._echo_text(c.index), None
            if self.body.logprobs is not None:
                logprobs = completion_logprobs(self.tok, c.logprobs, TextOffsets(self.tok, len(prefix)))
                if self.body.echo:
                    echoed = self._prompt_logprobs(c.prompt_logprobs)
                    logprobs = {k: echoed[k] + logprobs[k] for k in logprobs}
            row = self._choice(c.index, prefix + "".join(c.text), logprobs, c.finish_reason, c.token_ids)
            if self.body.return_token_ids:
                row["prompt_token_ids"] = self.prompts[self._prompt_of(c.index)]
            rows.append(row)
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": rows, "usage": usage(choices, self.body.n)}

    def stream(self, reader: ResponseReader) -> EventStream:
        """The SSE response: the echo first (with logprobs: once the choice's first output brings
        the prompt's), one chunk per output with text, usage, ``[DONE]`` (the frame is
        :func:`stream_frame`)."""
        choices = [Choice(i) for i in range(len(reader.index))]
        frame = stream_frame(reader, self._events(reader, choices), choices, self.body.n, self.body.include_usage,
                             self._chunk, self.record)
        return EventStream(frame, reader, self.record, choices)

    async def _events(self, reader: ResponseReader, choices: list[Choice]) -> AsyncIterator[str]:
        """The body of :meth:`stream`: echoes, then one chunk per output worth sending."""
        with_logprobs = self.body.logprobs is not None
        offsets = [TextOffsets(self.tok, len(self._echo_text(c.index))) for c in choices]
        if self.body.echo and not with_logprobs:
            for c in choices:
                yield sse(self._chunk([self._choice(c.index, self._echo_text(c.index), None, None, None)]))
        pending = [[] for _ in choices]  # token ids not sent yet (their text is held back)
        async for i, out in reader:
            out = self._shown(out)
            choices[i].add(out)
            if self.body.echo and with_logprobs and out.prompt_logprobs is not None:
                echoed = self._prompt_logprobs(out.prompt_logprobs)
                yield sse(self._chunk([self._choice(i, self._echo_text(i), echoed, None, None)]))
            pending[i] += out.token_ids
            if not (out.text or out.finished or (out.logprobs and with_logprobs)):
                continue
            logprobs = completion_logprobs(self.tok, out.logprobs or [], offsets[i]) if with_logprobs else None
            reason = out.finish_reason.value if out.finished else None
            yield sse(self._chunk([self._choice(i, out.text, logprobs, reason, pending[i])]))
            pending[i] = []


async def create_completion(body: CompletionRequest, http: HttpRequest, state: ServerState) -> Response:
    """Validate, tokenize, submit and answer one completions request (errors before any SSE byte)."""
    arrival = http.state.arrival_time
    client = state.require_client()
    model = state.check_model(body.model)
    tok = state.tokenizer
    given = _prompt_list(body.prompt)
    client.check_size(len(given) * body.n, "n" if len(given) == 1 else "prompt")
    sampling = body.sampling_request()
    if body.logprobs is not None:
        sampling["logprobs"] = body.logprobs
    params = resolve_sampling(sampling, state.sampling_flags, state.generation_defaults, entry_point="completions")
    want_prompt_lps = body.echo and body.logprobs is not None
    scoring = want_prompt_lps and params.max_tokens == 0
    if scoring:
        params = dataclasses.replace(params, max_tokens=1)
    await compile_constraint(state.grammars, params)
    texts = None
    if isinstance(given[0], str):
        texts = given
        for text in texts:
            check_prompt_chars(len(text), state.max_prompt_chars, state.max_model_len, "prompt")
        prompts = await off_loop(_encode_all, tok, texts)
    else:
        prompts = given
    completion_id = new_id("cmpl")
    requests = build_requests(completion_id, prompts, params, body.n, arrival_time=arrival,
                              bypass_prefix_cache=not body.cache_prompt,
                              prompt_logprobs=body.logprobs if want_prompt_lps else None)
    reader = await client.submit(requests)
    try:
        if body.echo and texts is None:
            texts = await off_loop(_decode_all, tok, prompts)  # the ids are valid: the engine took them
    except BaseException:
        reader.close()
        raise
    job = _Completion(completion_id, model, created(), body, tok, prompts, texts, scoring,
                      RequestLog(completion_id, http.url.path, arrival, body.stream, body.n))
    if body.stream:
        return job.stream(reader)
    return await respond(http, reader, job.collect(reader), job.response, job.record)
