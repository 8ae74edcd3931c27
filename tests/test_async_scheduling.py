"""Async scheduling (decode step N+1 launched before step N's draws are read back) gives the
tokens, text and finish reasons of the synchronous loop, for every kind of finish and sampler
setting, alone and in a batch; aborts and failures leave nothing behind. The bundled model, CPU
(the path is on by default on CUDA; here it is switched on explicitly)."""

from __future__ import annotations

import pytest

from monobatch.engine.params import SamplingParams
from monobatch.engine.sequence import Request

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

PROMPTS = ["The capital of France is", "Once upon a time", "1, 2, 3,", "Hello", "The best way to"]
PARAMS = [
    SamplingParams(max_tokens=14, temperature=0.0),
    SamplingParams(max_tokens=12, temperature=0.9, top_k=40, top_p=0.9, seed=7),
    SamplingParams(max_tokens=16, temperature=0.0, stop=[" 7"]),  # a stop string mid-batch
    SamplingParams(max_tokens=9, temperature=0.0, min_tokens=5, ignore_eos=True, logit_bias={13: -2.0}),
    SamplingParams(max_tokens=10, temperature=0.7, seed=3, repeat_penalty=1.3),  # not history-free
]


def _run(scheduler, tokenizer, n=len(PROMPTS)):
    reqs = [Request(f"r{i}", tokenizer.encode(p), sp) for i, (p, sp) in enumerate(zip(PROMPTS[:n], PARAMS[:n]))]
    got = {r.request_id: ([], [], None) for r in reqs}
    for out in scheduler.run(reqs):
        ids, text, _ = got[out.request_id]
        got[out.request_id] = (ids + out.token_ids, text + [out.text], out.finish_reason)
    return {rid: (ids, "".join(text), reason) for rid, (ids, text, reason) in got.items()}


def _count_launches(scheduler):
    engine, counts = scheduler.engine, {"launch": 0, "ahead": 0}
    real = engine.launch

    def launch(batch, rows, ahead=0, token_ids=None, defer_draw=False, **kw):
        counts["launch"] += 1
        counts["ahead"] += ahead
        return real(batch, rows, ahead, token_ids, defer_draw, **kw)

    engine.launch = launch
    return counts


@pytest.mark.parametrize("batched", [False, True])
def test_async_equals_sync(make_scheduler, loaded, batched):
    n = len(PROMPTS) if batched else 1
    want = _run(make_scheduler(async_scheduling=False), loaded.tokenizer, n)
    sched = make_scheduler(async_scheduling=True)
    counts = _count_launches(sched)
    got = _run(sched, loaded.tokenizer, n)
    assert got == want
    assert counts["ahead"] > 0  # steps really overlapped
    assert sched.kv.usage().used_blocks == 0 and not sched.has_unfinished()
    if batched:
        assert want["r2"][2].value == "stop" and want["r2"][1].endswith(" 7") is False  # the stop string ended it


def test_abort_while_a_step_is_pending(make_scheduler, loaded):
    tok = loaded.tokenizer
    greedy = SamplingParams(max_tokens=20, temperature=0.0)
    alone = _run(make_scheduler(async_scheduling=False), tok, 1)["r0"][0]
    sched = make_scheduler(async_scheduling=True)
    sched.add_request(Request("keep", tok.encode(PROMPTS[0]), PARAMS[0]))
    sched.add_request(Request("drop", tok.encode("Tell me a story"), greedy))
    got, finals = [], {}
    for i in range(200):
        if not sched.has_unfinished():
            break
        if i == 4:
            assert sched._pending is not None  # the abort lands while a step is in flight
            assert sched.abort("drop")
        for out in sched.step():
            if out.request_id == "keep":
                got += out.token_ids
            if out.finished:
                finals[out.request_id] = out.finish_reason.value
    assert got == alone and finals == {"keep": "length", "drop": "abort"}
    assert sched.kv.usage().used_blocks == 0


def test_preempt_while_a_step_is_pending(make_scheduler, loaded):
    tok = loaded.tokenizer
    alone = _run(make_scheduler(async_scheduling=False), tok, 1)["r0"][0]
    sched = make_scheduler(async_scheduling=True)
    sched.add_request(Request("r0", tok.encode(PROMPTS[0]), PARAMS[0]))
    got = []
    for i in range(200):
        if not sched.has_unfinished():
            break
        if i == 5:
            assert sched._pending is not None and sched.preempt("r0")  # its pending draw is kept
        got += [t for out in sched.step() for t in out.token_ids]
    assert got == alone


def test_a_failed_launch_leaves_nothing_behind(make_scheduler, loaded, monkeypatch):
    sched = make_scheduler(async_scheduling=True)
    real, calls = sched.engine.launch, {"n": 0}

    def failing(*args, **kw):
        calls["n"] += 1
        if calls["n"] == 3:  # an overlapped launch
            raise RuntimeError("simulated device failure")
        return real(*args, **kw)

    monkeypatch.setattr(sched.engine, "launch", failing)
    sched.add_request(Request("r0", loaded.tokenizer.encode("Hello"), SamplingParams(max_tokens=30, temperature=0.0)))
    finals = []
    with pytest.raises(RuntimeError, match="simulated"):
        for _ in range(100):
            finals += [o.finish_reason for o in sched.step() if o.finished]
    while sched.has_unfinished():
        finals += [o.finish_reason.value for o in sched.step() if o.finished]
    assert finals == ["abort"] and sched.kv.usage().used_blocks == 0 and not sched.running


def test_a_failed_resolve_leaves_nothing_behind(make_scheduler, loaded, monkeypatch):
    """A device error surfacing when a pending step is read back (or in its finish step) ends
    the step's sequences with abort and keeps outputs already due (an abort final here)."""
    sched = make_scheduler(async_scheduling=True)
    real, calls = sched.engine.resolve, {"n": 0}

    def failing(pending):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("simulated device failure")
        return real(pending)

    monkeypatch.setattr(sched.engine, "resolve", failing)
    tok = loaded.tokenizer
    for rid in ("a", "b"):
        sched.add_request(Request(rid, tok.encode("Hello"), SamplingParams(max_tokens=30, temperature=0.0)))
    finals = {}
    with pytest.raises(RuntimeError, match="simulated"):
        for i in range(100):
            if i == 3:
                sched.add_request(Request("z", tok.encode("Hi"), SamplingParams(max_tokens=0)))  # final due now
            finals.update({o.request_id: o.finish_reason.value for o in sched.step() if o.finished})
    for _ in range(10):
        if not sched.has_unfinished():
            break
        finals.update({o.request_id: o.finish_reason.value for o in sched.step() if o.finished})
    assert finals == {"a": "abort", "b": "abort", "z": "length"}
    assert not sched.has_unfinished() and sched.kv.usage().used_blocks == 0
