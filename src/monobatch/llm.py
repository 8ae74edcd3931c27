"""``monobatch.LLM``: offline batched generation from Python, shaped like vLLM's ``LLM``.

    from monobatch import LLM, SamplingParams
    llm = LLM()                      # the bundled SmolLM2-135M-Instruct; or LLM("model.gguf")
    outs = llm.generate(["The capital of France is", "def fib(n):"],
                        SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].outputs[0].text)

It submits every prompt to the one decode loop (:class:`BatchScheduler`) at once and steps it
until all are done: continuous batching, the prefix cache and the sampler are the ones the server
and the CLI use, so a request gives the same tokens here as there.
"""

from __future__ import annotations

import itertools
import logging
import numbers
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence, Union

from tqdm.auto import tqdm

from monobatch import defaults
from monobatch.chat_output import split_reply
from monobatch.engine.engine import Engine, EngineConfig
from monobatch.engine.finish import RequestMetrics
from monobatch.engine.params import SamplingParams, resolve_sampling
from monobatch.engine.scheduler import BatchScheduler
from monobatch.engine.sequence import Request
from monobatch.errors import InvalidRequestError
from monobatch.loader import LoadedModel, load_model

#: One prompt: text, token ids, or vLLM's ``{"prompt": text}`` / ``{"prompt_token_ids": ids}``.
PromptType = Union[str, Sequence[int], Mapping[str, Any]]
#: The forms one prompt may take, and what ``generate`` accepts (named by the error for any other shape).
_ONE_PROMPT_FORMS = 'a string, a list of token ids, {"prompt": str} or {"prompt_token_ids": [int, ...]}'
_PROMPT_FORMS = f"one prompt ({_ONE_PROMPT_FORMS}) or a non-empty list of them"
log = logging.getLogger("monobatch")


@dataclass(slots=True)
class CompletionOutput:
    """One generated continuation (vLLM's shape).

    Attributes:
        index: position among a request's outputs (always 0: one output per request).
        text: the generated text (stop string excluded unless include_stop_str_in_output).
        token_ids: generated token ids.
        finish_reason: ``stop`` | ``length`` | ``loop`` | ``abort``; :meth:`LLM.chat` with tools
            reports ``tool_calls`` where the chat endpoint does (complete calls, generation
            ended normally, no named tool_choice).
        logprobs: per token ``(token_id, logprob, [(alt_id, alt_logprob), ...])`` when asked.
        tool_calls: :meth:`LLM.chat` with tools: the calls parsed from ``text``
            (:class:`monobatch.tool_calls.ToolCall`: id, name, arguments as JSON text;
            ``.to_openai()`` gives the API's shape); None otherwise. A call that ``max_tokens``
            cut after its name is the last one, its arguments the text as far as it came (not
            JSON), and ``finish_reason`` is then ``length``; a call a stop string cut is no call
            (its text stays in ``text``), so with any other ``finish_reason`` every call is whole.
    """

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] | None = None
    tool_calls: list | None = None


@dataclass(slots=True)
class RequestOutput:
    """The result of one prompt (vLLM's shape).

    Attributes:
        request_id: the id it ran under.
        prompt: the prompt text (None when token ids were given).
        prompt_token_ids: the ids the model saw (chat template and BOS applied).
        outputs: the continuations (one).
        num_cached_tokens: prompt tokens served by the prefix cache.
        metrics: TTFT, ITL, decode rate.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None

    @property
    def finished(self) -> bool:
        """Always True for outputs returned by :meth:`LLM.generate`."""
        return bool(self.outputs)


class LLM:
    """A model and its engine, for batched offline generation.

    Args:
        model: a ``.gguf`` file or a Hugging Face folder; None for the bundled model.
        device, dtype: as ``--device`` / ``--dtype`` (``auto``: CUDA bfloat16 when present, else
            CPU float32).
        max_model_len, max_num_seqs, prefill_chunk, max_num_batched_tokens, kv_storage,
        kv_cache_memory, deterministic: :class:`EngineConfig` fields (the CLI flags of the same
            names).
        enforce_eager: no CUDA graphs for decode steps (``--enforce-eager``; vLLM's name).
        async_scheduling: launch decode step N+1 before reading step N's tokens back (None: on
            CUDA; ``--no-async-scheduling`` is False).
        tensor_parallel_size: ranks to shard the model over, one process each (vLLM's name;
            ``--tensor-parallel-size``; ADR 0007).
        chat_template: a jinja template replacing the model's.
        progress: show the loading bar (on a terminal).
        loaded: an already loaded model to share (skips loading).

    Raises:
        ModelNotFoundError, UnsupportedModelError, InsufficientMemoryError, InvalidRequestError.
    """

    def __init__(self, model: str | None = None, *, device: str = "auto", dtype: str = "auto",
                 max_model_len: int | None = None, max_num_seqs: int = defaults.MAX_NUM_SEQS,
                 prefill_chunk: int = defaults.PREFILL_CHUNK, max_num_batched_tokens: int | None = None,
                 kv_storage: str = defaults.KV_STORAGE, kv_cache_memory: int | None = None,
                 deterministic: bool = False, enforce_eager: bool = False, async_scheduling: bool | None = None,
                 chat_template: str | None = None, weights: str | None = None, tensor_parallel_size: int = 1,
                 progress: bool = True, loaded: LoadedModel | None = None) -> None:
        for name, value, kinds in (("model", model, (str, os.PathLike)), ("device", device, (str,)),
                                   ("dtype", dtype, (str,)), ("chat_template", chat_template, (str,)),
                                   ("weights", weights, (str,)), ("enforce_eager", enforce_eager, (bool,))):
            if not (isinstance(value, kinds) or (value is None and name != "enforce_eager")):  # None: the default
                raise InvalidRequestError(f"{name} must be {' or '.join(k.__name__ for k in kinds)}, not {value!r}",
                                          name)
        config = EngineConfig(max_model_len=max_model_len, max_num_seqs=max_num_seqs, prefill_chunk=prefill_chunk,
                              max_num_batched_tokens=max_num_batched_tokens, kv_storage=kv_storage,
                              kv_cache_memory=kv_cache_memory, deterministic=deterministic,
                              cuda_graphs=not enforce_eager, async_scheduling=async_scheduling,
                              tensor_parallel_size=tensor_parallel_size)
        self.loaded = loaded or load_model(model, device, dtype, chat_template=chat_template, progress=progress,
                                           weights=weights)
        self.scheduler = BatchScheduler(Engine(self.loaded, config))
        log.info("%s", self.scheduler.engine.describe())
        self._ids = itertools.count()
        self._closed = False

    @property
    def tokenizer(self):
        """The model's :class:`monobatch.tokenizer.Tokenizer`."""
        return self.loaded.tokenizer

    def close(self) -> None:
        """Stop the engine's tensor-parallel ranks, if any (their processes exit; also done at
        interpreter exit). Idempotent; :meth:`generate` and :meth:`chat` raise RuntimeError after.
        ``with LLM(...) as llm:`` closes on leaving the block."""
        if not self._closed:
            self._closed = True
            self.scheduler.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def default_sampling_params(self) -> SamplingParams:
        """What a call without ``sampling_params`` uses: the model's generation config over the
        defaults table, ``max_tokens`` 16 (vLLM's default)."""
        return resolve_sampling(None, {}, self.loaded.generation_defaults, entry_point="python")

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Complete every prompt; outputs in the order of ``prompts``.

        Args:
            prompts: one prompt or a non-empty list of them, mixed freely. A prompt is a string,
                a list of token ids, or vLLM's ``{"prompt": str}`` / ``{"prompt_token_ids":
                [int, ...]}`` (exactly one of the two keys). Raw completion: text is encoded as
                is (special-token text parsed, as llama.cpp does), BOS per the model.
            sampling_params: one for all prompts, one per prompt, or None for
                :meth:`default_sampling_params`.
            use_tqdm: a progress bar over finished requests (shown on a terminal).

        Returns:
            One :class:`RequestOutput` per prompt, in order; ``prompt`` is the text of a text
            prompt, None for token ids.

        Raises:
            InvalidRequestError / ContextLengthError: a bad prompt or parameter; nothing runs.
                Any prompt shape other than those above (None, a number, a bool, a dict with
                other keys or both keys, a list nested too deep) is an InvalidRequestError
                naming the accepted forms.
        """
        items = self._as_prompts(prompts)
        encoded = [(p, self.tokenizer.encode(p)) if isinstance(p, str) else (None, p) for p in items]
        return self._run(encoded, sampling_params, use_tqdm)

    def chat(self, messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True, *, tools: list[dict] | None = None,
             tool_choice: str | dict | None = None, parallel_tool_calls: bool | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Answer one conversation or a list of them through the model's chat template.

        Args:
            messages: ``[{"role": ..., "content": ...}, ...]`` or a list of such lists (roles
                system/user/assistant/tool, OpenAI's shape; assistant ``tool_calls`` too).
            sampling_params: as for :meth:`generate` (``structured`` constrains the reply).
            use_tqdm: a progress bar over finished requests (shown on a terminal).
            add_generation_prompt: end the prompt with the template's assistant header.
            tools, tool_choice, parallel_tool_calls: OpenAI's tool-calling fields, as the
                server's chat endpoint takes them (``required`` and a named function are enforced
                by a grammar); each output's ``tool_calls`` holds the parsed calls.
            chat_template_kwargs: extra template variables.

        Returns:
            One :class:`RequestOutput` per conversation, in order (``prompt`` is None; the
            rendered ids are in ``prompt_token_ids``).

        Raises:
            InvalidRequestError: a malformed conversation or tools, a model without a chat
                template, a tool_choice that constrains combined with ``structured``.
        """
        from monobatch.chat_prompt import prepare_chat

        conversations = _conversations(messages)
        chats = [prepare_chat(self.tokenizer, c, tools=tools, tool_choice=tool_choice,
                              parallel_tool_calls=parallel_tool_calls, add_generation_prompt=add_generation_prompt,
                              template_kwargs=chat_template_kwargs) for c in conversations]
        params = [chat.apply(sp) for chat, sp in zip(chats, self._params_for(sampling_params, len(chats)))]
        outs = self._run([(None, chat.prompt_ids) for chat in chats], params, use_tqdm)
        for chat, out in zip(chats, outs):
            if chat.tools.active:  # parsed as the chat endpoint parses (reasoning split first)
                o = out.outputs[0]
                _, reply = split_reply(o.text, o.finish_reason, "separate", chat.in_reasoning, chat.tools, chat.fmt)
                o.tool_calls = reply.tool_calls
                o.finish_reason = chat.finish_reason(o.finish_reason, bool(reply.tool_calls), reply.cut_call)
        return outs

    @staticmethod
    def _as_prompts(prompts: Any) -> list[str | list[int]]:
        """Each prompt of ``generate``'s argument as its text or its token id list.

        Raises:
            InvalidRequestError: a shape other than :data:`_PROMPT_FORMS`.
        """
        if isinstance(prompts, (str, Mapping)):
            return [_one_prompt(prompts, "prompts")]
        if not _is_list(prompts) or len(prompts) == 0:
            raise InvalidRequestError(f"prompts must be {_PROMPT_FORMS}; got {_shape(prompts)}", "prompts")
        if all(_is_token_id(t) for t in prompts):
            return [[int(t) for t in prompts]]  # one tokenized prompt
        return [_one_prompt(p, f"prompts[{i}]") for i, p in enumerate(prompts)]

    def _params_for(self, sampling_params, n: int) -> list[SamplingParams]:
        """One SamplingParams per prompt (see :meth:`generate`)."""
        if sampling_params is None:
            return [self.default_sampling_params()] * n
        if isinstance(sampling_params, SamplingParams):
            sampling_params.validate()  # again: a field may have been assigned since construction
            return [sampling_params] * n
        if not isinstance(sampling_params, (list, tuple)):
            raise InvalidRequestError(
                "sampling_params must be a SamplingParams, a list of them (one per prompt) or None, not "
                + _kind(sampling_params), "sampling_params")
        for i, sp in enumerate(sampling_params):
            if not isinstance(sp, SamplingParams):
                raise InvalidRequestError(f"sampling_params[{i}] must be a SamplingParams, not {_kind(sp)}",
                                          "sampling_params")
        params = list(sampling_params)
        if len(params) != n:
            raise InvalidRequestError(f"{len(params)} sampling_params for {n} prompts", "sampling_params")
        for sp in params:  # checked again: a field may have been assigned since construction
            sp.validate()
        return params

    def _run(self, encoded: list[tuple[str | None, list[int]]], sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        if self._closed:
            raise RuntimeError("this LLM is closed (LLM.close() or the end of its `with` block)")
        params = self._params_for(sampling_params, len(encoded))
        for sp in params:  # a bad constraint is refused before anything runs
            if sp.structured is not None:
                self.scheduler.engine.grammars.compile(sp.structured)
        results: dict[str, RequestOutput] = {}
        asked: dict[str, SamplingParams] = {}
        added: list[str] = []
        try:
            for (text, ids), sp in zip(encoded, params):
                rid = f"llm-{next(self._ids)}"
                self.scheduler.add_request(Request(rid, ids, sp))
                added.append(rid)
                results[rid], asked[rid] = RequestOutput(rid, text, ids), sp
            self._step_until_done(results, asked, use_tqdm)
        except BaseException:
            self._discard(added)  # a bad prompt, a failed step or Ctrl-C leaves nothing behind
            raise
        return [results[rid] for rid in added]

    def _step_until_done(self, results: dict[str, RequestOutput], asked: dict[str, SamplingParams],
                         use_tqdm: bool) -> None:
        """Drive the loop until every request in ``results`` has its final output."""
        text_parts: dict[str, list[str]] = {rid: [] for rid in results}
        tokens: dict[str, list[int]] = {rid: [] for rid in results}
        logprobs: dict[str, list] = {rid: [] for rid in results}
        with tqdm(total=len(results), desc="Generating", unit="req", disable=None if use_tqdm else True) as bar:
            while self.scheduler.has_unfinished():
                for out in self.scheduler.step():
                    rid = out.request_id
                    if rid not in results:
                        continue
                    text_parts[rid].append(out.text)
                    tokens[rid] += out.token_ids
                    logprobs[rid] += out.logprobs or []
                    if out.finished:
                        r = results[rid]
                        r.num_cached_tokens, r.metrics = out.num_cached_tokens, out.metrics
                        r.outputs.append(CompletionOutput(0, "".join(text_parts[rid]), tokens[rid], out.finish_reason.value,
                                                          logprobs[rid] if asked[rid].logprobs is not None else None))
                        bar.update(1)

    def _discard(self, request_ids: list[str]) -> None:
        """Abort ``request_ids`` and drop their outputs, so the next call starts clean."""
        for rid in request_ids:
            self.scheduler.abort(rid)
        try:
            while self.scheduler.has_unfinished():
                self.scheduler.step()
        except Exception:  # the engine is failing again: leave the aborts queued, report the first error
            pass


def _conversations(messages: Any) -> list[list]:
    """:meth:`LLM.chat`'s ``messages`` as a list of conversations: one conversation (a list whose
    first item is a message object) or a list of them, each a non-empty list, as the server's
    ``messages`` (its items are checked where the server checks them, naming ``messages[i]``).

    Raises:
        InvalidRequestError: another shape, naming the element at fault."""
    if not isinstance(messages, list) or not messages:
        raise InvalidRequestError("messages must be a non-empty list of messages (one conversation) "
                                  "or of conversations", "messages")
    if isinstance(messages[0], dict):
        return [messages]
    for i, conversation in enumerate(messages):
        if not isinstance(conversation, list) or not conversation:
            what = "an empty list" if isinstance(conversation, list) else type(conversation).__name__
            raise InvalidRequestError(f"messages[{i}] must be a message object (one conversation) or a non-empty "
                                      f"list of them (a list of conversations), not {what}", f"messages[{i}]")
    return messages


def _kind(value: object) -> str:
    """How an error names a wrong-typed argument: its type, with the fix for a dict of fields."""
    if isinstance(value, dict):
        return "dict (build one with SamplingParams(**fields))"
    return "the class itself (call it: SamplingParams())" if value is SamplingParams else type(value).__name__


def _is_token_id(value: Any) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_list(value: Any) -> bool:
    return isinstance(value, Sequence) and not isinstance(value, (str, bytes, bytearray, Mapping))


def _shape(value: Any) -> str:
    """A short description of a rejected value for an error message."""
    if isinstance(value, Mapping):
        return f"a dict with keys {sorted(map(str, value))}"
    if _is_list(value):
        return "an empty list" if len(value) == 0 else f"a list starting with {type(value[0]).__name__}"
    return type(value).__name__


def _one_prompt(value: Any, where: str) -> str | list[int]:
    """One prompt (text or token ids; the dict forms unwrapped).

    Raises:
        InvalidRequestError: not one of :data:`_PROMPT_FORMS`' single forms.
    """
    if isinstance(value, Mapping):
        keys = set(value)
        if keys == {"prompt"} and isinstance(value["prompt"], str):
            return value["prompt"]
        if keys == {"prompt_token_ids"} and _is_list(value["prompt_token_ids"]) \
                and all(_is_token_id(t) for t in value["prompt_token_ids"]):
            return [int(t) for t in value["prompt_token_ids"]]
        extra = sorted(map(str, keys - {"prompt", "prompt_token_ids"}))
        if extra:
            detail = f"unknown keys {extra}"
        elif len(keys) == 2:
            detail = 'give "prompt" or "prompt_token_ids", not both'
        elif not keys:
            detail = 'an empty dict (no "prompt" or "prompt_token_ids")'
        else:
            detail = '"prompt" must be a string, "prompt_token_ids" a list of integers'
        raise InvalidRequestError(f"{where}: {detail}; a prompt is {_ONE_PROMPT_FORMS}", "prompts")
    if isinstance(value, str):
        return value
    if _is_list(value) and all(_is_token_id(t) for t in value):
        return [int(t) for t in value]
    raise InvalidRequestError(f"{where} must be {_ONE_PROMPT_FORMS}; got {_shape(value)}", "prompts")
