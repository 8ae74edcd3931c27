"""``POST /v1/completions``: raw prompts (text or token ids), streamed or not, with echo and
legacy-shaped logprobs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request as HttpRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse

from monobatch.engine.params import resolve_sampling
from monobatch.errors import InvalidRequestError
from monobatch.server.client import EngineFailed, ResponseReader
from monobatch.server.errors import APIError, error_body
from monobatch.server.generation import (SSE_DONE, SSE_HEADERS, Choice, ClientGone, build_requests,
                                         completion_logprobs, created, new_id, prompt_logprobs, sse, streamed,
                                         unless_disconnected, usage)
from monobatch.server.protocol import CompletionRequest
from monobatch.server.state import ServerState
from monobatch.tokenizer import Tokenizer


def _prompts(prompt: str | list, tok: Tokenizer) -> tuple[list[list[int]], list[str]]:
    """Token ids and text of each prompt (a string, strings, ids, or lists of ids)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise InvalidRequestError("prompt: is empty", param="prompt")
    if isinstance(prompt[0], str):
        return [tok.encode(p) for p in prompt], list(prompt)
    lists = [prompt] if isinstance(prompt[0], int) else prompt
    if any(not 0 <= t < tok.vocab_size for ids in lists for t in ids):
        raise InvalidRequestError(f"prompt: token ids must be in [0, {tok.vocab_size})", param="prompt")
    return [list(ids) for ids in lists], [tok.decode(ids, skip_special_tokens=False) for ids in lists]


@dataclass(slots=True)
class _Completion:
    """One completions request in flight: what shaping its response needs."""

    id: str
    model: str
    created: int
    body: CompletionRequest
    tok: Tokenizer
    prompts: list[list[int]]
    prompt_texts: list[str]
    prompt_lps: list[list] | None

    def _prompt_of(self, index: int) -> int:
        return index // self.body.n

    def _echo(self, index: int) -> tuple[str, dict | None]:
        """The echoed prompt text and its logprobs for choice ``index``."""
        p = self._prompt_of(index)
        lps = None
        if self.prompt_lps is not None:
            lps = completion_logprobs(self.tok, self.prompt_lps[p], 0)
        return self.prompt_texts[p], lps

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
            text, logprobs = "".join(c.text), None
            prefix, echo_lps = self._echo(c.index) if self.body.echo else ("", None)
            if self.body.logprobs is not None:
                logprobs = completion_logprobs(self.tok, c.logprobs, len(prefix))
                if echo_lps is not None:
                    logprobs = {k: echo_lps[k] + logprobs[k] for k in logprobs}
            row = self._choice(c.index, prefix + text, logprobs, c.finish_reason, c.token_ids)
            if self.body.return_token_ids:
                row["prompt_token_ids"] = self.prompts[self._prompt_of(c.index)]
            rows.append(row)
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": rows, "usage": usage(choices, self.body.n)}

    async def stream(self, reader: ResponseReader) -> AsyncIterator[str]:
        """The SSE events: echo first, one chunk per output with text, usage, ``[DONE]``."""
        choices = [Choice(i) for i in range(len(reader.index))]
        offsets = [0] * len(choices)
        try:
            async with reader:
                if self.body.echo:
                    for c in choices:
                        text, lps = self._echo(c.index)
                        offsets[c.index] = len(text)
                        yield sse(self._chunk([self._choice(c.index, text, lps, None, None)]))
                pending = [[] for _ in choices]  # token ids not sent yet (their text is held back)
                async for i, out in reader:
                    choices[i].add(out)
                    pending[i] += out.token_ids
                    if not (out.text or out.finished or (out.logprobs and self.body.logprobs is not None)):
                        continue
                    logprobs = None
                    if self.body.logprobs is not None:
                        logprobs = completion_logprobs(self.tok, out.logprobs or [], offsets[i])
                    offsets[i] += len(out.text)
                    reason = out.finish_reason.value if out.finished else None
                    yield sse(self._chunk([self._choice(i, out.text, logprobs, reason, pending[i])]))
                    pending[i] = []
            if self.body.include_usage:
                yield sse(self._chunk([], usage(choices, self.body.n)))
        except EngineFailed as exc:
            yield sse(error_body(500, str(exc)))
        yield SSE_DONE


async def create_completion(body: CompletionRequest, http: HttpRequest, state: ServerState) -> Response:
    """Validate, submit and answer one completions request (errors before any SSE byte)."""
    client = state.require_client()
    model = state.check_model(body.model)
    tok = state.tokenizer
    sampling = body.sampling_request()
    if body.logprobs is not None:
        sampling["logprobs"] = body.logprobs
    params = resolve_sampling(sampling, state.sampling_flags, state.generation_defaults, entry_point="completions")
    prompts, texts = _prompts(body.prompt, tok)
    want_prompt_lps = body.echo and body.logprobs is not None
    completion_id = new_id("cmpl")
    requests = build_requests(completion_id, prompts, params, body.n,
                              bypass_prefix_cache=want_prompt_lps or not body.cache_prompt)
    reader = await client.submit(requests)
    try:
        prompt_lps = None
        if want_prompt_lps:
            k = body.logprobs
            prompt_lps = [await client.call(lambda s, ids=ids: prompt_logprobs(s.engine, ids, k)) for ids in prompts]
    except BaseException:
        reader.close()
        raise
    job = _Completion(completion_id, model, created(), body, tok, prompts, texts,
                      prompt_lps)
    if body.stream:
        return StreamingResponse(streamed(job.stream(reader), reader), media_type="text/event-stream",
                                 headers=SSE_HEADERS)
    try:
        choices = await unless_disconnected(http, job.collect(reader))
    except ClientGone:
        return Response(status_code=499)
    except EngineFailed as exc:
        raise APIError(500, str(exc)) from exc
    return JSONResponse(job.response(choices))
