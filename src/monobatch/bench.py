"""``monobatch bench``: prefill and decode speed of the one decode loop, reached three ways.

Every measurement is a set of :class:`Trace` s: per sequence, when it was submitted and when each
of its tokens reached the caller (``time.perf_counter``). The paths differ only in where the
caller sits; all drive the same loaded engine:

* ``engine`` (:class:`EngineDriver`): the BatchScheduler directly. Timed region: from adding the
  requests to each step's outputs returning from ``scheduler.step()``. Each step ends with a host
  sync (the token ids come back to the host), so every queued GPU kernel is included.
* ``server`` (:class:`ServerDriver`): the server's engine thread (:class:`EngineLoop`) and its
  in-process router (:class:`EngineClient`) on an asyncio loop in this thread, requests of token
  ids. Timed region: from ``EngineClient.submit`` to each output arriving on the request's queue
  on the event loop — the hop to the engine thread and back is in, HTTP and tokenization are out.
* ``http`` (:class:`HttpDriver`): an in-process :class:`ServerThread` on 127.0.0.1 and streaming
  ``POST /v1/completions`` requests (httpx). Timed region: from sending the request to each SSE
  event received (TTFT: the first event with a token, i.e. the first content byte): HTTP, body
  validation, detokenization and SSE framing are in; the prompt is sent as token ids, so text
  tokenization is out.

Every request is greedy with EOS ignored (exactly ``gen_tokens`` tokens; anything else is an
error) and bypasses the prefix cache, so repeated runs and the sequences of a batch share no KV.
Prompts are synthesized English-like text (:func:`synth_prompt`), the same for every run.

Metrics (times in ms, rates in tokens/s), medians over the timed runs:

* B=1 (:func:`b1_metrics`): ``ttft_ms`` (submit -> first token: the whole prefill),
  ``prefill_tok_s`` = prompt tokens / TTFT, ``decode_tok_s`` = (tokens - 1) / (last token - first
  token).
* batched, as llama.cpp's ``llama-batched-bench`` (:func:`batched_metrics`): B sequences of the
  same length submitted at once. ``pp_tok_s`` = B x prompt tokens / (submit -> the last
  sequence's first token); ``tg_tok_s`` = tokens arriving after that / the time from then to the
  last token; ``total_tok_s`` = B x (prompt + gen) / (submit -> the last token). Prompts larger
  than one step's token budget are prefilled over several steps, and the first sequences may
  start decoding meanwhile (continuous batching): those tokens count in PP's time, not in TG.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import resource
import statistics
import sys
import time
import zlib
from dataclasses import asdict, dataclass, field
from typing import Callable, Protocol

import torch

from monobatch.engine.finish import RowOutput
from monobatch.engine.constraint import StructuredOutput
from monobatch.engine.params import SamplingParams
from monobatch.engine.scheduler import BatchScheduler
from monobatch.engine.sequence import FinishReason, Request
from monobatch.errors import InvalidRequestError, MonobatchError
from monobatch.synth import synth_words

_ids = itertools.count()


# -- prompts ------------------------------------------------------------------------------------
def _word_level(tokenizer) -> bool:
    """True for :meth:`Tokenizer.synthetic` 's vocabulary (``<0>`` .. ``<V-1>``, random weights),
    which knows no English word: every word would be its unknown token."""
    return tokenizer.vocab_size > 2 and tokenizer.encode("<1> <2>", add_special_tokens=False) == [1, 2]


def synth_prompt(tokenizer, num_tokens: int, seed: int = 0) -> list[int]:
    """Exactly ``num_tokens`` prompt ids: seeded synthesized text, tokenized (with BOS when the
    model adds one), cut to length. The same (tokenizer, length, seed) always gives the same ids.

    With a synthetic word-level vocabulary (``--dummy-weights``) each word maps to a token of its
    own (by a CRC of the word), so the prompt is not one repeated unknown token.
    """
    rng = random.Random(seed)
    words: list[str] = []
    while True:
        words += synth_words(rng, max(8, num_tokens // 8))
        if _word_level(tokenizer):
            vocab = tokenizer.vocab_size
            text = " ".join(f"<{1 + zlib.crc32(w.encode()) % (vocab - 1)}>" for w in words)
        else:
            text = " ".join(words)
        ids = tokenizer.encode(text)
        if len(ids) >= num_tokens:
            return ids[:num_tokens]


# -- traces and metrics --------------------------------------------------------------------------
@dataclass(slots=True)
class Trace:
    """One sequence's timeline (``time.perf_counter`` seconds).

    Attributes:
        start: when it was submitted.
        times: when each token reached the caller (an output carrying k tokens adds k entries).
        finish_reason: how it ended.
    """

    start: float
    times: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    def add(self, now: float, num_tokens: int, finish_reason: str | None) -> None:
        """Record an output received at ``now``."""
        self.times += [now] * num_tokens
        if finish_reason is not None:
            self.finish_reason = finish_reason

    def check(self, gen_tokens: int) -> None:
        """Raise MonobatchError unless it ended with ``length`` after exactly ``gen_tokens``."""
        if self.finish_reason != FinishReason.LENGTH.value or len(self.times) != gen_tokens:
            raise MonobatchError(f"a bench request ended with finish_reason={self.finish_reason} after "
                                 f"{len(self.times)} of {gen_tokens} tokens")


def b1_metrics(trace: Trace, prompt_tokens: int) -> dict[str, float]:
    """``ttft_ms`` (ms), ``prefill_tok_s`` (prompt tokens / TTFT), ``decode_tok_s`` ((tokens - 1)
    / (last - first token); 0 with one token) of one sequence."""
    ttft = trace.times[0] - trace.start
    span = trace.times[-1] - trace.times[0]
    return {"ttft_ms": ttft * 1000, "prefill_tok_s": prompt_tokens / ttft if ttft > 0 else 0.0,
            "decode_tok_s": (len(trace.times) - 1) / span if span > 0 else 0.0}


def batched_metrics(traces: list[Trace], prompt_tokens: int) -> dict[str, float]:
    """llama-batched-bench's PP / TG / total (tok/s) and their times (s) for sequences submitted
    together (see the module docstring)."""
    start = min(t.start for t in traces)
    prefilled = max(t.times[0] for t in traces)  # the last sequence's first token
    end = max(t.times[-1] for t in traces)
    decoded = sum(1 for t in traces for x in t.times if x > prefilled)
    pp_s, tg_s = prefilled - start, end - prefilled
    total = len(traces) * prompt_tokens + sum(len(t.times) for t in traces)
    return {"pp_tok_s": len(traces) * prompt_tokens / pp_s if pp_s > 0 else 0.0,
            "tg_tok_s": decoded / tg_s if tg_s > 0 else 0.0,
            "total_tok_s": total / (end - start), "pp_s": pp_s, "tg_s": tg_s}


#: ``bench --constrained``'s JSON schema: an array of at least 4,096 small objects, so the grammar
#: cannot end before ``-n`` tokens and every token is drawn under a mask (structural JSON: keys,
#: bounded strings, integers).
CONSTRAINED_SCHEMA = {"type": "array", "minItems": 4096, "items": {
    "type": "object", "additionalProperties": False, "required": ["name", "value"],
    "properties": {"name": {"type": "string", "maxLength": 16}, "value": {"type": "integer"}}}}


def bench_constraint() -> StructuredOutput:
    """The structured-output constraint of ``bench --constrained`` (:data:`CONSTRAINED_SCHEMA`)."""
    return StructuredOutput.json_schema(CONSTRAINED_SCHEMA, "--constrained")


def _params(gen_tokens: int, structured: StructuredOutput | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True, structured=structured)


def _requests(prompts: list[list[int]], gen_tokens: int, start: float,
              structured: StructuredOutput | None = None) -> list[Request]:
    return [Request(f"bench-{next(_ids)}", p, _params(gen_tokens, structured), arrival_time=start,
                    bypass_prefix_cache=True) for p in prompts]


# -- paths ---------------------------------------------------------------------------------------
class Driver(Protocol):
    """One path to the engine: ``run`` submits the prompts at once and returns their traces."""

    name: str

    def run(self, prompts: list[list[int]], gen_tokens: int) -> list[Trace]:
        """Submit ``prompts`` (token ids) at once, greedy, exactly ``gen_tokens`` each (EOS
        ignored, prefix cache bypassed); one :class:`Trace` per prompt, in order (wall-clock
        seconds of each token's arrival on this side of the path)."""

    def preemptions(self) -> int:
        """The scheduler's preemption counter (read safely from this thread)."""

    def close(self) -> None:
        """Release what the path started (event loop, server thread); the scheduler stays."""


class EngineDriver:
    """The ``engine`` path: ``BatchScheduler.run`` in this thread."""

    name = "engine"
    structured: StructuredOutput | None = None

    def __init__(self, scheduler: BatchScheduler) -> None:
        self.scheduler = scheduler

    def run(self, prompts: list[list[int]], gen_tokens: int) -> list[Trace]:
        start = time.perf_counter()
        requests = _requests(prompts, gen_tokens, start, self.structured)
        traces = {r.request_id: Trace(start) for r in requests}
        for out in self.scheduler.run(requests):
            _record(traces[out.request_id], out)
        return list(traces.values())

    def preemptions(self) -> int:
        return self.scheduler.stats().num_preemptions

    def close(self) -> None:
        pass


def _record(trace: Trace, out: RowOutput) -> None:
    trace.add(time.perf_counter(), len(out.token_ids), out.finish_reason.value if out.finished else None)


class ServerDriver:
    """The ``server`` path: the server's engine thread and router, driven from an event loop here.

    The scheduler belongs to the engine thread until :meth:`close`.
    """

    name = "server"
    structured: StructuredOutput | None = None

    def __init__(self, scheduler: BatchScheduler) -> None:
        from monobatch.server.client import MAX_SEQS_PER_REQUEST, EngineClient

        self.loop = asyncio.new_event_loop()
        self.client = EngineClient(scheduler, self.loop, max_queue=None)
        self.per_submit = MAX_SEQS_PER_REQUEST
        self.client.start()

    def run(self, prompts: list[list[int]], gen_tokens: int) -> list[Trace]:
        return self.loop.run_until_complete(self._run(prompts, gen_tokens))

    async def _run(self, prompts: list[list[int]], gen_tokens: int) -> list[Trace]:
        start = time.perf_counter()
        requests = _requests(prompts, gen_tokens, start, self.structured)
        traces = [Trace(start) for _ in requests]

        async def read(reader, offset: int) -> None:
            async with reader:
                async for i, out in reader:
                    _record(traces[offset + i], out)

        n = self.per_submit  # the router's limit per submit (one HTTP request's sequences)
        readers = [(await self.client.submit(requests[k:k + n]), k) for k in range(0, len(requests), n)]
        await asyncio.gather(*(read(r, k) for r, k in readers))
        return traces

    def preemptions(self) -> int:
        return self.client.engine.stats["num_preemptions"]  # published by the engine thread after each step

    def close(self) -> None:
        self.client.stop()
        self.loop.close()


class HttpDriver:
    """The ``http`` path: an in-process server on 127.0.0.1, streamed ``/v1/completions``.

    Each sequence is its own streaming request (``cache_prompt: false``, greedy, ``ignore_eos``,
    penalties explicitly off so no model default applies); B of them are sent concurrently.
    """

    name = "http"
    structured: StructuredOutput | None = None  # sent as llama-server's json_schema field

    def __init__(self, scheduler: BatchScheduler, ready_timeout: float = 600.0) -> None:
        import httpx

        from monobatch.server.app import create_app
        from monobatch.server.runner import ServerThread
        from monobatch.server.state import ServerSettings

        self.server = ServerThread(create_app(ServerSettings(), lambda: scheduler)).start()
        try:
            self.server.wait_ready(ready_timeout)
        except BaseException:
            self.server.stop()
            raise
        self.loop = asyncio.new_event_loop()
        self.http = httpx.AsyncClient(base_url=self.server.base_url, timeout=None,
                                      limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))

    def run(self, prompts: list[list[int]], gen_tokens: int) -> list[Trace]:
        return self.loop.run_until_complete(self._run(prompts, gen_tokens))

    async def _run(self, prompts: list[list[int]], gen_tokens: int) -> list[Trace]:
        start = time.perf_counter()
        traces = [Trace(start) for _ in prompts]
        await asyncio.gather(*(self._stream(p, gen_tokens, t) for p, t in zip(prompts, traces)))
        return traces

    async def _stream(self, prompt: list[int], gen_tokens: int, trace: Trace) -> None:
        from monobatch.cli.http_client import aiter_sse, refusal, transport_errors

        body = {"prompt": prompt, "max_tokens": gen_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
                "cache_prompt": False, "return_token_ids": True, "repeat_penalty": 1.0, "presence_penalty": 0.0,
                "frequency_penalty": 0.0, "dry_multiplier": 0.0}
        if self.structured is not None:
            body["json_schema"] = json.loads(self.structured.value)
        base = self.server.base_url
        with transport_errors(base):
            async with self.http.stream("POST", "/v1/completions", json=body) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    raise refusal(resp, base, False)
                async for event in aiter_sse(resp, base):
                    now = time.perf_counter()
                    for choice in event.get("choices") or ():
                        trace.add(now, len(choice.get("token_ids") or ()), choice.get("finish_reason"))

    def preemptions(self) -> int:
        return self.server.state.client.engine.stats["num_preemptions"]

    def close(self) -> None:
        self.loop.run_until_complete(self.http.aclose())
        self.loop.run_until_complete(self.loop.shutdown_asyncgens())  # finalize httpx's stream generators here
        self.loop.close()
        self.server.stop()


#: The paths, by name, in the order a bench runs them (``monobatch.cli.bench.PATHS`` mirrors the
#: names without importing this module).
DRIVERS: dict[str, Callable[[BatchScheduler], Driver]] = {"engine": EngineDriver, "server": ServerDriver,
                                                          "http": HttpDriver}


def open_driver(path: str, scheduler: BatchScheduler) -> Driver:
    """The driver for ``path`` (a key of :data:`DRIVERS`); :meth:`Driver.close` it before the next."""
    return DRIVERS[path](scheduler)


# -- results -------------------------------------------------------------------------------------
def peak_rss_mib() -> float:
    """Peak resident set size of this process so far, in MiB (getrusage; Linux reports KiB)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1024 if sys.platform != "darwin" else peak / 2**20


@dataclass(slots=True)
class Setup:
    """What every result records about the model and the engine settings."""

    model: str
    device: str
    dtype: str
    threads: int
    kv_storage: str
    prefill_chunk: int
    max_num_seqs: int
    step_token_budget: int
    deterministic: bool
    engine: str
    load_s: float
    weight_mib: float

    @classmethod
    def of(cls, scheduler: BatchScheduler) -> "Setup":
        """The setup of ``scheduler``'s engine."""
        loaded, config = scheduler.engine.loaded, scheduler.config
        return cls(model=loaded.name, device=str(loaded.model.device),
                   dtype=str(loaded.model.dtype).removeprefix("torch."), threads=torch.get_num_threads(),
                   kv_storage=config.kv_storage, prefill_chunk=config.prefill_chunk, max_num_seqs=config.max_num_seqs,
                   step_token_budget=scheduler.plan.token_budget, deterministic=config.deterministic,
                   engine=scheduler.engine.describe(), load_s=round(loaded.load_seconds, 3),
                   weight_mib=round(loaded.weight_bytes / 2**20, 1))

    def header(self) -> str:
        """Two lines for the top of the table."""
        return (f"model {self.model}  device {self.device}  dtype {self.dtype}  threads {self.threads}  "
                f"load {self.load_s:.2f} s  weights {self.weight_mib:.0f} MiB\n{self.engine}; prefill chunk "
                f"{self.prefill_chunk}, max-num-seqs {self.max_num_seqs}, step budget {self.step_token_budget} tokens")


@dataclass(slots=True)
class BenchRow:
    """One measured configuration (one JSON line of ``monobatch bench --json``).

    Attributes:
        label: ``"<path> p<prompt> b<B>"`` (``c<N>`` for concurrent vs sequential): names the
            configuration, stable across runs.
        mode: ``b1``, ``batched`` or ``concurrency``.
        metrics: the medians, flattened into the JSON object: ``ttft_ms``, ``prefill_tok_s``,
            ``decode_tok_s`` (b1); ``pp_tok_s``, ``tg_tok_s``, ``total_tok_s`` (batched);
            ``concurrent_tok_s``, ``sequential_tok_s``, ``speedup`` (concurrency).
        samples: every run's values (and the preemption count, which should be 0).
    """

    label: str
    path: str
    mode: str
    prompt_tokens: int
    gen_tokens: int
    batch_size: int
    runs: int
    setup: Setup
    metrics: dict[str, float]
    samples: dict
    constrained: bool = False  # every request decoded under bench --constrained's JSON schema
    peak_rss_mib: float = field(default_factory=lambda: round(peak_rss_mib(), 1))

    def to_dict(self) -> dict:
        """The JSON object: identity, setup, metrics at the top level, then ``samples``."""
        head = {k: getattr(self, k) for k in ("label", "path", "mode", "prompt_tokens", "gen_tokens", "batch_size",
                                              "runs", "constrained")}
        return {**head, **asdict(self.setup), "peak_rss_mib": self.peak_rss_mib, **self.metrics,
                "samples": self.samples}

    def table_line(self) -> str:
        """One line of the stdout table (see :data:`TABLE_HEADER`)."""
        m = self.metrics
        if self.mode == "concurrency":
            return (f"{self.label:<22} {self.batch_size} requests at once {m['concurrent_tok_s']:.1f} tok/s "
                    f"({m['concurrent_s']:.2f} s), one by one {m['sequential_tok_s']:.1f} tok/s "
                    f"({m['sequential_s']:.2f} s): {m['speedup']:.2f}x")
        cells = [m.get(k) for k in ("ttft_ms", "prefill_tok_s", "decode_tok_s", "pp_tok_s", "tg_tok_s", "total_tok_s")]
        line = f"{self.label:<22}" + "".join(f"{'-' if v is None else f'{v:.1f}':>15}" for v in cells)
        return line if "vs_plain" not in m else f"{line}   {m['vs_plain']:.3f}x plain"


TABLE_HEADER = f"{'label':<22}" + "".join(f"{h:>15}" for h in ("TTFT ms", "prefill tok/s", "decode tok/s",
                                                                "PP tok/s", "TG tok/s", "total tok/s"))


# -- the plan ------------------------------------------------------------------------------------
@dataclass(slots=True)
class BenchPlan:
    """What to measure: every path x prompt length x batch size, ``runs`` timed runs each after
    one untimed warm-up; with ``concurrency`` N > 0 also N concurrent vs sequential requests
    (engine path) per prompt length."""

    paths: tuple[str, ...] = ("engine",)
    prompt_tokens: tuple[int, ...] = (256,)
    gen_tokens: int = 128
    batch_sizes: tuple[int, ...] = (1,)
    runs: int = 3
    concurrency: int = 0
    seed: int = 0
    structured: StructuredOutput | None = None  # every request decodes under this constraint
    #: With ``structured``: also measure each configuration without it, the two arms' timed runs
    #: alternated in this process (``bench --constrained ab``), so their ratio is not a ratio of
    #: two processes (which differ on the H200 by up to 1.6x for the same arm and tree).
    plain_too: bool = False

    def check(self, scheduler: BatchScheduler) -> None:
        """Refuse what the loaded engine cannot run as asked.

        Raises:
            InvalidRequestError: a prompt + gen beyond the context; more sequences than
                ``max_num_seqs``; paged KV too small for the largest batch at once.
        """
        context = scheduler.engine.max_model_len
        longest = max(self.prompt_tokens)
        if longest + self.gen_tokens > context:
            raise InvalidRequestError(f"prompt + generated tokens (-p {longest} + -n {self.gen_tokens} = "
                                      f"{longest + self.gen_tokens}) exceed the context ({context} tokens)",
                                      "prompt_tokens")
        most = max(self.batch_sizes)
        if most > scheduler.config.max_num_seqs:
            raise InvalidRequestError(f"--batch-size {most} is more than --max-num-seqs "
                                      f"({scheduler.config.max_num_seqs}): the sequences would not run together",
                                      "batch_size")
        total_blocks = scheduler.kv.usage().total_blocks
        if total_blocks:  # paged: the largest batch must fit the pool at once (no preemption)
            bs = scheduler.config.block_size
            need = most * -(-(longest + self.gen_tokens) // bs)
            if need > total_blocks:
                raise InvalidRequestError(
                    f"{most} sequences of {longest} + {self.gen_tokens} tokens need {need * bs} KV tokens; the pool "
                    f"holds {total_blocks * bs} (raise --kv-cache-memory)", "batch_size")


def run_bench(scheduler: BatchScheduler, plan: BenchPlan, emit: Callable[[BenchRow], None]) -> list[BenchRow]:
    """Measure every configuration of ``plan`` (path-major: each path's driver opens once);
    ``emit`` gets each row as soon as it is measured.

    Returns:
        The rows, in the order measured.
    """
    setup = Setup.of(scheduler)
    prompts: dict[tuple[int, int], list[int]] = {}

    def prompt(length: int, i: int) -> list[int]:
        if (length, i) not in prompts:
            prompts[length, i] = synth_prompt(scheduler.engine.tokenizer, length, plan.seed + i)
        return prompts[length, i]

    rows: list[BenchRow] = []
    if plan.structured is not None:
        scheduler.engine.grammars.compile(plan.structured)
    for path in plan.paths:
        driver = open_driver(path, scheduler)
        driver.structured = plan.structured
        try:
            for length in plan.prompt_tokens:
                for b in plan.batch_sizes:
                    for row in measure(driver, setup, [prompt(length, i) for i in range(b)], plan):
                        rows.append(row)
                        emit(row)
        finally:
            driver.close()
    if plan.concurrency:
        for length in plan.prompt_tokens:
            batch = [prompt(length, i) for i in range(plan.concurrency)]
            rows.append(concurrent_vs_sequential(scheduler, setup, batch, plan.gen_tokens, plan.structured))
            emit(rows[-1])
    return rows


def measure(driver: Driver, setup: Setup, prompts: list[list[int]], plan: BenchPlan) -> list[BenchRow]:
    """One configuration: a warm-up run (allocator, kernels, KV growth, connections), then
    ``plan.runs`` timed runs of ``prompts`` submitted together; medians.

    With ``plan.plain_too`` two arms, each warmed up, their timed runs alternated in ABBA order
    (plain, constrained, constrained, plain, ...: a drift within the process, clocks or caches,
    does not favour the arm that always runs second): a plain row, then the constrained row with
    ``vs_plain``, its rate over the plain arm's (``decode_tok_s`` at B=1, ``tg_tok_s`` batched):
    the median of the per-run-pair ratios (``samples["vs_plain"]``: pair i = the i-th run of each arm).

    Returns:
        One row, or two (plain first) with ``plan.plain_too``.
    """
    length, b = len(prompts[0]), len(prompts)
    arms = [plan.structured] if not plan.plain_too or plan.structured is None else [None, plan.structured]
    preempted = {}
    per_run: dict[int, list[dict[str, float]]] = {k: [] for k in range(len(arms))}
    for k, structured in enumerate(arms):
        driver.structured = structured
        preempted[k] = driver.preemptions()
        driver.run(prompts, plan.gen_tokens)
    for i in range(plan.runs):
        for k in (range(len(arms)) if i % 2 == 0 else reversed(range(len(arms)))):
            driver.structured = arms[k]
            traces = driver.run(prompts, plan.gen_tokens)
            for t in traces:
                t.check(plan.gen_tokens)
            per_run[k].append(b1_metrics(traces[0], length) if b == 1 else batched_metrics(traces, length))
    driver.structured = plan.structured
    rows = []
    for k, structured in enumerate(arms):
        samples = {key: [float(f"{r[key]:.6g}") for r in per_run[k]] for key in per_run[k][0]}
        # (with two arms each arm's count includes the other's runs in between: reported on both)
        samples["preemptions"] = driver.preemptions() - preempted[k]
        if b == 1:
            ttft = statistics.median(samples["ttft_ms"])
            metrics = {"ttft_ms": round(ttft, 2), "prefill_tok_s": round(length / (ttft / 1000), 1),
                       "decode_tok_s": round(statistics.median(samples["decode_tok_s"]), 1)}
        else:
            metrics = {key: round(statistics.median(samples[key]), 1) for key in ("pp_tok_s", "tg_tok_s", "total_tok_s")}
        if k == 1:
            rate = "decode_tok_s" if b == 1 else "tg_tok_s"
            pairs = [c[rate] / p[rate] for p, c in zip(per_run[0], per_run[1])]
            samples["vs_plain"] = [round(r, 4) for r in pairs]
            metrics["vs_plain"] = round(statistics.median(pairs), 3)
        json_ = " json" if structured is not None else ""
        rows.append(BenchRow(f"{driver.name} p{length} b{b}{json_}", driver.name, "b1" if b == 1 else "batched",
                             length, plan.gen_tokens, b, plan.runs, setup, metrics, samples, structured is not None))
    return rows


def concurrent_vs_sequential(scheduler: BatchScheduler, setup: Setup, prompts: list[list[int]],
                             gen_tokens: int, structured: StructuredOutput | None = None) -> BenchRow:
    """The prompts (greedy, EOS ignored, prefix cache bypassed) submitted at once, then the same
    prompts one after another, engine path, in one process so the two compare as a ratio.

    Returns:
        A ``concurrency`` row: ``concurrent_s`` / ``sequential_s`` (wall seconds), generated
        tokens/s of each, ``speedup`` (sequential time / concurrent time).

    Raises:
        MonobatchError: a request did not end with ``length`` after exactly ``gen_tokens``
            tokens (as :func:`measure`, via :meth:`Trace.check`).
    """
    driver = EngineDriver(scheduler)
    driver.structured = structured
    start = time.perf_counter()
    traces = driver.run(prompts, gen_tokens)
    concurrent = time.perf_counter() - start
    start = time.perf_counter()
    for p in prompts:
        traces += driver.run([p], gen_tokens)
    sequential = time.perf_counter() - start
    for t in traces:
        t.check(gen_tokens)
    total = len(prompts) * gen_tokens
    metrics = {"concurrent_s": round(concurrent, 3), "sequential_s": round(sequential, 3),
               "concurrent_tok_s": round(total / concurrent, 1), "sequential_tok_s": round(total / sequential, 1),
               "speedup": round(sequential / concurrent, 2)}
    n, length = len(prompts), len(prompts[0])
    return BenchRow(f"engine p{length} c{n}", "engine", "concurrency", length, gen_tokens, n, 1, setup, metrics, {})
