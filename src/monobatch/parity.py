"""``monobatch parity``: one prompt and sampling config through every door, compared token id by
token id with the engine run directly at B=1 (the one-engine invariants of docs/adr/0001 and
/work/shared/design/ENGINE.md, checked end to end).

Usage::

    monobatch parity                                  # fast mode, both configs, a text report
    monobatch parity --deterministic --expect-identical -t 1    # exit 1 on any divergence
    monobatch parity --configs greedy -n 64 --prompt "Why is the sky blue?" --json report.json
    monobatch parity --device cuda --deterministic    # any model and engine flag of generate

The doors, each generating from the same chat prompt (one user message through the model's chat
template) with the same sampling fields, ``max_tokens`` and ``ignore_eos``:

==============  ==========================================================================
``generate``    the reference: a fresh :class:`BatchScheduler` in this process, B=1, with the
                ``--kv-storage`` / ``--prefill-chunk`` flags (the engine directly, no HTTP)
``run``         ``python -m monobatch run --server-base URL`` (a subprocess: the chat CLI over
                HTTP/SSE) against an in-process server built from the same flags; the text it
                prints must equal the detokenized ids the engine generated
``server-dense`` ``POST /v1/chat/completions`` on a fresh server with dense KV storage, B=1
``server-paged`` the same on a fresh paged server (a prefix-cache miss)
``prefix-hit``  the same request again on that paged server: it must adopt cached blocks
``batch``       the request inside 8 concurrent others (other prompts, lengths and sampling:
                penalties, biases, other seeds; 4 already decoding when it arrives) on a fresh
                paged server whose prefill chunk is ``--batch-prefill-chunk`` (16 by default, so
                its prompt is computed in several chunks beside the others' decodes); it
                bypasses the prefix cache (``cache_prompt: false``) so that only batching and
                chunking differ from the reference
==============  ==========================================================================

The server doors read what the engine generated (ids, prefix-cache adoption, prefill chunks,
how many sequences shared its steps) through a finish observer on the server's scheduler
(:meth:`BatchScheduler.add_finish_observer`), cross-checked against the HTTP answer's
``token_ids``; paged-attention calls come from ``/metrics``
(``monobatch_paged_attention_calls_total``; dense storage: 0).

For each door the report says ``identical``, or the first divergent index, both token ids and
the reference engine's top-2 logit margin there (``Engine.top2_margin``: how near a tie that
greedy draw was). Under ``--deterministic`` every door must be identical; in the default (fast)
mode a divergence is expected only at a near-tie.

Exit codes: 0 = done (every door identical, or differences without ``--expect-identical``);
1 = with ``--expect-identical``, a door diverged or a check failed (no prefix hit, no shared
steps, no paged attention on a paged door, CLI text != decode(ids), ...); 2 = an error: a bad
flag, a model that cannot load, a door that failed to run.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:
    from monobatch.engine.engine import EngineConfig
    from monobatch.engine.scheduler import FinishedRequest
    from monobatch.loader import LoadedModel

#: The doors, in report order; ``generate`` is the reference.
DOORS = ("generate", "run", "server-dense", "server-paged", "prefix-hit", "batch")
#: Doors whose KV storage is paged whatever the flags say (their paged-attention count must be > 0).
PAGED_DOORS = ("server-paged", "prefix-hit", "batch")

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

#: Seconds for one HTTP request, a server to load, the ``run`` subprocess.
HTTP_TIMEOUT = 600.0
LOAD_TIMEOUT = 300.0
RUN_TIMEOUT = 600.0


# -- comparing ---------------------------------------------------------------------------------------
@dataclass(slots=True)
class Divergence:
    """Where a door's tokens first differ from the reference's.

    Attributes:
        index: position in the generated tokens (0 = the first generated token).
        reference_token / door_token: the ids there (None where that side has no token: it
            ended sooner).
        margin: the reference engine's top-2 logit gap before that token (logit units, >= 0;
            None when not computed): small means a near-tie, where fast-mode numerics may flip.
    """

    index: int
    reference_token: int | None
    door_token: int | None
    margin: float | None = None


def first_divergence(reference: list[int], other: list[int]) -> int | None:
    """Index of the first position where ``other`` differs from ``reference``.

    Returns:
        The index; the shorter length when one is a strict prefix of the other; None when the
        lists are equal.
    """
    for i, (a, b) in enumerate(zip(reference, other)):
        if a != b:
            return i
    return None if len(reference) == len(other) else min(len(reference), len(other))


def compare(prompt_ids: list[int], reference: list[int], other: list[int],
            margin_of: Callable[[list[int]], float] | None = None) -> Divergence | None:
    """Compare a door's generated ids with the reference's.

    Args:
        prompt_ids: the prompt both generated from (token ids).
        reference / other: generated token ids (prompt excluded).
        margin_of: maps a token-id context to the top-2 logit margin after it (e.g.
            ``Engine.top2_margin``); called once, with ``prompt_ids + reference[:index]``.

    Returns:
        None when identical, else the first :class:`Divergence`.
    """
    i = first_divergence(reference, other)
    if i is None:
        return None
    margin = margin_of(list(prompt_ids) + list(reference[:i])) if margin_of is not None else None
    return Divergence(i, reference[i] if i < len(reference) else None, other[i] if i < len(other) else None, margin)


# -- results -----------------------------------------------------------------------------------------
@dataclass(slots=True)
class DoorResult:
    """One door's run for one config.

    Attributes:
        door: one of :data:`DOORS`.
        status: ``reference`` (the generate door), ``identical``, ``diverged`` or ``error``.
        token_ids: the generated ids the engine produced for this door's request.
        divergence: where they first differ from the reference (``diverged`` only).
        paged_attention_calls: the door's engine's paged-attention calls during the door (one per
            layer per step; includes the batch door's neighbours; 0 on dense storage).
        cached_tokens: prompt tokens adopted from the prefix cache.
        prefill_chunks: ``(start, end)`` prompt positions computed, chunk by chunk.
        shared_steps / num_steps / max_batch_seqs: steps the request shared with other sequences,
            its steps in all (prefill chunks + decodes), the most sequences in one of them.
        evidence: what the door proved, for the report (``CLI text == decode(ids)``, ...).
        problems: checks that failed (the door ran, but did not show what it must).
        error: why the door could not run (``error`` status).
        seconds: wall time of the door.
    """

    door: str
    status: str = "error"
    token_ids: list[int] = field(default_factory=list)
    divergence: Divergence | None = None
    paged_attention_calls: int | None = None
    cached_tokens: int | None = None
    prefill_chunks: list[tuple[int, int]] = field(default_factory=list)
    shared_steps: int | None = None
    num_steps: int | None = None
    max_batch_seqs: int | None = None
    evidence: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """Identical to the reference (or the reference itself) with every check passed."""
        return self.status in ("reference", "identical") and not self.problems

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields."""
        out = dataclasses.asdict(self)
        out["prefill_chunks"] = [list(c) for c in self.prefill_chunks]
        out["ok"] = self.ok
        return out


@dataclass(slots=True)
class ConfigReport:
    """The doors of one sampling config.

    Attributes:
        name: ``greedy`` or ``seeded``.
        fields: the request fields every door sent (max_tokens and ignore_eos included).
        prompt_ids: the reference's prompt ids (chat template applied).
        doors: :class:`DoorResult` per door, the reference first.
    """

    name: str
    fields: dict[str, Any]
    prompt_ids: list[int] = field(default_factory=list)
    doors: list[DoorResult] = field(default_factory=list)


@dataclass(slots=True)
class ParityReport:
    """The whole report.

    Attributes:
        mode: ``deterministic`` or ``fast``.
        device: e.g. ``cpu`` or ``cuda:0 (NVIDIA H200)``; dtype: the compute dtype.
        model: the model's name; prompt: the user message; max_tokens: tokens per door.
        configs: one :class:`ConfigReport` per config.
        seconds: wall time after loading.
    """

    mode: str
    device: str
    dtype: str
    model: str
    prompt: str
    max_tokens: int
    batch_prefill_chunk: int
    configs: list[ConfigReport] = field(default_factory=list)
    seconds: float = 0.0

    def results(self) -> list[DoorResult]:
        """Every door result of every config."""
        return [d for c in self.configs for d in c.doors]

    @property
    def errors(self) -> int:
        """Doors that failed to run."""
        return sum(d.status == "error" for d in self.results())

    @property
    def identical(self) -> bool:
        """Every door identical to its reference with every check passed (and no errors)."""
        return all(d.ok for d in self.results())

    def exit_code(self, expect_identical: bool) -> int:
        """2 when a door failed to run; else 1 when ``expect_identical`` and something differs
        or a check failed; else 0."""
        if self.errors:
            return 2
        return 1 if expect_identical and not self.identical else 0

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data."""
        return {"mode": self.mode, "device": self.device, "dtype": self.dtype, "model": self.model,
                "prompt": self.prompt, "max_tokens": self.max_tokens, "batch_prefill_chunk": self.batch_prefill_chunk,
                "identical": self.identical, "errors": self.errors, "seconds": round(self.seconds, 2),
                "configs": [{"name": c.name, "fields": c.fields, "prompt_ids": c.prompt_ids,
                             "doors": [d.to_dict() for d in c.doors]} for c in self.configs]}

    def text(self) -> str:
        """The human-readable report."""
        mode = "deterministic (--deterministic)" if self.mode == "deterministic" else "fast (the default)"
        lines = [f"monobatch parity: mode {mode}, device {self.device} ({self.dtype}), model {self.model}",
                 f"prompt: {self.prompt!r}"]
        for c in self.configs:
            fields = ", ".join(f"{k}={v}" for k, v in c.fields.items())
            lines += ["", f"[{c.name}] {len(c.prompt_ids)} prompt tokens (chat template); {fields}",
                      f"  {'door':<13} {'result':<15} {'paged-attn':>10}  {'prefill: cached + computed':<36} evidence"]
            for d in c.doors:
                if d.status == "diverged" and d.divergence is not None:
                    result = f"diverged@{d.divergence.index}"
                else:
                    result = d.status
                calls = "-" if d.paged_attention_calls is None else str(d.paged_attention_calls)
                prefill = "-" if d.cached_tokens is None else \
                    f"{d.cached_tokens} + " + " ".join(f"[{s},{e})" for s, e in d.prefill_chunks)
                lines.append(f"  {d.door:<13} {result:<15} {calls:>10}  {prefill:<36} {'; '.join(d.evidence)}")
                if d.divergence is not None:
                    v = d.divergence
                    margin = "-" if v.margin is None else f"{v.margin:.4f}"
                    lines.append(f"      first divergence at generated token {v.index}: reference {v.reference_token} "
                                 f"vs {v.door_token}; top-2 logit margin there {margin}")
                for p in d.problems:
                    lines.append(f"      CHECK FAILED: {p}")
                if d.error:
                    lines.append(f"      ERROR: {d.error}")
        n = len(self.results())
        good = sum(d.ok for d in self.results())
        lines += ["", f"result: {good} of {n} door runs identical to the reference with every check passed"
                      + (f"; {self.errors} failed to run" if self.errors else "")
                      + f" ({self.seconds:.1f} s)"]
        return "\n".join(lines)


# -- capturing what the engine generated ---------------------------------------------------------------
class _Recorder:
    """A finish observer: keeps every finished request (engine thread) for the parity thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: list["FinishedRequest"] = []

    def add(self, record: "FinishedRequest") -> None:
        with self._lock:
            self._records.append(record)

    def mark(self) -> int:
        """A position: :meth:`since` returns what finished after it."""
        with self._lock:
            return len(self._records)

    def since(self, mark: int) -> list["FinishedRequest"]:
        with self._lock:
            return list(self._records[mark:])


@dataclass(slots=True)
class _Server:
    base_url: str
    recorder: _Recorder
    kv_storage: str

    def metrics(self) -> dict[str, float]:
        """``/metrics`` as ``{sample name: value}`` (unlabelled samples)."""
        import httpx
        from prometheus_client.parser import text_string_to_metric_families

        text = httpx.get(self.base_url + "/metrics", timeout=HTTP_TIMEOUT).text
        return {s.name: s.value for family in text_string_to_metric_families(text) for s in family.samples
                if not s.labels}

    def settled_metrics(self, finished: int, timeout: float = 60.0) -> dict[str, float]:
        """``/metrics`` once the engine has published the stats of the step that finished the
        ``finished``-th request (stats are published just after the outputs are handed over)."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.metrics()
            idle = m.get("monobatch_num_requests_running", 1) == 0 and m.get("monobatch_num_requests_waiting", 1) == 0
            if idle and m.get("monobatch_num_requests_finished_total", 0) >= finished:
                return m
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server's metrics did not settle: {m}")
            time.sleep(0.02)

    def chat(self, message: str, fields: dict[str, Any]) -> dict[str, Any]:
        """A non-streamed chat completion with ``return_token_ids``; raises on an error answer."""
        import httpx

        body = {"messages": [{"role": "user", "content": message}], **fields, "return_token_ids": True}
        r = httpx.post(self.base_url + "/v1/chat/completions", json=body, timeout=HTTP_TIMEOUT)
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.text[:300]}")
        return r.json()


@contextmanager
def _serving(loaded: "LoadedModel", config: "EngineConfig") -> Iterator[_Server]:
    """A fresh engine over ``loaded`` behind the app ``monobatch serve`` builds, served on a
    background thread (127.0.0.1, a free port), its finished requests recorded."""
    from monobatch.engine.engine import Engine
    from monobatch.engine.scheduler import BatchScheduler
    from monobatch.server import ServerSettings, ServerThread, create_app

    recorder = _Recorder()

    def load() -> BatchScheduler:
        scheduler = BatchScheduler(Engine(loaded, config))
        scheduler.add_finish_observer(recorder.add)
        return scheduler

    server = ServerThread(create_app(ServerSettings(), load)).start()
    try:
        server.wait_ready(LOAD_TIMEOUT)
        yield _Server(server.base_url, recorder, config.kv_storage)
    finally:
        server.stop()


# -- the doors -------------------------------------------------------------------------------------
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


def _run_door(result: DoorResult, fn: Callable[[], None]) -> DoorResult:
    """Run one door; an exception makes it an ``error`` (the message kept, the run goes on)."""
    start = time.perf_counter()
    try:
        fn()
        if result.status == "error":
            result.status = "identical"  # compared below by the caller
    except Exception as exc:  # noqa: BLE001 - a failed door is reported, the others still run
        result.status, result.error = "error", f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
    result.seconds = time.perf_counter() - start
    return result


def run_cli_door(base_url: str, message: str, fields: dict[str, Any], timeout: float = RUN_TIMEOUT) -> str:
    """``python -m monobatch run --server-base base_url`` with ``fields`` as flags; its stdout.

    The child is ``sys.executable -m monobatch`` with this process's ``monobatch`` package first
    on ``PYTHONPATH``, so it works where the package is not installed.

    Args:
        fields: request fields (SamplingParams names, the ``run`` flags' names with dashes):
            ``True`` -> a bare flag, ``False`` -> none, ``logit_bias`` -> ``--logit-bias=ID=BIAS``
            each, anything else ``--name-with-dashes=value``.

    Returns:
        The reply as printed, reasoning text included (``--reasoning-format none``; the final
        newline ``run`` adds removed).

    Raises:
        RuntimeError: the command failed (its last stderr line), or ran past ``timeout`` seconds.
    """
    import monobatch

    # --reasoning-format none: a <think> block's text stays in the reply (stdout), not on stderr
    args = [sys.executable, "-m", "monobatch", "run", "--server-base", base_url, "--reasoning-format", "none",
            f"--prompt={message}"]
    for name, value in fields.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            args += [flag] if value else []  # the boolean flags are off by default
        elif name == "logit_bias":
            args += [f"--logit-bias={k}={v}" for k, v in value.items()]
        else:
            args.append(f"{flag}={value}")  # one argument: a negative value is not taken for a flag
    package_root = str(Path(monobatch.__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if k != "MONOBATCH_API_KEY"}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")])),
               PYTHONIOENCODING="utf-8", TOKENIZERS_PARALLELISM="false")
    try:
        res = subprocess.run(args, capture_output=True, timeout=timeout, env=env, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        raise RuntimeError(f"monobatch run did not finish in {timeout:g} s") from None
    stderr = res.stderr.decode("utf-8", "replace").strip()
    if res.returncode != 0:
        last = stderr.splitlines()[-1] if stderr else "no message"
        raise RuntimeError(f"monobatch run exited {res.returncode}: {last}")
    return res.stdout.decode("utf-8").removesuffix("\n")


class _Parity:
    """The doors of one config, sharing the loaded model and the reference's results."""

    def __init__(self, loaded: "LoadedModel", base: "EngineConfig", prompt: str, batch_prefill_chunk: int,
                 progress: Callable[[str], None]) -> None:
        self.loaded, self.base, self.prompt = loaded, base, prompt
        self.batch_prefill_chunk = batch_prefill_chunk
        self.progress = progress
        self.margin_engine = None

    def config(self, **changes: Any) -> "EngineConfig":
        if changes.get("kv_storage") == "dense":
            changes["kv_cache_memory"] = None
        return dataclasses.replace(self.base, **changes)

    def run_config(self, name: str, fields: dict[str, Any]) -> ConfigReport:
        from monobatch.engine.params import resolve_sampling

        report = ConfigReport(name, fields)
        self.params = resolve_sampling(fields, None, self.loaded.generation_defaults, entry_point="chat")
        report.prompt_ids = self.loaded.tokenizer.encode_chat([{"role": "user", "content": self.prompt}], True)
        self.prompt_ids = report.prompt_ids
        self.fields = fields
        ref = DoorResult("generate")
        self.progress(f"{name}: generate (the reference)")
        _run_door(ref, lambda: self._generate(ref))
        if ref.status == "error":
            report.doors.append(ref)
            for door in DOORS[1:]:
                report.doors.append(DoorResult(door, error="the reference did not run"))
            return report
        ref.status = "reference"
        report.doors.append(ref)
        self.reference = ref.token_ids
        doors = [DoorResult(d) for d in DOORS[1:]]
        by_name = {d.door: d for d in doors}
        self.progress(f"{name}: run (the CLI over HTTP)")
        _run_door(by_name["run"], lambda: self._run(by_name["run"]))
        self.progress(f"{name}: server, dense KV")
        _run_door(by_name["server-dense"], lambda: self._server_b1(by_name["server-dense"], "dense"))
        self.progress(f"{name}: server, paged KV, then the prefix-cache hit")
        self._paged_and_hit(by_name["server-paged"], by_name["prefix-hit"])
        self.progress(f"{name}: batch of {len(NEIGHBOURS) + 1}")
        _run_door(by_name["batch"], lambda: self._batch(by_name["batch"]))
        for d in doors:
            if d.status != "error":
                d.divergence = compare(self.prompt_ids, self.reference, d.token_ids, self.margin)
                d.status = "identical" if d.divergence is None else "diverged"
        report.doors += doors
        return report

    def margin(self, ids: list[int]) -> float:
        """The reference engine's top-2 logit margin after ``ids``."""
        return self.margin_engine.top2_margin(ids)

    # -- generate: the engine directly, B=1 --------------------------------------------------------------
    def _generate(self, result: DoorResult) -> None:
        from monobatch.engine.engine import Engine
        from monobatch.engine.scheduler import BatchScheduler
        from monobatch.engine.sequence import Request

        engine = Engine(self.loaded, self.base)
        self.margin_engine = engine
        scheduler = BatchScheduler(engine)
        recorder = _Recorder()
        scheduler.add_finish_observer(recorder.add)
        before = scheduler.stats().paged_attention_calls
        for _ in scheduler.run([Request("parity-generate", list(self.prompt_ids), self.params)]):
            pass
        _fill(result, _one(recorder.since(0), self.prompt_ids, result))
        result.paged_attention_calls = scheduler.stats().paged_attention_calls - before
        result.evidence.append(f"engine direct, B=1, {self.base.kv_storage} KV")
        _check_paged(result, self.base.kv_storage == "paged")

    # -- run: the chat CLI over HTTP -------------------------------------------------------------------
    def _run(self, result: DoorResult) -> None:
        from monobatch.tokenizer import IncrementalDetokenizer

        with _serving(self.loaded, self.base) as server:
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
    def _ask(self, server: _Server, result: DoorResult, finished: int) -> None:
        mark, before = server.recorder.mark(), server.metrics()
        answer = server.chat(self.prompt, self.fields)
        after = server.settled_metrics(finished)
        _fill(result, _one(server.recorder.since(mark), self.prompt_ids, result))
        _check_http(result, answer, self.prompt_ids)
        result.paged_attention_calls = _calls(after) - _calls(before)
        _check_paged(result, server.kv_storage == "paged")

    def _server_b1(self, result: DoorResult, storage: str) -> None:
        with _serving(self.loaded, self.config(kv_storage=storage)) as server:
            self._ask(server, result, 1)
        result.evidence.append(f"HTTP, B=1, {storage} KV")

    def _paged_and_hit(self, miss: DoorResult, hit: DoorResult) -> None:
        try:
            with _serving(self.loaded, self.config(kv_storage="paged")) as server:
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
                    d.error = f"{type(exc).__name__}: {exc}".splitlines()[0][:500]
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
        with _serving(self.loaded, config) as server, ThreadPoolExecutor(len(neighbours) + 1) as pool:
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
        KeyError: an unknown config name. MonobatchError: the prompt is unusable (empty after the
            template, too long for the context).
    """
    start = time.perf_counter()
    report = ParityReport("deterministic" if base.deterministic else "fast", device_name(loaded),
                          str(loaded.model.dtype).removeprefix("torch."), loaded.name, prompt, max_tokens,
                          batch_prefill_chunk)
    parity = _Parity(loaded, base, prompt, batch_prefill_chunk, progress or (lambda line: None))
    for name in configs:
        report.configs.append(parity.run_config(name, sampling_fields(name, max_tokens)))
    report.seconds = time.perf_counter() - start
    return report


def write_json(report: ParityReport, path: str) -> None:
    """Write ``report.to_dict()`` to ``path`` (``-``: stdout)."""
    text = json.dumps(report.to_dict(), indent=2)
    if path == "-":
        print(text)
    else:
        Path(path).write_text(text + "\n", encoding="utf-8")
