"""`monobatch` as a user runs it: subprocesses, exit codes, one-line errors, no tracebacks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def monobatch(*args: str, stdin: str | None = None, timeout: int = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, "-m", "monobatch", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, env=env)


def assert_one_line_error(res: subprocess.CompletedProcess, *needles: str) -> None:
    assert res.returncode != 0
    assert "Traceback" not in res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize("args,needle", [
    (["-n", "-2"], "max-tokens"),
    (["--top-p", "2"], "top_p"),
    (["--temperature", "-1"], "temperature"),
    (["--top-k", "-5"], "top_k"),
    (["-c", "-1"], "ctx-size"),
    (["-t", "0"], "threads"),
    (["--prefill-chunk", "0"], "prefill-chunk"),
    (["--logit-bias", "abc"], "ID=BIAS"),
    (["--dtype", "float8"], "dtype"),
    (["--device", "tpu"], "device"),
    (["--frobnicate"], "unrecognized"),
    (["--logit-bias", "999999=1"], "vocabulary"),
])
def test_out_of_range_values(args, needle):
    res = monobatch("generate", "-p", "hi", "--no-progress", *args)
    assert_one_line_error(res, needle)


def test_missing_model():
    res = monobatch("generate", "-p", "hi", "-m", "/nonexistent/model.gguf")
    assert_one_line_error(res, "model not found", "/nonexistent/model.gguf")


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    assert_one_line_error(monobatch("generate", "-p", "hi", "-m", str(bad)), "not a readable GGUF")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 8}))
    assert_one_line_error(monobatch("generate", "-p", "hi", "-m", str(tmp_path)), "unsupported architecture", "gpt2")


def test_empty_prompt():
    assert_one_line_error(monobatch("generate", "-p", "", "--no-progress"), "prompt is empty")


def test_no_prompt_on_a_closed_stdin():
    assert_one_line_error(monobatch("generate", "--no-progress", stdin=""), "prompt is empty")


def test_prompt_longer_than_context():
    res = monobatch("generate", "-p", "word " * 40, "-c", "16", "--no-progress")
    assert_one_line_error(res, "context is 16 tokens")


def test_generate_streams_text_and_reports_json(loaded):
    res = monobatch("generate", "--chat", "-p", "What is 2+2?", "--temperature", "0", "-n", "12", "--no-progress")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip()
    assert "finish_reason=" in res.stderr
    res = monobatch("generate", "--temperature", "0", "-n", "-1", "-c", "40", "--ignore-eos", "--output-format", "json",
                    "--no-progress", stdin="Once upon a time")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["finish_reason"] == "length"
    assert out["usage"]["total_tokens"] == 40  # -n -1 runs to the context end
    assert set(out["timings"]) >= {"load_ms", "ttft_ms", "decode_tok_per_s"}


def test_bench_json_dummy_weights():
    res = monobatch("bench", "--dummy-weights", "--shape", "smollm2-135m", "-p", "16", "-n", "8", "-r", "1", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["prompt_tokens"] == 16 and out["gen_tokens"] == 8
    assert out["decode_tok_s"] > 0 and out["ttft_ms"] > 0 and out["peak_rss_mb"] > 0


def test_bench_unknown_shape():
    assert_one_line_error(monobatch("bench", "--dummy-weights", "--shape", "gpt-5"), "unknown shape")
