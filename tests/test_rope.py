"""RoPE's position table (models/rope.py): the same cos/sin as the on-the-fly formula, element for
element, and a model that reads it gives the same logits bit for bit."""

from __future__ import annotations

import pytest
import torch

from monobatch.batch import StepBatch
from monobatch.kv.dense import DenseKv
from monobatch.models.rope import TABLE_CHUNK, RotaryEmbedding, rope_inv_freq


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("scaling", [None, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 512}])
def test_table_equals_formula(dtype, scaling):
    inv_freq, scale = rope_inv_freq(64, 10000.0, scaling, 2048)
    rope = RotaryEmbedding(inv_freq, scale)
    positions = torch.tensor([0, 1, 7, 500, 1999, 2047, 3])
    want = rope.cos_sin(positions, dtype)  # no table: the formula
    rope.build_table(2048, dtype)
    assert rope.table.shape == (2048, 2, 64) and rope.table.dtype == dtype
    got = rope.cos_sin(positions, dtype, bound=2048)
    assert got[0].stride(0) == 128  # views of one gather
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_table_only_within_bound():
    rope = RotaryEmbedding(rope_inv_freq(64, 10000.0, None, 2048)[0])
    rope.build_table(16, torch.float32)
    table = rope.table
    far = torch.tensor([3, 40])  # past the table: the formula, not a gather out of range
    for bound in (None, 41):
        cos, _ = rope.cos_sin(far, torch.float32, bound)
        assert cos.is_contiguous() and torch.equal(cos, RotaryEmbedding(rope.inv_freq).cos_sin(far, torch.float32)[0])
    assert rope.cos_sin(torch.tensor([3]), torch.bfloat16, 4)[0].is_contiguous()  # another dtype: formula
    last = torch.tensor([15])
    assert rope.cos_sin(last, torch.float32, 16)[0].stride(0) == 128  # bound == length: the table
    assert rope.cos_sin(last, torch.float32, 17)[0].is_contiguous()  # one past it: the formula
    rope.build_table(8, torch.float32)  # shorter: kept
    assert rope.table is table
    rope.build_table(32, torch.float32)  # longer: replaced, the old one left to its holders
    assert rope.table.shape[0] == 32 and torch.equal(rope.table[:16], table)


def test_model_logits_same_with_table(loaded):
    model = loaded.model
    args = model.args
    ids = list(range(3, 40))
    saved = model.rope.table

    def logits(table):
        model.rope.table = table
        kv = DenseKv(args.num_hidden_layers, args.num_key_value_heads, args.head_dim, 64, model.dtype, model.device)
        batch = StepBatch.build([(0, ids, 0, True, True)], model.device)
        kv.prepare(batch)
        return model(batch, kv)

    try:
        model.rope.table = None
        model.rope.build_table(64, model.dtype)
        with_table = logits(model.rope.table)
        assert torch.equal(with_table, logits(None))
    finally:
        model.rope.table = saved


def test_position_bound_is_exclusive():
    """StepBatch.build's bound is one past the last position (a table of exactly that many rows
    serves the batch); hand-built batches have none (the formula)."""
    batch = StepBatch.build([(0, list(range(5)), 12, True), (1, [7], 3, True)])
    assert batch.position_bound == 17 == int(batch.positions.max()) + 1
    assert StepBatch(batch.token_ids, batch.positions, batch.seq_ids, batch.logit_rows, batch.chunks).position_bound is None


@pytest.mark.parametrize("length", [8192, 1000, 2049])
def test_table_built_in_chunks_equals_one_pass(length):
    """build_table computes TABLE_CHUNK positions at a time (bounded temporaries, issue 17's RSS):
    the same bits as the formula over every position at once."""
    inv_freq, scale = rope_inv_freq(64, 10000.0, {"rope_type": "yarn", "factor": 4.0,
                                                  "original_max_position_embeddings": 512}, 8192)
    rope = RotaryEmbedding(inv_freq, scale)
    rope.build_table(length, torch.float32)
    cos, sin = rope._compute(torch.arange(length), torch.float32)
    assert torch.equal(rope.table, torch.stack((cos, sin), dim=1))


def test_growing_table_equals_built_table():
    """A growing table (build_table(..., grow=True), the engine's on CPU) starts with one chunk and
    extends a chunk at a time as cos_sin's bound reaches it, up to its limit: the same rows as a
    table built at once, and the formula past the limit."""
    length = TABLE_CHUNK * 2 + 100
    whole = RotaryEmbedding(rope_inv_freq(64, 10000.0, None, 4096)[0])
    whole.build_table(length, torch.float32)
    rope = RotaryEmbedding(rope_inv_freq(64, 10000.0, None, 4096)[0])
    rope.build_table(length, torch.float32, grow=True)
    assert rope.table.shape[0] == TABLE_CHUNK and rope.limit == length
    pos = torch.tensor([5, TABLE_CHUNK + 3])
    cos, sin = rope.cos_sin(pos, torch.float32, TABLE_CHUNK + 4)
    assert rope.table.shape[0] == 2 * TABLE_CHUNK
    assert torch.equal(cos, whole.table[pos, 0]) and torch.equal(sin, whole.table[pos, 1])
    rope.cos_sin(torch.tensor([length - 1]), torch.float32, length)
    assert torch.equal(rope.table, whole.table)  # grown to the limit, chunk by chunk
    far = torch.tensor([length + 7])  # past the limit: the formula
    assert torch.equal(rope.cos_sin(far, torch.float32, length + 8)[0], whole.cos_sin(far, torch.float32)[0])


def test_growing_table_over_an_older_table():
    """grow=True over a table built before (shorter, or longer than one chunk) keeps or extends
    it; the rows are the whole table's either way."""
    whole = RotaryEmbedding(rope_inv_freq(64, 10000.0, None, 4096)[0])
    whole.build_table(3 * TABLE_CHUNK, torch.float32)
    rope = RotaryEmbedding(rope_inv_freq(64, 10000.0, None, 4096)[0])
    rope.build_table(TABLE_CHUNK + 5, torch.float32)  # not on a chunk boundary
    rope.build_table(3 * TABLE_CHUNK, torch.float32, grow=True)
    assert rope.table.shape[0] == TABLE_CHUNK + 5  # kept: it grows from there
    rope.cos_sin(torch.tensor([2 * TABLE_CHUNK]), torch.float32, 2 * TABLE_CHUNK + 1)
    assert torch.equal(rope.table, whole.table[:3 * TABLE_CHUNK])
