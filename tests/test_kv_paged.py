"""PagedKv and BlockPool: attention equal to dense storage, the prefix cache (chained keys, ids
checked, LRU eviction of unreferenced blocks), fork with copy-on-write, trim, reserve, free."""

from __future__ import annotations

import pytest
import torch

from monobatch.batch import StepBatch
from monobatch.errors import InsufficientMemoryError
from monobatch.kv import block_pool
from monobatch.kv.block_pool import BlockPool
from monobatch.kv.dense import DenseKv
from monobatch.kv.paged import PagedKv

L, K, HD, H, BS = 2, 2, 8, 4, 4
SHAPE = (L, K, HD, 64, torch.float32, torch.device("cpu"))


def paged(num_blocks=32) -> PagedKv:
    return PagedKv(*SHAPE, num_blocks=num_blocks, block_size=BS)


def step(kv, chunks, seed=0):
    """Write deterministic q/k/v for ``chunks`` (k/v derived from token ids and positions, so two
    sequences with the same prefix get the same KV) through every layer; returns the outputs."""
    batch = StepBatch.build(chunks)
    T = batch.num_tokens
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(T, H, HD, generator=g)
    base = (batch.token_ids * 7 + batch.positions).float()[:, None, None]
    k = torch.sin(base + torch.arange(K * HD).view(1, K, HD))
    v = torch.cos(base * 0.3 + torch.arange(K * HD).view(1, K, HD))
    kv.prepare(batch)
    outs = [kv.attend(layer, q, k, v, batch) for layer in range(L)]
    kv.commit(batch)
    return outs


def keys_of(kv: PagedKv, seq: int, layer: int = 0) -> torch.Tensor:
    slots = [b * BS + i for b in kv.block_table(seq) for i in range(BS)][:kv.seq_len(seq)]
    return kv.cache[layer, 0, slots]


def test_paged_attention_equals_dense_bitwise():
    """Same chunks (mixed prefill + decode of two sequences) through dense and paged storage give
    bit-identical outputs: both hand attend_chunk token-major keys with the same strides."""
    plan = [[(0, list(range(9)), 0, True), (1, [5, 6, 7], 0, True)],
            [(0, [1], 9, True), (1, list(range(11)), 3, True)],
            [(0, [2], 10, True), (1, [3], 14, True)]]
    dense, pg = DenseKv(*SHAPE, growth=8), paged()
    for i, chunks in enumerate(plan):
        for a, b in zip(step(dense, chunks, seed=i), step(pg, chunks, seed=i)):
            assert torch.equal(a, b)
    assert pg.seq_len(0) == 11 and pg.seq_len(1) == 15
    assert len(pg.block_table(1)) == 4  # ceil(15 / 4)


def test_prefix_hit_adopts_whole_blocks_with_the_same_kv():
    kv = paged()
    prompt = list(range(100, 114))  # 14 tokens: 3 full blocks + 2
    step(kv, [(0, prompt, 0, True)])
    kv.free(0)  # blocks become evictable but keep their keys
    assert kv.usage().used_blocks == 0 and kv.usage().cached_blocks == 3
    n = kv.adopt_prefix(1, prompt[:13] + [999])
    assert n == 12  # three whole blocks; the partial 4th is never adopted
    assert kv.seq_len(1) == 12 and kv.usage().used_blocks == 3
    step(kv, [(1, prompt[12:], 12, True)])
    cold = paged()
    step(cold, [(0, prompt, 0, True)])
    assert torch.equal(keys_of(kv, 1), keys_of(cold, 0))


def test_a_different_prefix_misses_even_with_the_same_block():
    """Keys are chained: block 2 of another prefix with identical ids is not a hit."""
    kv = paged()
    step(kv, [(0, [1, 2, 3, 4, 9, 9, 9, 9, 0], 0, True)])
    assert kv.adopt_prefix(1, [7, 7, 7, 7, 9, 9, 9, 9, 0]) == 0


def test_keys_are_cryptographic_digests_of_the_whole_prefix():
    a = block_pool.block_hash(block_pool.ROOT_HASH, [1, 2, 3, 4])
    assert len(a) == 16 and a != block_pool.block_hash(block_pool.ROOT_HASH, [1, 2, 3, 5])
    assert block_pool.block_hash(a, [9, 9, 9, 9]) != block_pool.block_hash(block_pool.ROOT_HASH, [9, 9, 9, 9])


def test_hash_collisions_are_caught_by_the_id_check(monkeypatch):
    monkeypatch.setattr(block_pool, "block_hash", lambda parent, ids: 42)
    import monobatch.kv.block_manager as manager_mod
    monkeypatch.setattr(manager_mod, "block_hash", lambda parent, ids: 42)
    kv = paged()
    step(kv, [(0, [1, 2, 3, 4, 0], 0, True)])
    assert kv.adopt_prefix(1, [5, 6, 7, 8, 0]) == 0  # same key, other ids: a miss
    assert kv.adopt_prefix(2, [1, 2, 3, 4, 0]) == 4


def test_lru_evicts_least_recently_released_and_tails_first():
    pool = BlockPool(4)
    a = [pool.allocate() for _ in range(2)]
    for i, b in enumerate(a):
        pool.register(b, key=100 + i, parent=99 + i, token_ids=[i])
    b = [pool.allocate() for _ in range(2)]
    for i, blk in enumerate(b):
        pool.register(blk, key=200 + i, parent=199 + i, token_ids=[i])
    for blk in reversed(a):  # free() releases tail first
        pool.release(blk)
    for blk in reversed(b):
        pool.release(blk)
    assert pool.num_available == 4 and pool.num_evictable == 4
    assert pool.allocate() == a[1]  # a's tail: released first
    assert pool.lookup(101, 100, [1]) is None  # evicted
    assert pool.lookup(100, 99, [0]) == a[0]  # a's head still cached, now referenced again
    assert pool.num_evictable == 2


def test_fork_shares_blocks_and_copies_on_write():
    kv = paged()
    step(kv, [(0, list(range(6)), 0, True)])  # blocks: full + partial (2 tokens)
    before = keys_of(kv, 0).clone()
    kv.fork(0, 1)
    assert kv.block_table(1) == kv.block_table(0)
    assert all(kv.pool.ref[b] == 2 for b in kv.block_table(0))
    step(kv, [(1, [50, 51], 6, True)])  # writes into the shared partial block: copied first
    assert kv.block_table(1)[0] == kv.block_table(0)[0]  # the full block is still shared
    assert kv.block_table(1)[1] != kv.block_table(0)[1]
    assert torch.equal(keys_of(kv, 0), before)  # the source is untouched
    assert kv.seq_len(1) == 8
    with pytest.raises(ValueError):
        kv.fork(0, 1)


def test_a_reserve_before_a_fork_does_not_skip_the_source_s_copy_on_write():
    """reserve remembers how far a sequence can grow with nothing to allocate or copy; a fork
    shares the source's partial block, so the source's next write still copies it first."""
    kv = paged()
    step(kv, [(0, list(range(6)), 0, True)])  # blocks: full + partial (2 tokens)
    assert kv.reserve(0, 8)  # the partial block is the source's alone: nothing to do
    kv.fork(0, 1)
    forked = keys_of(kv, 1).clone()
    step(kv, [(0, [50, 51], 6, True)])  # the source writes into the shared partial block
    assert kv.block_table(0)[1] != kv.block_table(1)[1]
    assert torch.equal(keys_of(kv, 1), forked)  # the fork is untouched


def test_fork_never_shares_reserved_unwritten_blocks():
    """Blocks reserved past a sequence's tokens stay private: the fork and the source write their
    next tokens into different slots."""
    kv = paged()
    step(kv, [(0, [1, 2, 3, 4], 0, True)])  # exactly one full block
    assert kv.reserve(0, 8)  # a second block, reserved but unwritten
    kv.fork(0, 1)
    assert kv.block_table(1) == kv.block_table(0)[:1]
    step(kv, [(0, [5], 4, True), (1, [6], 4, True)])
    assert kv.block_table(0)[1] != kv.block_table(1)[1]
    assert not torch.equal(keys_of(kv, 0)[4], keys_of(kv, 1)[4])  # each kept its own token's key


def test_trim_releases_blocks_and_protects_cached_ones():
    kv = paged()
    prompt = list(range(10))
    step(kv, [(0, prompt, 0, True)])  # blocks 0, 1 full and keyed; block 2 partial
    cached = keys_of(kv, 0)[:8].clone()
    kv.trim(0, 6)
    assert kv.seq_len(0) == 6 and len(kv.block_table(0)) == 2
    step(kv, [(0, [77, 78, 79], 6, True)])  # overwrites positions 6.. of a cached block: copy-on-write
    assert kv.adopt_prefix(1, prompt) == 8
    assert torch.equal(keys_of(kv, 1), cached)  # the cache still holds the original prefix
    kv.trim(0, 100)  # past the end: no-op
    assert kv.seq_len(0) == 9


def test_reserve_says_no_without_allocating():
    kv = paged(num_blocks=4)
    assert kv.reserve(0, 12)
    assert kv.usage().used_blocks == 3
    assert not kv.reserve(1, 8)  # needs 2, one left
    assert kv.usage().used_blocks == 3 and kv.seq_len(1) == 0
    assert kv.reserve(1, 4)
    with pytest.raises(InsufficientMemoryError):
        step(kv, [(1, list(range(5)), 0, True)])  # a second block is not there


def test_prepare_refuses_gaps_and_overflow():
    kv = paged()
    with pytest.raises(ValueError):
        kv.prepare(StepBatch.build([(0, [1, 2], 3, True)]))
    with pytest.raises(ValueError):
        kv.prepare(StepBatch.build([(0, list(range(65)), 0, True)]))


def test_free_returns_every_block():
    kv = paged(num_blocks=8)
    step(kv, [(0, list(range(9)), 0, True), (1, list(range(20, 25)), 0, True)])
    kv.fork(0, 2)
    for s in (0, 1, 2, 7):  # 7: unknown, ignored
        kv.free(s)
    u = kv.usage()
    assert u.used_blocks == 0 and kv.num_sequences() == 0
    assert kv.pool.num_available == 8 and u.cached_blocks == 3  # 2 + 1 full blocks keyed
    assert all(r == 0 for r in kv.pool.ref)


def test_a_dropped_engine_frees_its_pool_without_the_garbage_collector():
    """No reference cycle holds the paged pool: once the last reference to an LLM goes, its KV
    memory goes at once (on CUDA a cycle kept a dropped pool's memory until the collector ran, so
    the next engine in the process sized its pool from what was left and failed to allocate it)."""
    import gc
    import weakref

    from monobatch import LLM
    from monobatch.engine.params import SamplingParams
    from monobatch.loader.dummy import dummy_model

    loaded = dummy_model("tiny")
    gc.disable()
    try:
        for storage in ("paged", "dense"):
            llm = LLM(loaded=loaded, kv_storage=storage)
            llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
            kv = weakref.ref(llm.scheduler.engine.kv)
            del llm
            assert kv() is None, storage
    finally:
        gc.enable()


def test_clear_cache_frees_evictable_blocks_and_keeps_held_ones():
    pool = BlockPool(4)
    held, dropped = pool.allocate(), pool.allocate()
    pool.register(held, key=b"h", parent=b"", token_ids=[1])
    pool.register(dropped, key=b"d", parent=b"", token_ids=[2])
    pool.release(dropped)
    assert pool.num_evictable == 1
    assert pool.clear_cache() == 1
    assert pool.num_evictable == 0 and pool.num_available == 3
    assert pool.find(b"d", b"", [2]) is None  # no longer served
    assert pool.find(b"h", b"", [1]) == held  # a block a sequence holds keeps its key
    assert pool.is_cached(held) and not pool.is_cached(dropped)
