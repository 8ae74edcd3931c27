"""KV accounting under random traffic (hypothesis): arrivals, aborts, stops, length limits and
preemption on a pool far too small. After every action the block references add up; afterwards
no block is referenced, free + evictable blocks equal the pool, every request ended exactly once
(none lost), and each request's tokens are the ones it generates alone (none mixed: the engine
runs in deterministic mode, so equality is exact; an aborted request's tokens are a prefix).
Both loops run it: synchronous, and async scheduling (steps launched before the last one's draws
are read back)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings, target
from hypothesis import strategies as st

from monobatch.engine.engine import Engine, EngineConfig
from monobatch.engine.params import SamplingParams
from monobatch.engine.scheduler import BatchScheduler
from monobatch.engine.sequence import Request
from monobatch.loader.dummy import dummy_model

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

BLOCK = 16
CONTEXT = 64


@pytest.fixture(scope="module")
def tiny():
    return dummy_model("tiny", device="cpu", dtype="float32")


request = st.fixed_dictionaries({
    "prompt": st.lists(st.integers(1, 511), min_size=1, max_size=40),
    "max_tokens": st.integers(1, 60),
    "stop_token": st.one_of(st.none(), st.integers(1, 511)),
    "seed": st.one_of(st.none(), st.integers(0, 2**31)),
    "temperature": st.sampled_from([0.0, 0.8]),
})
#: Mostly arrivals, so the pool runs out and the scheduler must preempt.
action = st.one_of(
    st.tuples(st.just("add"), st.lists(request, min_size=1, max_size=4)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("step"), st.integers(1, 4)),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(actions=st.lists(action, min_size=1, max_size=30),
       pool_blocks=st.integers(CONTEXT // BLOCK, 2 * CONTEXT // BLOCK),
       storage=st.sampled_from(["paged", "dense"]),
       max_num_seqs=st.integers(1, 6), async_scheduling=st.booleans(), example_must_preempt=st.just(False))
@example(actions=[("add", [{"prompt": [7] * 30, "max_tokens": 30, "stop_token": None, "seed": 3, "temperature": 0.8}] * 4),
                  ("step", 4), ("abort", 1), ("add", [{"prompt": [9] * 5, "max_tokens": 50, "stop_token": None,
                                                        "seed": None, "temperature": 0.0}] * 3)],
         pool_blocks=4, storage="paged", max_num_seqs=6, async_scheduling=True, example_must_preempt=True)
def test_random_traffic_leaves_no_block_referenced(tiny, actions, pool_blocks, storage, max_num_seqs,
                                                   async_scheduling, example_must_preempt):
    per_token = 2 * 2 * 2 * 16 * 4  # layers * (K, V) * kv heads * head dim * float32
    config = EngineConfig(max_model_len=CONTEXT, max_num_seqs=max_num_seqs, prefill_chunk=24, kv_storage=storage,
                          kv_cache_memory=pool_blocks * BLOCK * per_token if storage == "paged" else None,
                          deterministic=True, async_scheduling=async_scheduling)
    sched = BatchScheduler(Engine(tiny, config))
    requests: dict[str, Request] = {}
    added: list[str] = []
    finals: dict[str, int] = {}

    produced: dict[str, list[int]] = {}
    aborted: set[str] = set()

    def collect(outputs):
        for o in outputs:
            assert o.request_id in added  # nothing appears that was not sent
            produced.setdefault(o.request_id, []).extend(o.token_ids)
            if o.finished:
                finals[o.request_id] = finals.get(o.request_id, 0) + 1
                if o.finish_reason.value == "abort":
                    aborted.add(o.request_id)

    def check_references():
        u = sched.kv.usage()
        assert len(sched.running) <= max_num_seqs
        if storage == "paged":
            pool, kv = sched.kv.pool, sched.kv
            assert u.used_blocks <= u.total_blocks
            assert sum(pool.ref) == sum(len(kv.block_table(s.seq_id)) for s in sched.running)
            assert pool.num_available + pool.num_referenced == pool.num_blocks

    for kind, arg in actions:
        if kind == "add":
            for r in arg:
                rid = f"r{len(added)}"
                params = SamplingParams(max_tokens=r["max_tokens"], temperature=r["temperature"], seed=r["seed"],
                                        stop_token_ids=() if r["stop_token"] is None else (r["stop_token"],))
                added.append(rid)
                requests[rid] = Request(rid, r["prompt"], params)
                sched.add_request(requests[rid])
        elif kind == "abort" and added:
            sched.abort(added[arg % len(added)])
        else:
            for _ in range(arg):
                collect(sched.step())
        check_references()
    steps = 0
    while sched.has_unfinished():
        collect(sched.step())
        check_references()
        steps += 1
        assert steps < 5000, "the loop does not terminate"
    target(float(sched.stats().num_preemptions))  # steer the search towards preemption
    if example_must_preempt:
        assert sched.stats().num_preemptions > 0
    assert finals == {rid: 1 for rid in added}  # every request ended exactly once
    assert not sched.running and not sched.waiting
    u = sched.kv.usage()
    assert u.used_blocks == 0 and u.used_bytes == 0 and sched.kv.num_sequences() == 0
    if storage == "paged":
        pool = sched.kv.pool
        assert pool.num_available == pool.num_blocks  # free + evictable = the pool
        assert all(r == 0 for r in pool.ref)
    for rid, req in requests.items():  # none mixed: each got its own tokens
        if req.params.seed is None and req.params.temperature > 0:
            continue  # a fresh random seed: nothing to compare with
        alone = solo(tiny, req)
        got = produced.get(rid, [])
        assert got == alone or (rid in aborted and got == alone[:len(got)]), rid


_solo_cache: dict = {}


def solo(tiny, req: Request) -> list[int]:
    """The request's tokens when it runs alone (deterministic mode, dense storage)."""
    key = (tuple(req.prompt_ids), repr(req.params))
    if key not in _solo_cache:
        sched = BatchScheduler(Engine(tiny, EngineConfig(max_model_len=CONTEXT, deterministic=True, kv_storage="dense")))
        _solo_cache[key] = [t for o in sched.run([Request("solo", req.prompt_ids, req.params)]) for t in o.token_ids]
    return _solo_cache[key]
