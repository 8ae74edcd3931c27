"""The doors of ``monobatch parity`` (see the package docstring) and :func:`run_parity`, which
runs them for each sampling config and compares each with the reference."""

from __future__ import annotations

import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Callable

from monobatch.engine.constraint import StructuredOutput
from monobatch.errors import MonobatchError
from monobatch.parity.report import ConfigReport, DoorResult, ParityReport, compare
from monobatch.parity.serving import HTTP_TIMEOUT, Recorder, Server, release_memory, run_cli_door, serving

if TYPE_CHECKING:
    from monobatch.engine.engine import EngineConfig
    from monobatch.engine.scheduler import FinishedRequest
    from monobatch.loader import LoadedModel

#: The doors, in report order; ``generate`` is the reference.
DOORS = ("generate", "run", "server-dense", "server-paged", "prefix-hit", "batch")
#: Doors whose KV storage is paged whatever the flags say (their paged-attention count must be > 0).
PAGED_DOORS = ("server-paged", "prefix-hit", "batch")
#: With ``--tensor-parallel-size N`` > 1, one more door: the engine directly at B=1 sharded over N
#: ranks (ADR 0007); every other door, the reference included, runs unsharded.
TP_DOOR = "tensor-parallel"

#: The default prompt: one user message of a few dozen tokens; with the chat template it fills
#: several 16-token KV blocks, so the prefix-cache hit adopts some.
DEFAULT_PROMPT = ("Explain in two short paragraphs why the sky is blue during the day and turns red and "
                  "orange at sunset, for a curious ten-year-old.")

#: The sampling configs (request fields; ``max_tokens`` and ``ignore_eos`` are added).
CONFIGS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "seeded": {"temperature": 0.8, "seed": 1234, "top_k": 40, "top_p": 0.95, "repeat_penalty": 1.1,
               "repeat_last_n": 64, "presence_penalty": 0.3, "frequency_penalty": 0.2, "dry_multiplier": 0.8,
               "dry_base": 1.75, "dry_allowed_length": 2, "dry_penalty_last_n": 64},
    # structured output: greedy under a JSON schema (llama-server's ``json_schema`` field over HTTP,
    # ``--json-schema`` for the CLI door, ``SamplingParams.structured`` for the engine)
    "json": {"temperature": 0.0, "json_schema": {
        "type": "object", "additionalProperties": False, "required": ["topic", "audience", "reasons"],
        "properties": {
            "topic": {"type": "string", "maxLength": 40},
            "audience": {"type": "object", "additionalProperties": False, "required": ["age", "level"],
                         "properties": {"age": {"type": "integer", "minimum": 5, "maximum": 12},
                                        "level": {"enum": ["beginner", "curious", "expert"]}}},
            "reasons": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "string", "maxLength": 60}},
        }}},
}

#: The batch door's neighbours: (user message, request fields); max_tokens = n + the extra.
NEIGHBOURS: tuple[tuple[str, dict[str, Any], int], ...] = (
    ("Hi!", {"temperature": 0.0}, 6),
    ("Write a haiku about autumn leaves falling into a quiet river.", {"temperature": 1.0, "seed": 7}, 4),
    ("List five prime numbers.", {"temperature": 0.0, "repeat_penalty": 1.3}, 8),
    ("What is the capital of Italy? Answer in one word, then explain why it became the capital.",
     {"temperature": 0.7, "seed": 99, "logit_bias": {"28": -5.0, "30": 3.0}}, 5),
    ("Describe in detail how a bicycle works: the frame, the wheels, the chain, the gears and the brakes, "
     "and how they all fit together when someone rides it up a steep hill.",
     {"temperature": 0.0, "presence_penalty": 1.0}, 7),
    ("Translate 'good morning' into French, Spanish and German.",
     {"temperature": 1.2, "seed": 3, "top_k": 5}, 3),
    ("Tell me a short story about a robot who learns to paint.",
     {"temperature": 0.9, "seed": 11, "min_p": 0.1, "frequency_penalty": 0.5, "dry_multiplier": 1.0}, 8),
    ("Why do cats purr?", {"temperature": 0.0, "top_k": 1}, 2),
)
#: Neighbours already decoding when the batch door's request arrives (the rest arrive with it).
EARLY_NEIGHBOURS = 4
#: Contexts the paged pool of each of parity's engines holds when ``--kv-cache-memory`` is not
#: given (at least; more when the batch door's sequences need more).
POOL_CONTEXTS = 2


# -- checks -------------------------------------------------------------------------------------
def _fill(result: DoorResult, record: "FinishedRequest") -> None:
    """Copy what the engine recorded for the door's request into ``result``."""
    m = record.metrics
    result.token_ids = list(record.output_ids)
    result.cached_tokens = m.num_cached_tokens
    result.prefill_chunks = [tuple(c) for c in m.prefill_chunks]
    result.shared_steps, result.max_batch_seqs = m.shared_steps, m.max_batch_seqs
    result.num_steps = len(m.prefill_chunks) + max(len(record.output_ids) - 1, 0)


def _one(records: list["FinishedRequest"], prompt_ids: list[int], result: DoorResult) -> "FinishedRequest":
    """The door's own record among ``records`` (the one with the reference prompt, or the only one)."""
    mine = [r for r in records if r.prompt_ids == prompt_ids]
    if len(mine) == 1:
        return mine[0]
    if len(records) == 1:
        result.problems.append(f"the server's prompt ids differ from the reference's ({len(records[0].prompt_ids)} "
                               f"vs {len(prompt_ids)} tokens)")
        return records[0]
    raise RuntimeError(f"expected one finished request with the reference prompt, the engine recorded {len(mine)} "
                       f"(of {len(records)})")


def _check_http(result: DoorResult, answer: dict[str, Any], prompt_ids: list[int]) -> None:
    """The HTTP answer carries the ids the engine recorded, for the reference prompt."""
    http_ids = answer["choices"][0].get("token_ids")
    if http_ids != result.token_ids:
        result.problems.append("the HTTP answer's token_ids differ from the engine's record")
    if answer.get("prompt_token_ids") != prompt_ids:
        result.problems.append("the HTTP answer's prompt_token_ids differ from the reference prompt")


def _check_paged(result: DoorResult, paged: bool) -> None:
    calls = result.paged_attention_calls or 0
    if paged and calls <= 0:
        result.problems.append("no paged-attention call on paged KV storage")
    elif not paged and calls != 0:
        result.problems.append(f"{calls} paged-attention calls on dense KV storage")


def _error_text(exc: Exception) -> str:
    """A door's error for the report: the exception's type and the first line of its message."""
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:500]


def _run_door(result: DoorResult, fn: Callable[[], None],
              raises: tuple[type[Exception], ...] = ()) -> DoorResult:
    """Run one door; an exception makes it an ``error`` (the message kept, the run goes on),
    except one of ``raises``, which propagates."""
    start = time.perf_counter()
    try:
        fn()
        if result.status == "error":
            result.status = "identical"  # compared below by the caller
    except raises:
        raise
    except Exception as exc:  # noqa: BLE001 - a failed door is reported, the others still run
        result.status, result.error = "error", _error_text(exc)
    finally:
        result.seconds = time.perf_counter() - start
    return result


class _Parity:
    """The doors of each config, sharing the loaded model and the reference's results.

    Every door builds its own engine and frees it before the next (:func:`release_memory`). The
    margins come from a dense engine with the flags' numerics (``Engine.draw_margin`` runs on a
    scratch ``DenseKv``, so it holds no KV pool between calls).
    """

    def __init__(self, loaded: "LoadedModel", base: "EngineConfig", prompt: str, batch_prefill_chunk: int,
                 max_tokens: int, progress: Callable[[str], None]) -> None:
        from monobatch.engine.engine import Engine

        self.loaded, self.base, self.prompt = loaded, base, prompt
        self.batch_prefill_chunk = batch_prefill_chunk
        self.progress = progress
        self.margin_engine = Engine(loaded, self.config(kv_storage="dense"))
        self.pool_bytes = self._pool_bytes(max_tokens)

    def _pool_bytes(self, max_tokens: int) -> int:
        """The paged pool of parity's engines when ``--kv-cache-memory`` gave none: room for
        :data:`POOL_CONTEXTS` contexts, or for the batch door's sequences all at once if that is
        more. (The engine's own default, 85 % of free memory on CUDA, would leave little to the
        engine of the next door while one is still being freed.)"""
        bs, context = self.base.block_size, self.margin_engine.max_model_len
        requests = [(self.prompt, max_tokens)] + [(m, max_tokens + extra) for m, _, extra in NEIGHBOURS]
        batch = sum(-(-min(context, len(self.chat_ids(m)) + n) // bs) for m, n in requests)
        blocks = max(POOL_CONTEXTS * -(-context // bs), batch)
        return blocks * bs * self.margin_engine.kv.bytes_per_token

    def chat_ids(self, message: str) -> list[int]:
        """``message`` as one user message through the model's chat template."""
        return self.loaded.tokenizer.encode_chat([{"role": "user", "content": message}], True)

    def config(self, **changes: Any) -> "EngineConfig":
        """The flags' engine settings with ``changes``; a paged one gets :attr:`pool_bytes`
        unless ``--kv-cache-memory`` was given; unsharded unless ``changes`` say otherwise (the
        tensor-parallel door)."""
        changes.setdefault("tensor_parallel_size", 1)
        if changes.get("kv_storage", self.base.kv_storage) == "dense":
            changes["kv_cache_memory"] = None
        elif self.base.kv_cache_memory is None:
            changes["kv_cache_memory"] = self.pool_bytes
        return dataclasses.replace(self.base, **changes)

    def run_config(self, name: str, fields: dict[str, Any]) -> ConfigReport:
        """Every door for one sampling config (``fields``: OpenAI/llama.cpp request fields), each
        compared with the reference door's ids. A door that fails is reported, not raised.

        Raises:
            MonobatchError: the reference door cannot run the prompt (nothing to compare with).
        """
        from monobatch.engine.params import resolve_sampling

        report = ConfigReport(name, fields)
        sampling = {k: v for k, v in fields.items() if k != "json_schema"}
        self.params = resolve_sampling(sampling, None, self.loaded.generation_defaults, entry_point="chat")
        if "json_schema" in fields:  # the constraint, as the server builds it from the same field
            self.params = dataclasses.replace(self.params, structured=StructuredOutput.json_schema(fields["json_schema"]))
        report.prompt_ids = self.chat_ids(self.prompt)
        self.prompt_ids = report.prompt_ids
        self.fields = fields
        ref = DoorResult("generate")
        self.progress(f"{name}: generate (the reference)")
        _run_door(ref, lambda: self._generate(ref), raises=(MonobatchError,))
        release_memory()
        if ref.status == "error":
            report.doors.append(ref)
            for door in DOORS[1:]:
                report.doors.append(DoorResult(door, error="the reference did not run"))
            return report
        ref.status = "reference"
        report.doors.append(ref)
        self.reference = ref.token_ids
        tp = self.base.tensor_parallel_size
        doors = [DoorResult(d) for d in DOORS[1:] + ((TP_DOOR,) if tp > 1 else ())]
        by_name = {d.door: d for d in doors}
        self.progress(f"{name}: run (the CLI over HTTP)")
        _run_door(by_name["run"], lambda: self._run(by_name["run"]))
        self.progress(f"{name}: server, dense KV")
        _run_door(by_name["server-dense"], lambda: self._server_b1(by_name["server-dense"], "dense"))
        self.progress(f"{name}: server, paged KV, then the prefix-cache hit")
        self._paged_and_hit(by_name["server-paged"], by_name["prefix-hit"])
        self.progress(f"{name}: batch of {len(NEIGHBOURS) + 1}")
        _run_door(by_name["batch"], lambda: self._batch(by_name["batch"]))
        if tp > 1:
            self.progress(f"{name}: tensor parallel, {tp} ranks")
            _run_door(by_name[TP_DOOR], lambda: self._generate(by_name[TP_DOOR], tensor_parallel_size=tp))
        for d in doors:
            if d.status != "error":
                d.divergence = compare(self.prompt_ids, self.reference, d.token_ids, self.margin)
                d.status = "identical" if d.divergence is None else "diverged"
        report.doors += doors
        return report

    def margin(self, ids: list[int]) -> float:
        """The reference's draw margin after ``ids`` (prompt + generated; the flags' numerics,
        B=1): :meth:`Engine.draw_margin` with this config's sampling params — a greedy draw's
        top-2 logit gap, a seeded draw's gap between its two best noise-perturbed scores."""
        n = len(self.prompt_ids)
        return self.margin_engine.draw_margin(ids[:n], ids[n:], self.params)

    # -- generate: the engine directly, B=1 --------------------------------------------------------------
    def _generate(self, result: DoorResult, tensor_parallel_size: int = 1) -> None:
        """The engine directly at B=1 (the reference; with ``tensor_parallel_size`` > 1, the
        tensor-parallel door: the model sharded over that many ranks)."""
        from monobatch.engine.engine import Engine
        from monobatch.engine.scheduler import BatchScheduler
        from monobatch.engine.sequence import Request

        engine = Engine(self.loaded, self.config(tensor_parallel_size=tensor_parallel_size))
        try:
            scheduler = BatchScheduler(engine)
            recorder = Recorder()
            scheduler.add_finish_observer(recorder.add)
            before = scheduler.stats().paged_attention_calls
            for _ in scheduler.run([Request("parity-generate", list(self.prompt_ids), self.params)]):
                pass
            _fill(result, _one(recorder.since(0), self.prompt_ids, result))
            result.paged_attention_calls = scheduler.stats().paged_attention_calls - before
        finally:
            engine.close()
        result.evidence.append(f"engine direct, B=1, {self.base.kv_storage} KV")
        if engine.tp_plan is not None and tensor_parallel_size > 1:
            result.evidence.append(engine.tp_plan.describe())
        _check_paged(result, self.base.kv_storage == "paged")

    # -- run: the chat CLI over HTTP -------------------------------------------------------------------
    def _run(self, result: DoorResult) -> None:
        from monobatch.tokenizer import IncrementalDetokenizer

        with serving(self.loaded, self.config()) as server:
            mark, before = server.recorder.mark(), server.metrics()
            text = run_cli_door(server.base_url, self.prompt, self.fields)
            after = server.settled_metrics(1)
            _fill(result, _one(server.recorder.since(mark), self.prompt_ids, result))
        result.paged_attention_calls = _calls(after) - _calls(before)
        detok = IncrementalDetokenizer(self.loaded.tokenizer, self.prompt_ids, self.params.skip_special_tokens)
        expected = "".join(detok.push(t) for t in result.token_ids) + detok.flush()
        if text == expected:
            result.evidence.append("CLI text == decode(ids)")
        else:
            result.problems.append(f"the CLI printed {text[:60]!r}... but decode(ids) is {expected[:60]!r}...")
        result.evidence.append(f"{self.base.kv_storage} KV")
        _check_paged(result, self.base.kv_storage == "paged")

    # -- the server at B=1 -------------------------------------------------------------------------------
    def _ask(self, server: Server, result: DoorResult, finished: int) -> None:
        mark, before = server.recorder.mark(), server.metrics()
        answer = server.chat(self.prompt, self.fields)
        after = server.settled_metrics(finished)
        _fill(result, _one(server.recorder.since(mark), self.prompt_ids, result))
        _check_http(result, answer, self.prompt_ids)
        result.paged_attention_calls = _calls(after) - _calls(before)
        _check_paged(result, server.kv_storage == "paged")

    def _server_b1(self, result: DoorResult, storage: str) -> None:
        with serving(self.loaded, self.config(kv_storage=storage)) as server:
            self._ask(server, result, 1)
        result.evidence.append(f"HTTP, B=1, {storage} KV")

    def _paged_and_hit(self, miss: DoorResult, hit: DoorResult) -> None:
        try:
            with serving(self.loaded, self.config(kv_storage="paged")) as server:
                _run_door(miss, lambda: self._ask(server, miss, 1))
                if miss.status == "error":
                    hit.error = "the miss before it failed"
                    return
                if miss.cached_tokens:
                    miss.problems.append(f"a fresh server adopted {miss.cached_tokens} cached tokens")
                miss.evidence.append("HTTP, B=1, paged KV, prefix-cache miss")
                _run_door(hit, lambda: self._ask(server, hit, 2))
        except Exception as exc:  # noqa: BLE001 - the server itself failed (start or stop)
            for d in (miss, hit):
                if d.status == "error" and d.error is None:
                    d.error = _error_text(exc)
            return
        if hit.status == "error":
            return
        if not hit.cached_tokens:
            hit.problems.append("the repeated request adopted no cached prefix block")
        else:
            hit.evidence.append(f"adopted {hit.cached_tokens} cached prompt tokens (miss first: "
                                f"{miss.cached_tokens or 0})")
        if hit.prefill_chunks and hit.prefill_chunks[0][0] != (hit.cached_tokens or 0):
            hit.problems.append("the computed chunks do not start where the cached prefix ends")

    # -- batch: inside 8 concurrent others ---------------------------------------------------------------
    def _batch(self, result: DoorResult) -> None:
        chunk = self.batch_prefill_chunk or self.base.prefill_chunk
        max_tokens = self.fields.get("max_tokens") or 16
        config = self.config(kv_storage="paged", prefill_chunk=chunk, max_num_batched_tokens=None,
                             max_num_seqs=max(self.base.max_num_seqs, len(NEIGHBOURS) + 1))
        neighbours = [(msg, {**f, "max_tokens": max_tokens + extra, "ignore_eos": True})
                      for msg, f, extra in NEIGHBOURS]
        with serving(self.loaded, config) as server, ThreadPoolExecutor(len(neighbours) + 1) as pool:
            mark, before = server.recorder.mark(), server.metrics()
            early = [pool.submit(server.chat, m, f) for m, f in neighbours[:EARLY_NEIGHBOURS]]
            deadline = time.monotonic() + HTTP_TIMEOUT
            while server.metrics().get("monobatch_generation_tokens_total", 0) < EARLY_NEIGHBOURS:
                if any(f.done() for f in early) or time.monotonic() > deadline:
                    break  # an early neighbour failed (its error surfaces below) or is over already
                time.sleep(0.01)
            # cache_prompt false: its neighbours' prompts share the chat template's opening, whose
            # cached blocks it would adopt; this door isolates batching (and chunking) from the cache
            mine = pool.submit(server.chat, self.prompt, {**self.fields, "cache_prompt": False})
            late = [pool.submit(server.chat, m, f) for m, f in neighbours[EARLY_NEIGHBOURS:]]
            answer = mine.result()
            for f in early + late:
                f.result()
            after = server.settled_metrics(len(neighbours) + 1)
            _fill(result, _one(server.recorder.since(mark), self.prompt_ids, result))
        _check_http(result, answer, self.prompt_ids)
        result.paged_attention_calls = _calls(after) - _calls(before)
        _check_paged(result, True)
        if result.cached_tokens:
            result.problems.append(f"adopted {result.cached_tokens} cached tokens despite cache_prompt false")
        if not result.shared_steps or (result.max_batch_seqs or 0) < 2:
            result.problems.append("the request never shared a step with another sequence")
        else:
            result.evidence.append(f"shared {result.shared_steps} of {result.num_steps} steps, up to "
                                   f"{result.max_batch_seqs} sequences; prefill chunk {chunk}")


def _calls(metrics: dict[str, float]) -> int:
    return int(metrics.get("monobatch_paged_attention_calls_total", 0))


def sampling_fields(config: str, max_tokens: int) -> dict[str, Any]:
    """The request fields of a named config (:data:`CONFIGS`) with ``max_tokens`` and ``ignore_eos``.

    Raises:
        KeyError: an unknown config name.
    """
    return {**CONFIGS[config], "max_tokens": max_tokens, "ignore_eos": True}


def device_name(loaded: "LoadedModel") -> str:
    """The model's device for the report: ``cpu``, or ``cuda:0 (NVIDIA H200)``."""
    import torch

    device = loaded.model.device
    if device.type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(device)})"
    return str(device)


def run_parity(loaded: "LoadedModel", base: "EngineConfig", *, prompt: str = DEFAULT_PROMPT,
               configs: tuple[str, ...] = tuple(CONFIGS), max_tokens: int = 32, batch_prefill_chunk: int = 16,
               progress: Callable[[str], None] | None = None) -> ParityReport:
    """Run every door of every config and compare each with the reference.

    Args:
        loaded: the model (shared by every engine built here: the reference's and each server's).
        base: the engine settings from the flags (the reference's and the ``run`` door's server's;
            the other doors set ``kv_storage``; the batch door also ``prefill_chunk``, at least
            9 ``max_num_seqs`` and the default ``max_num_batched_tokens``).
        prompt: the user message (the chat template is applied).
        configs: names from :data:`CONFIGS`.
        max_tokens: tokens each door generates (>= 1; EOS ignored).
        batch_prefill_chunk: the batch door's prefill chunk in tokens (0 = ``base.prefill_chunk``).
        progress: called with a short line before each door (e.g. to print on a terminal).

    Returns:
        The report; a door that failed to run has status ``error`` (nothing is raised for it).

    Raises:
        KeyError: an unknown config name.
        MonobatchError: nothing to compare with: the reference engine refused the request or
            its settings (the prompt empty after the template or too long for the context, a
            KV pool smaller than one context), or the chat template failed.
    """
    start = time.perf_counter()
    report = ParityReport("deterministic" if base.deterministic else "fast", device_name(loaded),
                          str(loaded.model.dtype).removeprefix("torch."), loaded.name, prompt, max_tokens,
                          batch_prefill_chunk)
    parity = _Parity(loaded, base, prompt, batch_prefill_chunk, max_tokens, progress or (lambda line: None))
    for name in configs:
        report.configs.append(parity.run_config(name, sampling_fields(name, max_tokens)))
    report.seconds = time.perf_counter() - start
    return report
