"""`monobatch parity`: the one-engine invariants end to end (every door, token id by token id).

The deterministic and the default (fast) mode run as two `python -m monobatch parity` processes
at once (one CPU thread each: the machine has two cores), on the bundled model with both
sampling configs (greedy, seeded, and greedy under a JSON schema). The comparison function is unit-tested on real generated ids, since a real
divergence under --expect-identical cannot be provoked honestly.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from cli_util import assert_one_line_error, cli_env, monobatch
from server_util import ROOT

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

#: Tokens per door in these tests (the command's default is 32; test_compare_on_real_ids needs more
#: than 10): the two runs take ~1 min at once, most of it decoding (the batch door's nine sequences).
MAX_TOKENS = "12"
PAGED = ("server-paged", "prefix-hit", "batch")


@pytest.fixture(scope="module")
def parity_runs(tmp_path_factory):
    """Both modes, run concurrently: ``{mode: (CompletedProcess, report dict or None, seconds)}``."""
    out = tmp_path_factory.mktemp("parity")
    modes = {"deterministic": ["--deterministic"], "fast": []}
    procs, started = {}, time.monotonic()
    for mode, extra in modes.items():
        cmd = [sys.executable, "-m", "monobatch", "parity", *extra, "--expect-identical", "-t", "1", "-n", MAX_TOKENS,
               "--no-progress", "--json", str(out / f"{mode}.json")]
        procs[mode] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=cli_env(),
                                       cwd=ROOT)
    runs = {}
    for mode, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        res = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
        path = out / f"{mode}.json"
        runs[mode] = (res, json.loads(path.read_text()) if path.exists() else None, time.monotonic() - started)
    return runs


def _doors(report: dict) -> list[dict]:
    return [d for c in report["configs"] for d in c["doors"]]


def test_deterministic_mode_every_door_identical(parity_runs):
    res, report, seconds = parity_runs["deterministic"]
    print(f"\n--- monobatch parity --deterministic ({seconds:.0f} s) ---\n{res.stdout}{res.stderr}")
    assert res.returncode == 0, res.stdout + res.stderr
    assert report["mode"] == "deterministic" and report["device"] == "cpu" and report["identical"]
    assert "mode deterministic" in res.stdout and "device cpu" in res.stdout
    assert [c["name"] for c in report["configs"]] == ["greedy", "seeded", "json"]
    for config in report["configs"]:
        doors = {d["door"]: d for d in config["doors"]}
        assert list(doors) == ["generate", "run", "server-dense", "server-paged", "prefix-hit", "batch"]
        ref = doors["generate"]
        assert ref["status"] == "reference" and len(ref["token_ids"]) == int(MAX_TOKENS)
        for name, d in doors.items():
            assert d["ok"] and not d["problems"] and d["error"] is None, (config["name"], d)
            assert d["token_ids"] == ref["token_ids"], (config["name"], name)
            if name != "generate":
                assert d["status"] == "identical" and d["divergence"] is None
        # paged doors really ran paged attention (one call per layer per step), dense none
        for name in PAGED + ("generate", "run"):  # the reference and run use the default: paged
            assert doors[name]["paged_attention_calls"] > 0, name
        assert doors["server-dense"]["paged_attention_calls"] == 0
        # the prefix-cache hit adopted whole blocks and computed the rest; the miss computed all
        n = len(config["prompt_ids"])
        hit, miss = doors["prefix-hit"], doors["server-paged"]
        assert miss["cached_tokens"] == 0 and miss["prefill_chunks"] == [[0, n]]
        assert 0 < hit["cached_tokens"] < n and hit["cached_tokens"] % 16 == 0
        assert hit["prefill_chunks"] == [[hit["cached_tokens"], n]]
        assert "prefix-hit" in res.stdout and f"{hit['cached_tokens']} + [{hit['cached_tokens']},{n})" in res.stdout
        # the batch door shared its steps and computed its whole prompt in chunks of <= 16 tokens
        # (smaller when the step's token budget ran short), one after another
        batch = doors["batch"]
        assert batch["shared_steps"] > 0 and batch["max_batch_seqs"] > 1 and batch["cached_tokens"] == 0
        chunks = batch["prefill_chunks"]
        assert len(chunks) > 1 and chunks[0][0] == 0 and chunks[-1][1] == n
        assert all(0 < e - s <= 16 for s, e in chunks) and all(a[1] == b[0] for a, b in zip(chunks, chunks[1:]))
        assert any("CLI text == decode(ids)" in e for e in doors["run"]["evidence"])


def test_fast_mode_report(parity_runs):
    """The default mode need not be identical (a divergence is allowed at a near-tie), but it
    must run every door: exit 0 or 1, never 2, and a divergence names its index and margin."""
    res, report, seconds = parity_runs["fast"]
    print(f"\n--- monobatch parity (fast, {seconds:.0f} s) ---\n{res.stdout}{res.stderr}")
    assert res.returncode in (0, 1), res.stdout + res.stderr
    assert report["mode"] == "fast" and report["errors"] == 0 and "mode fast" in res.stdout
    for d in _doors(report):
        assert d["status"] in ("reference", "identical", "diverged"), d
        if d["status"] == "diverged":
            v = d["divergence"]
            assert v["index"] >= 0 and v["margin"] is not None and v["margin"] >= 0
            assert f"diverged@{v['index']}" in res.stdout
    assert (res.returncode == 0) == report["identical"]
    for config in report["configs"]:
        doors = {d["door"]: d for d in config["doors"]}
        assert doors["prefix-hit"]["cached_tokens"] > 0 and doors["server-dense"]["paged_attention_calls"] == 0
        assert doors["batch"]["paged_attention_calls"] > 0 and doors["batch"]["shared_steps"] > 0


def test_compare_on_real_ids(parity_runs, loaded):
    """first_divergence / compare on two real generations of the same prompt (greedy and seeded
    diverge somewhere); the margin is the reference engine's top-2 gap at that point."""
    from monobatch.engine.engine import Engine, EngineConfig
    from monobatch.parity import compare, first_divergence

    _, report, _ = parity_runs["deterministic"]
    greedy, seeded = report["configs"][:2]
    assert greedy["prompt_ids"] == seeded["prompt_ids"]
    prompt = greedy["prompt_ids"]
    a, b = greedy["doors"][0]["token_ids"], seeded["doors"][0]["token_ids"]
    expected = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    assert expected is not None, "greedy and seeded generations should differ"
    engine = Engine(loaded, EngineConfig(deterministic=True))
    calls = []

    def margin_of(ids):
        calls.append(list(ids))
        return engine.top2_margin(ids)

    v = compare(prompt, a, b, margin_of)
    assert (v.index, v.reference_token, v.door_token) == (expected, a[expected], b[expected])
    assert calls == [prompt + a[:expected]]
    logits = engine.prompt_logits(prompt + a[:expected])
    top = logits.topk(2)
    assert int(top.indices[0]) == a[expected]  # the greedy reference drew the argmax there
    assert v.margin == pytest.approx(float(top.values[0] - top.values[1])) and v.margin >= 0
    # identical lists: no divergence, no margin computed; a prefix: the shorter length, no token
    assert compare(prompt, a, list(a), lambda ids: pytest.fail("no margin for identical ids")) is None
    assert first_divergence(a, a[:10]) == 10 and first_divergence(a[:10], a) == 10
    short = compare(prompt, a, a[:10])
    assert (short.index, short.reference_token, short.door_token, short.margin) == (10, a[10], None, None)


@pytest.mark.parametrize("config", ["seeded", "json"])
def test_draw_margin_is_the_draws_own(parity_runs, loaded, config):
    """Engine.draw_margin's scores are the ones the draw took the argmax of: at every generated
    position of the deterministic reference (the same numerics as the margin engine), their argmax
    is the token drawn — for the seeded config (penalties, DRY, top-k/p, temperature) the
    noise-perturbed scores of that position's key, for the json config the masked logits — and
    the margin is the gap between the best two. A wrong key or position would draw other tokens."""
    import dataclasses
    import math

    from monobatch.engine.constraint import StructuredOutput
    from monobatch.engine.engine import Engine, EngineConfig
    from monobatch.engine.params import resolve_sampling
    from monobatch.engine.sampler import SamplerState

    _, report, _ = parity_runs["deterministic"]
    cfg = next(c for c in report["configs"] if c["name"] == config)
    fields = dict(cfg["fields"])
    schema = fields.pop("json_schema", None)
    params = resolve_sampling(fields, None, loaded.generation_defaults, entry_point="chat")
    if schema is not None:
        params = dataclasses.replace(params, structured=StructuredOutput.json_schema(schema))
    prompt, ref = cfg["prompt_ids"], cfg["doors"][0]["token_ids"]
    engine = Engine(loaded, EngineConfig(deterministic=True))
    margins, raw_gaps = [], []
    for i in range(0, len(ref), 2):
        margin = engine.draw_margin(prompt, ref[:i], params)
        state = SamplerState(params, prompt, params.effective_seed(), loaded.tokenizer.token_bytes,
                             engine.grammars.matcher(params.structured) if params.structured else None)
        for t in ref[:i]:
            state.accept(t)
        logits = engine.prompt_logits(prompt + ref[:i])[None]
        scores = engine.sampler.draw_scores(logits, [state])[0]
        top = scores.topk(2)
        assert int(top.indices[0]) == ref[i], f"position {i}: the scores' argmax is not the drawn token"
        gap = float(top.values[0] - top.values[1])
        assert margin == (pytest.approx(gap) if math.isfinite(gap) else math.inf) and margin >= 0
        raw = logits[0].topk(2).values
        margins.append(margin)
        raw_gaps.append(float(raw[0] - raw[1]))
    if config == "seeded":  # the noise and the penalties move the margin away from the raw top-2
        assert any(abs(m - g) > 1e-3 for m, g in zip(margins, raw_gaps))


def test_report_exit_codes_and_divergence_line(parity_runs):
    """The exit-code rule and the divergence line, on a report holding a real divergence (the
    seeded generation standing in for a door that drifted from the greedy reference)."""
    from monobatch.parity import ConfigReport, DoorResult, ParityReport, compare

    _, report, _ = parity_runs["deterministic"]
    greedy, seeded = report["configs"][:2]
    ref = greedy["doors"][0]["token_ids"]
    drift = seeded["doors"][0]["token_ids"]
    v = compare(greedy["prompt_ids"], ref, drift, lambda ids: 0.125)
    config = ConfigReport("greedy", greedy["fields"], greedy["prompt_ids"],
                          [DoorResult("generate", "reference", ref), DoorResult("batch", "diverged", drift, v)])
    parity = ParityReport("fast", "cpu", "float32", "m", "p", len(ref), 16, [config])
    assert (parity.exit_code(True), parity.exit_code(False), parity.identical) == (1, 0, False)
    text = parity.text()
    assert f"diverged@{v.index}" in text and f"reference {v.reference_token} vs {v.door_token}" in text
    assert "draw margin there 0.1250" in text
    assert json.loads(json.dumps(parity.to_dict()))["configs"][0]["doors"][1]["divergence"]["index"] == v.index
    config.doors[1] = DoorResult("batch", "identical", list(ref), problems=["no prefix-cache hit"])
    assert (parity.exit_code(True), parity.exit_code(False)) == (1, 0) and "CHECK FAILED" in parity.text()
    config.doors.append(DoorResult("run", error="RuntimeError: monobatch run exited 1"))
    assert (parity.exit_code(True), parity.exit_code(False), parity.errors) == (2, 2, 1)


@pytest.mark.parametrize("args, needle", [
    (["--configs", "greedy,bogus"], "--configs"),
    (["-n", "0"], "--max-tokens"),
    (["-m", "/nowhere/model.gguf"], "model not found"),
    (["--batch-prefill-chunk", "-1"], "--batch-prefill-chunk"),
    (["--json", "/nonexistent-dir/report.json"], "does not exist"),  # refused before any door runs
    # the reference refuses the prompt (longer than the context): one line, no report of failed doors
    (["-t", "1", "-c", "32", "-n", "4", "--no-progress"], "the context is 32 tokens"),
])
def test_bad_flags_exit_2_with_one_line(args, needle):
    res = monobatch("parity", *args, timeout=120)
    assert res.returncode == 2, res
    assert_one_line_error(res, "monobatch parity", needle)


def test_unknown_flag_exits_2():
    res = monobatch("parity", "--no-such-flag", timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr and len(res.stderr.strip().splitlines()) == 1
