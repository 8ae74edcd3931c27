"""DenseKv: append, growth, trim, free, isolation between sequences, chunking invariance."""

from __future__ import annotations

import pytest
import torch

from monobatch.batch import StepBatch
from monobatch.kv.attention import attend_chunk
from monobatch.kv.dense import DenseKv

L, K, HD, H = 2, 2, 8, 4


def kv_store(max_len=64, growth=16) -> DenseKv:
    return DenseKv(L, K, HD, max_len, torch.float32, torch.device("cpu"), growth=growth)


def step(kv, chunks, seed=0):
    """Write random q/k/v for ``chunks`` through every layer; returns (q, k, v, outs)."""
    batch = StepBatch.build(chunks)
    g = torch.Generator().manual_seed(seed)
    T = batch.num_tokens
    q, k, v = (torch.randn(T, n, HD, generator=g) for n in (H, K, K))
    kv.prepare(batch)
    outs = [kv.attend(layer, q, k, v, batch) for layer in range(L)]
    kv.commit(batch)
    return q, k, v, outs


def reference_attention(q, k, v):
    """Plain causal attention over a whole sequence: q [T, H, hd], k/v [T, K, hd]."""
    g = H // K
    k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    scores = torch.einsum("thd,shd->hts", q, k) / HD**0.5
    mask = torch.ones(q.shape[0], k.shape[0], dtype=torch.bool).tril()
    probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", probs, v)


def test_chunked_equals_whole_and_reference():
    kv = kv_store()
    q, k, v, outs = step(kv, [(0, list(range(20)), 0, True)])
    torch.testing.assert_close(outs[0], reference_attention(q, k, v))
    # The same tokens as 3 chunks of another sequence give the same outputs.
    kv2 = kv_store()
    got = []
    for s, e in ((0, 7), (7, 8), (8, 20)):
        batch = StepBatch.build([(1, list(range(s, e)), s, True)])
        kv2.prepare(batch)
        got.append(kv2.attend(0, q[s:e], k[s:e], v[s:e], batch))
        kv2.commit(batch)
    torch.testing.assert_close(torch.cat(got), outs[0])
    assert kv2.seq_len(1) == 20


def test_sequences_are_isolated_in_one_batch():
    kv = kv_store()
    q, k, v, outs = step(kv, [(0, [1] * 5, 0, True), (1, [2] * 9, 0, True)])
    torch.testing.assert_close(outs[0][:5], reference_attention(q[:5], k[:5], v[:5]))
    torch.testing.assert_close(outs[0][5:], reference_attention(q[5:], k[5:], v[5:]))


def test_growth_trim_free():
    kv = kv_store(max_len=40, growth=16)
    step(kv, [(0, list(range(10)), 0, True)])
    assert kv.seq_len(0) == 10 and kv.capacity(0) == 16
    step(kv, [(0, list(range(10)), 10, True)])
    assert kv.seq_len(0) == 20 and kv.capacity(0) == 32
    step(kv, [(0, list(range(15)), 20, True)])
    assert kv.capacity(0) == 40  # capped at the context
    kv.trim(0, 12)
    assert kv.seq_len(0) == 12
    step(kv, [(0, [5], 12, True)])  # rewind then continue
    assert kv.seq_len(0) == 13
    kv.free(0)
    assert kv.seq_len(0) == 0 and kv.num_sequences() == 0 and kv.used_bytes() == 0


def test_describe_says_how_buffers_grow():
    """The start-up line: a growth step below the context grows; one at or above it does not."""
    assert "grown by 16 tokens up to 40" in kv_store(max_len=40, growth=16).describe()
    assert "one buffer per sequence of 16 tokens (" in kv_store(max_len=16, growth=256).describe()


def test_prepare_refuses_gaps_and_overflow():
    kv = kv_store(max_len=16)
    step(kv, [(0, [1, 2, 3], 0, True)])
    with pytest.raises(ValueError, match="cached"):
        kv.prepare(StepBatch.build([(0, [4], 5, True)]))
    with pytest.raises(ValueError, match="exceed the context"):
        kv.prepare(StepBatch.build([(0, list(range(14)), 3, True)]))


def test_attend_chunk_gqa_decode_matches_reference():
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(6, H, HD, generator=g), torch.randn(6, K, HD, generator=g), torch.randn(6, K, HD, generator=g)
    ref = reference_attention(q, k, v)
    out = attend_chunk(q[5:], k, v, pos=5)
    torch.testing.assert_close(out, ref[5:])


def test_step_batch_layout():
    b = StepBatch.build([(7, [10, 11, 12], 0, True), (8, [20], 5, True), (9, [30, 31], 40, False)])
    assert b.token_ids.tolist() == [10, 11, 12, 20, 30, 31]
    assert b.positions.tolist() == [0, 1, 2, 5, 40, 41]
    assert b.seq_ids.tolist() == [7, 7, 7, 8, 9, 9]
    assert b.logit_rows.tolist() == [2, 3]
    assert not b.is_decode_only
    with pytest.raises(ValueError):
        StepBatch.build([(1, [1], 0, True), (1, [2], 1, True)])
    with pytest.raises(ValueError):
        StepBatch.build([(1, [], 0, True)])


def test_kv_out_of_memory_is_a_clear_error():
    """A KV buffer the allocator cannot provide raises InsufficientMemoryError, not a torch error."""
    from monobatch.errors import InsufficientMemoryError

    kv = DenseKv(L, 2**20, 2**10, 2**20, torch.float32, torch.device("cpu"), growth=2**20)  # 16 PiB
    with pytest.raises(InsufficientMemoryError, match="KV cache"):
        kv.prepare(StepBatch.build([(0, [1], 0, True)]))
