"""Continuous batching on paged KV: paged equals dense, --deterministic makes batch, chunking,
storage and arrival order bit-transparent (C1, invariants 1-4), prefix-cache hits equal cold runs,
preemption by block budget completes every request unchanged. Real bundled model, CPU."""

from __future__ import annotations

import logging

import pytest
import torch

from helpers import PACKED_LOGIT_TOL, first_divergence, near_tie, new_scheduler, run_requests
from monobatch.batch import StepBatch
from monobatch.engine.engine import Engine, EngineConfig
from monobatch.engine.params import SamplingParams
from monobatch.engine.sequence import Request
from monobatch.errors import InsufficientMemoryError
from test_seeded import CONFIGS, add, drive, neighbour_requests, seeded

log = logging.getLogger(__name__)
pytestmark = pytest.mark.usefixtures("one_cpu_thread")

TEXTS = ["The quick brown fox", "In 1969, the first humans", "import numpy as np\n", "Roses are red,",
         "The three primary colours are", "def fibonacci(n):", "Once upon a time", "The capital of France is"]
GREEDY = SamplingParams(max_tokens=20, temperature=0.0)


@pytest.fixture(scope="module")
def prompts(loaded):
    return [loaded.tokenizer.encode(t) for t in TEXTS]


def test_paged_equals_dense_greedy_at_b1(loaded, prompts):
    """Invariant 1 (storage): default mode, B=1, five prompts: identical greedy ids."""
    for p in prompts[:5]:
        dense = run_requests(new_scheduler(loaded, kv_storage="dense"), [p], GREEDY)[0]
        paged = run_requests(new_scheduler(loaded, kv_storage="paged"), [p], GREEDY)[0]
        assert len(dense) == GREEDY.max_tokens or dense[-1] in loaded.tokenizer.eog_ids
        assert dense == paged


@pytest.fixture(scope="module")
def det_alone(loaded, prompts):
    """Each prompt alone, deterministic mode, dense storage: the reference."""
    return [run_requests(new_scheduler(loaded, kv_storage="dense", deterministic=True), [p], GREEDY)[0] for p in prompts]


@pytest.mark.parametrize("storage", ["dense", "paged"])
@pytest.mark.parametrize("arrival", ["alone", "batch", "staggered"])
def test_c1_deterministic_any_arrival_any_storage(loaded, prompts, det_alone, storage, arrival):
    """C1 under --deterministic: 8 prompts one at a time, as one batch (chunked prefill, chunk 5),
    and with staggered arrivals give identical ids, dense and paged -- bit for bit, no near-tie
    allowance."""
    reqs = [Request(f"g{i}", p, GREEDY) for i, p in enumerate(prompts)]
    if arrival == "alone":
        if storage == "dense":
            pytest.skip("the reference itself")
        got = {f"g{i}": run_requests(new_scheduler(loaded, kv_storage=storage, deterministic=True), [p], GREEDY)[0]
               for i, p in enumerate(prompts)}
    elif arrival == "batch":
        got = drive(new_scheduler(loaded, kv_storage=storage, deterministic=True, prefill_chunk=5), reqs)
    else:
        got = drive(new_scheduler(loaded, kv_storage=storage, deterministic=True), reqs[:2],
                    at_step={2 * i: [add(r)] for i, r in enumerate(reqs[2:], start=1)})
    for i in range(len(prompts)):
        assert got[f"g{i}"] == det_alone[i], f"prompt {i}: first divergence {first_divergence(det_alone[i], got[f'g{i}'])}"


def all_position_logits(engine: Engine, chunks_per_step: list[list[tuple[int, list[int], int]]]) -> dict[int, torch.Tensor]:
    """Run planned steps straight through the engine's forward, every position asking for logits."""
    out: dict[int, list[torch.Tensor]] = {}
    for chunks in chunks_per_step:
        batch = StepBatch.build([(s, ids, pos, True) for s, ids, pos in chunks], engine.device, engine.row_tile)
        batch.logit_rows = torch.arange(batch.num_tokens)
        logits = engine.forward(batch)
        for c in batch.chunks:
            out.setdefault(c.seq_id, []).append(logits[c.start:c.start + c.length])
    return {s: torch.cat(parts) for s, parts in out.items()}


@pytest.mark.parametrize("storage", ["dense", "paged"])
def test_deterministic_logits_are_bit_identical(loaded, dequantized, prompts, storage):
    """On a fixed corpus, every position's logits are bit-identical whether a prompt runs alone in
    one chunk, beside the others in one batch, or in chunks of 3 interleaved with the others.
    The fast mode computes the same function: within float32 rounding on dequantized weights (the
    path), within helpers.PACKED_LOGIT_TOL on the packed ones (their int16-activation GEMV)."""
    corpus = prompts[:4]
    engine = Engine(loaded, EngineConfig(kv_storage=storage, deterministic=True))
    alone = {i: engine.prompt_logits(p, all_positions=True) for i, p in enumerate(corpus)}
    together = all_position_logits(engine, [[(10 + i, p, 0) for i, p in enumerate(corpus)]])
    steps = []
    for start in range(0, max(map(len, corpus)), 3):
        steps.append([(20 + i, p[start:start + 3], start) for i, p in enumerate(corpus) if start < len(p)])
    chunked = all_position_logits(engine, steps)
    for i in range(len(corpus)):
        assert torch.equal(together[10 + i], alone[i])
        assert torch.equal(chunked[20 + i], alone[i])
    fast = Engine(loaded, EngineConfig(kv_storage=storage))  # the default mode makes no such promise...
    fast_alone = fast.prompt_logits(corpus[0], all_positions=True)
    assert torch.allclose(fast_alone, alone[0], atol=PACKED_LOGIT_TOL)  # ...but computes the same function
    det_d, fast_d = (Engine(dequantized, EngineConfig(kv_storage=storage, deterministic=d)) for d in (True, False))
    assert torch.allclose(fast_d.prompt_logits(corpus[0], all_positions=True),
                          det_d.prompt_logits(corpus[0], all_positions=True), atol=1e-3)


@pytest.mark.parametrize("config", list(CONFIGS))
def test_deterministic_seeded_unchanged_by_any_neighbour(loaded, config):
    """Under --deterministic a seeded request's output is unchanged by neighbours that are
    unseeded, differently seeded, penalised, biased or arriving mid-decode (paged storage)."""
    prompt = loaded.tokenizer.encode("Once upon a time, in a small village")
    solo = drive(new_scheduler(loaded, deterministic=True), [Request("s", prompt, seeded(config))])["s"]
    first, *rest = neighbour_requests(loaded, config)
    later = rest.pop()
    got = drive(new_scheduler(loaded, deterministic=True), [first, rest[0]], at_step={
        2: [add(Request("s", prompt, seeded(config))), *map(add, rest[1:])],
        6: [add(later)],
    })
    assert got["s"] == solo


# -- prefix cache -------------------------------------------------------------------------------

SYSTEM = ("You are a careful assistant. Answer briefly and precisely, name your sources when you can, "
          "and say so when you do not know the answer to a question. Keep every reply under fifty words, "
          "use plain language, and never invent facts, numbers or quotations.")


def chat_prompts(loaded) -> tuple[list[int], list[int]]:
    tok = loaded.tokenizer
    a = tok.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a colour."}])
    b = tok.encode_chat([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Name a fruit."}])
    return a, b


@pytest.mark.parametrize("deterministic", [True, False])
def test_prefix_cache_hit_equals_cold_run(loaded, deterministic):
    """A second request sharing a >= 3-block prefix adopts it (counted as hits) and gives the ids
    of a cold run -- identical under --deterministic; in the default mode a divergence is logged
    with its index and top-2 margin and must be a near-tie."""
    a, b = chat_prompts(loaded)
    shared = first_divergence(a, b)
    assert shared >= 3 * 16  # precondition: at least three whole blocks in common
    params = SamplingParams(max_tokens=16, temperature=0.0)
    cold = run_requests(new_scheduler(loaded, deterministic=deterministic), [b], params)[0]
    sched = new_scheduler(loaded, deterministic=deterministic)
    run_requests(sched, [a], params)
    outs = list(sched.run([Request("b", b, params)]))
    warm = [t for o in outs for t in o.token_ids]
    hits = sched.stats().prefix_cache_hits
    assert hits == shared // 16 * 16 and outs[-1].num_cached_tokens == hits
    assert sched.stats().prefix_cache_queries == len(a) + len(b)
    if deterministic:
        assert warm == cold
    else:
        i = first_divergence(cold, warm)
        if i is not None:
            margin = Engine(loaded).top2_margin(b + cold[:i])
            log.warning("prefix-cache hit diverged at %d (cold %d, warm %d), top-2 margin %.2e", i, cold[i], warm[i], margin)
            assert margin < near_tie(loaded)
        else:
            log.info("prefix-cache hit: identical to the cold run (%d tokens)", len(cold))


def test_whole_prompt_cached_still_recomputes_the_last_token(loaded):
    """A prompt whose every block is cached adopts all but the last block (the last token's logits
    are needed), and a bypassing request adopts nothing."""
    a, _ = chat_prompts(loaded)
    prompt = a[:64]  # exactly four blocks
    params = SamplingParams(max_tokens=4, temperature=0.0)
    sched = new_scheduler(loaded)
    first = run_requests(sched, [prompt], params)[0]
    outs = list(sched.run([Request("again", prompt, params)]))
    assert outs[-1].num_cached_tokens == 48 and [t for o in outs for t in o.token_ids] == first
    outs = list(sched.run([Request("bypass", prompt, params, bypass_prefix_cache=True)]))
    assert outs[-1].num_cached_tokens == 0


# -- preemption -----------------------------------------------------------------------------------

def test_preemption_completes_every_request_unchanged(loaded, prompts):
    """A pool of 6 blocks (96 tokens, one context) for 4 requests needing 3 blocks each: the
    scheduler preempts (recompute) and still completes every request, greedy and seeded, with the
    output each gives alone (deterministic mode, so equality is exact)."""
    tokens = 6 * 16
    memory = tokens * Engine(loaded, EngineConfig(kv_storage="dense")).kv.bytes_per_token
    params = [SamplingParams(max_tokens=36, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=36, temperature=0.8, top_k=40, seed=7, ignore_eos=True)] * 2
    reqs = [Request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts[:4], params))]
    cfg = dict(deterministic=True, max_model_len=96, kv_cache_memory=memory)
    alone = {r.request_id: drive(new_scheduler(loaded, **cfg), [r])[r.request_id] for r in reqs}
    reqs = [Request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts[:4], params))]
    sched = new_scheduler(loaded, **cfg)
    got = drive(sched, reqs)
    assert sched.stats().num_preemptions > 0  # precondition: the pool really was too small
    assert got == alone
    assert sched.kv.usage().used_blocks == 0


def test_pool_smaller_than_one_context_is_refused(loaded):
    per_token = Engine(loaded, EngineConfig(kv_storage="dense")).kv.bytes_per_token
    with pytest.raises(InsufficientMemoryError, match="fewer than one context"):
        Engine(loaded, EngineConfig(max_model_len=256, kv_cache_memory=255 * per_token))
    Engine(loaded, EngineConfig(max_model_len=256, kv_cache_memory=256 * per_token))  # exactly one fits
    with pytest.raises(InsufficientMemoryError, match=r"memory \(1,024 bytes\) holds 0 tokens"):  # not "0.0 MiB"
        Engine(loaded, EngineConfig(max_model_len=256, kv_cache_memory=1024))


def test_admission_waits_for_blocks_and_abort_frees_them(loaded):
    """A's 60-token prompt fills the 4-block pool with its first chunk, so B waits (FIFO, no
    preemption) instead of being admitted; aborting A frees every block at once and B runs."""
    per_token = Engine(loaded, EngineConfig(kv_storage="dense")).kv.bytes_per_token
    sched = new_scheduler(loaded, max_model_len=64, kv_cache_memory=64 * per_token)
    tok = loaded.tokenizer
    long_prompt = (tok.encode("one two three four five six seven eight nine ten " * 6))[:60]
    assert len(long_prompt) == 60  # precondition
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    sched.add_request(Request("a", long_prompt, params))
    sched.add_request(Request("b", tok.encode("Roses are red,"), params))
    sched.step()
    s = sched.stats()
    assert (s.num_running, s.num_waiting, s.num_preemptions) == (1, 1, 0)
    assert s.kv_used_blocks == s.kv_total_blocks == 4
    assert sched.abort("a")
    assert sched.kv.usage().used_blocks == 0  # freed now, not at the next step
    outs = []
    while sched.has_unfinished():
        outs += sched.step()
    assert {o.request_id: o.finish_reason.value for o in outs if o.finished} == {"a": "abort", "b": "length"}
    assert sched.kv.usage().used_blocks == 0 and sched.stats().num_preemptions == 0


def test_deterministic_row_result_does_not_depend_on_its_place_in_a_tile(loaded):
    """The guarantee rests on the GEMM kernel treating every row of a fixed-shape tile alike:
    a prompt's logits are bit-identical with 0..8 one-token neighbours ahead of it in the batch
    (its rows land at every offset of an 8-row tile)."""
    engine = Engine(loaded, EngineConfig(kv_storage="paged", deterministic=True))
    target = loaded.tokenizer.encode("The capital of France is")
    ref = engine.prompt_logits(target, all_positions=True)
    for k in range(9):
        steps = [[(100 * (k + 1) + j, [j + 5], 0) for j in range(k)] + [(100 * (k + 1) + 99, target, 0)]]
        got = all_position_logits(engine, steps)[100 * (k + 1) + 99]
        assert torch.equal(got, ref), f"{k} neighbours"
        for j in range(k):
            engine.kv.free(100 * (k + 1) + j)
        engine.kv.free(100 * (k + 1) + 99)


def test_step_batch_build_lays_out_decode_rows_and_chunks():
    """StepBatch.build's flat layout for a mix of decode rows (one token: the fast path) and
    chunks (last-token logits, every-token logits, no logits), ids given as lists or tuples."""
    from monobatch.batch import StepBatch

    b = StepBatch.build([(7, [5], 10, True), (3, (1, 2, 3), 0, True), (4, [9], 2, False),
                         (5, [6, 7], 4, True, True), (6, (8,), 0, True, True)])
    assert b.token_ids.tolist() == [5, 1, 2, 3, 9, 6, 7, 8]
    assert b.positions.tolist() == [10, 0, 1, 2, 2, 4, 5, 0]
    assert b.seq_ids.tolist() == [7, 3, 3, 3, 4, 5, 5, 6]
    assert b.logit_rows.tolist() == [0, 3, 5, 6, 7]
    assert [(c.seq_id, c.start, c.pos, c.length, c.token_ids, c.all_logits) for c in b.chunks] == [
        (7, 0, 10, 1, (5,), False), (3, 1, 0, 3, (1, 2, 3), False), (4, 4, 2, 1, (9,), False),
        (5, 5, 4, 2, (6, 7), True), (6, 7, 0, 1, (8,), True)]
    assert b.position_bound == 11
    for bad in ([(1, [], 0, True)], [(1, [2], -1, True)], [(1, [2], 0, True), (1, [3], 1, True)]):
        with pytest.raises(ValueError):
            StepBatch.build(bad)
