"""`monobatch bench`: the three paths, batched rows, the JSON-lines contract, prompts, bad input.

The CLI runs as a subprocess on random weights of the ``tiny`` shape (milliseconds a step), so
these tests check behaviour and the output contract, never speed.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from cli_util import assert_one_line_error, cli_env, monobatch
from fixtures_tokenizer import smollm_reader, smollm_tokenizer  # noqa: F401 - fixtures
from monobatch.bench import Trace, b1_metrics, batched_metrics, synth_prompt
from monobatch.errors import MonobatchError
from monobatch.tokenizer import Tokenizer

TINY = ("bench", "--dummy-weights", "--shape", "tiny", "-t", "1")
#: Fields every JSON line carries (scripts/bench_rounds.py reads ``label`` and the metrics).
COMMON = {"label", "path", "mode", "prompt_tokens", "gen_tokens", "batch_size", "runs", "kv_storage", "prefill_chunk",
          "deterministic", "device", "dtype", "model", "weight_mib", "peak_rss_mib", "samples"}
B1_METRICS = ("ttft_ms", "prefill_tok_s", "decode_tok_s")
BATCHED_METRICS = ("pp_tok_s", "tg_tok_s", "total_tok_s")


def json_lines(res: subprocess.CompletedProcess) -> list[dict]:
    assert res.returncode == 0, res.stderr
    return [json.loads(line) for line in res.stdout.splitlines()]


@pytest.fixture(scope="module")
def all_paths() -> list[dict]:
    """Every path x two prompt lengths x B in {1, 2}, plus -b 2 (concurrent vs sequential)."""
    return json_lines(monobatch(*TINY, "--path", "http,engine,server", "-p", "16,40", "-n", "5", "-r", "2",
                                "--batch-size", "1,2", "-b", "2", "--json"))


def test_one_line_per_configuration_with_stable_labels(all_paths):
    assert [r["label"] for r in all_paths] == [
        f"{path} p{p} b{b}" for path in ("engine", "server", "http") for p in (16, 40) for b in (1, 2)
    ] + ["engine p16 c2", "engine p40 c2"]  # paths run in a fixed order, whatever order --path names them


@pytest.mark.parametrize("path", ["engine", "server", "http"])
def test_json_contract(all_paths, path):
    rows = [r for r in all_paths if r["path"] == path and r["mode"] != "concurrency"]
    assert len(rows) == 4
    for r in rows:
        assert COMMON <= r.keys(), r.keys()
        assert r["gen_tokens"] == 5 and r["runs"] == 2 and r["device"] == "cpu" and r["dtype"] == "float32"
        assert r["model"] == "dummy-tiny" and r["kv_storage"] == "paged" and r["prefill_chunk"] == 2048
        assert r["deterministic"] is False
        assert r["peak_rss_mib"] > r["weight_mib"] > 0 and " MiB" in r["engine"] and " MB" not in r["engine"]
        metrics = B1_METRICS if r["batch_size"] == 1 else BATCHED_METRICS
        assert r["mode"] == ("b1" if r["batch_size"] == 1 else "batched")
        for name in metrics:
            assert isinstance(r[name], float) and r[name] > 0, (r["label"], name, r[name])
            assert len(r["samples"][name]) == 2 and all(v > 0 for v in r["samples"][name])
        other = BATCHED_METRICS if r["batch_size"] == 1 else B1_METRICS
        assert not set(other) & r.keys()
        assert r["samples"]["preemptions"] == 0
    b1 = next(r for r in rows if r["batch_size"] == 1)
    assert b1["prefill_tok_s"] == pytest.approx(b1["prompt_tokens"] / (b1["ttft_ms"] / 1000), rel=0.01)


def test_concurrency_rows(all_paths):
    rows = [r for r in all_paths if r["mode"] == "concurrency"]
    assert [r["prompt_tokens"] for r in rows] == [16, 40]
    for r in rows:
        assert r["batch_size"] == 2 and r["path"] == "engine"
        assert all(r[k] > 0 for k in ("concurrent_tok_s", "sequential_tok_s", "speedup"))


def test_kv_storage_and_prefill_chunk_apply_and_are_recorded():
    (row,) = json_lines(monobatch(*TINY, "--kv-storage", "dense", "--prefill-chunk", "8", "--deterministic",
                                  "-p", "20", "-n", "3", "-r", "1", "--json"))
    assert row["kv_storage"] == "dense" and row["prefill_chunk"] == 8 and row["deterministic"] is True
    assert "KV cache: dense" in row["engine"] and "deterministic" in row["engine"]
    assert row["label"] == "engine p20 b1" and row["prompt_tokens"] == 20


def test_table_output():
    res = monobatch(*TINY, "-p", "12", "-n", "3", "-r", "1", "--batch-size", "1,3", "--path", "server")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("model dummy-tiny  device cpu")
    assert any(ln.split()[:2] == ["label", "TTFT"] for ln in lines)
    b1 = next(ln for ln in lines if ln.startswith("server p12 b1 "))
    b3 = next(ln for ln in lines if ln.startswith("server p12 b3 "))
    assert b1.split()[-3:] == ["-", "-", "-"] and b3.split()[3:6] == ["-", "-", "-"]
    assert re.fullmatch(r"peak RSS \d+ MiB", lines[-1]), lines[-1]  # MiB, as the header's weights and KV pool
    assert re.search(r"  weights \d+ MiB$", lines[0]) and " MB" not in res.stdout, lines[:2]


def test_constrained_ab_alternates_the_arms_in_one_process():
    """``--constrained ab`` (bundled model: the grammar needs a real tokenizer): per configuration a
    plain row, then the constrained row with the median of its per-run-pair ratios."""
    rows = json_lines(monobatch("bench", "-t", "1", "-p", "12", "-n", "4", "-r", "3", "--batch-size", "1,2",
                                "--constrained", "ab", "--json"))
    assert [(r["label"], r["constrained"]) for r in rows] == [
        ("engine p12 b1", False), ("engine p12 b1 json", True), ("engine p12 b2", False), ("engine p12 b2 json", True)]
    for plain, constrained in (rows[:2], rows[2:]):
        rate = "decode_tok_s" if plain["batch_size"] == 1 else "tg_tok_s"
        pairs = [c / p for p, c in zip(plain["samples"][rate], constrained["samples"][rate])]
        assert constrained["samples"]["vs_plain"] == pytest.approx(pairs, rel=1e-3)
        assert constrained["vs_plain"] == pytest.approx(sorted(pairs)[1], rel=1e-2)  # the median of 3
        assert "vs_plain" not in plain and len(plain["samples"][rate]) == 3


@pytest.mark.parametrize("args, needle", [
    (("-p", "250", "-n", "8"), "exceed the context (256 tokens)"),  # tiny's context is 256
    (("-p", "16,300",), "exceed the context"),
    (("--path", "engine,grpc"), "unknown path 'grpc'"),
    (("--batch-size", "1,0"), "must be >= 1"),
    (("--batch-size", "-2"), "must be >= 1"),
    (("-p", "0"), "must be >= 1"),
    (("-p", "12,abc"), "comma list of integers"),
    (("-n", "1"), "--gen-tokens must be >= 2"),
    (("-r", "0"), "--runs must be >= 1"),
    (("--batch-size", "9", "--max-num-seqs", "8", "-p", "8"), "more than --max-num-seqs"),
    (("--batch-size", "2", "-p", "200", "-n", "50", "--kv-cache-memory", "160K"), "raise --kv-cache-memory"),
    (("--kv-cache-memory", "100000G"), "cannot allocate the KV pool"),  # more than the host: no MemoryError traceback
])
def test_bad_input_is_one_line(args, needle):
    assert_one_line_error(monobatch(*TINY, *args), needle)


def test_cli_names_every_path():
    from monobatch.bench import DRIVERS
    from monobatch.cli.bench import PATHS

    assert tuple(DRIVERS) == PATHS


def test_parser_imports_no_torch_or_fastapi():
    code = ("import sys; from monobatch.cli.main import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'fastapi', 'uvicorn') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=cli_env(), timeout=60)
    assert out.stdout.strip() == "[]", out.stderr


# -- prompts and metrics (in process) --------------------------------------------------------------
@pytest.mark.parametrize("length", [1, 7, 64, 1000])
def test_synth_prompt_is_exact_and_deterministic(length):
    tok = Tokenizer.synthetic(512)
    ids = synth_prompt(tok, length)
    assert len(ids) == length and ids == synth_prompt(tok, length)
    assert all(0 < t < 512 for t in ids)
    if length >= 64:
        assert len(set(ids)) > 20  # words map to distinct ids, not all to the unknown token
        assert synth_prompt(tok, length, seed=1) != ids


def test_synth_prompt_is_text_for_a_real_tokenizer(smollm_tokenizer):
    tok = smollm_tokenizer
    ids = synth_prompt(tok, 300)
    assert len(ids) == 300 and ids == synth_prompt(tok, 300)
    text = tok.decode(ids)
    assert text[0].isupper() and ". " in text and len(text.split()) > 150


def test_b1_metrics():
    trace = Trace(10.0, [10.5, 10.6, 10.7, 10.9], "length")
    m = b1_metrics(trace, 100)
    assert m["ttft_ms"] == pytest.approx(500) and m["prefill_tok_s"] == pytest.approx(200)
    assert m["decode_tok_s"] == pytest.approx(3 / 0.4)


def test_batched_metrics_are_llama_batched_bench_pp_and_tg():
    # two sequences of 10 prompt tokens + 3 tokens; the second's first token comes a step later
    # (the first one decodes meanwhile: that token is in PP's time, not TG's)
    traces = [Trace(0.0, [1.0, 2.0, 3.0]), Trace(0.0, [2.0, 3.0, 4.0])]
    m = batched_metrics(traces, 10)
    assert m["pp_s"] == 2.0 and m["tg_s"] == 2.0
    assert m["pp_tok_s"] == pytest.approx(20 / 2)
    assert m["tg_tok_s"] == pytest.approx(3 / 2)  # the tokens after t=2: 3.0, 3.0, 4.0
    assert m["total_tok_s"] == pytest.approx((20 + 6) / 4)


def test_trace_check_refuses_a_short_or_stopped_sequence():
    Trace(0.0, [1.0, 2.0], "length").check(2)
    with pytest.raises(MonobatchError, match="finish_reason=stop after 1 of 2"):
        Trace(0.0, [1.0], "stop").check(2)


def test_concurrency_mode_checks_every_trace(monkeypatch):
    """concurrent_vs_sequential refuses a run that ended early, as the other modes do."""
    import monobatch.bench as bench

    class EndsEarly:
        def __init__(self, scheduler) -> None:
            pass

        def run(self, prompts, gen_tokens):
            return [Trace(0.0, [1.0], "stop") for _ in prompts]

    monkeypatch.setattr(bench, "EngineDriver", EndsEarly)
    with pytest.raises(MonobatchError, match="finish_reason=stop after 1 of 3"):
        bench.concurrent_vs_sequential(None, None, [[1, 2], [3, 4]], 3)


def test_constrained_ab_warms_each_arm_then_alternates_abba():
    """``measure`` with two arms: one warm-up each, then the timed runs in ABBA order (plain,
    constrained, constrained, plain, ...), so a drift within the process favours neither arm;
    each arm's row holds its own runs, pair i = the i-th run of each."""
    from monobatch.bench import BenchPlan, measure

    S = object()  # the constraint (the fake driver only records which arm ran)

    class Recording:
        name, structured = "engine", None

        def __init__(self) -> None:
            self.order: list = []

        def preemptions(self) -> int:
            return 0

        def run(self, prompts, gen_tokens):
            self.order.append(self.structured)
            rate = 100.0 if self.structured is None else 80.0  # tokens every 10 or 12.5 ms
            return [Trace(0.0, [0.001 + i / rate for i in range(gen_tokens)], "length") for _ in prompts]

    driver = Recording()
    plain, constrained = measure(driver, None, [[1, 2, 3]], BenchPlan(gen_tokens=4, runs=4, structured=S,
                                                                     plain_too=True))
    assert driver.order == [None, S] + [None, S, S, None, None, S, S, None]
    assert driver.structured is S and not plain.constrained and constrained.constrained
    assert constrained.samples["vs_plain"] == [0.8] * 4 and constrained.metrics["vs_plain"] == 0.8
