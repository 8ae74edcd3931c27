"""RoPE's position table (models/rope.py): the same cos/sin as the on-the-fly formula, element for
element, and a model that reads it gives the same logits bit for bit."""

from __future__ import annotations

import pytest
import torch

from monobatch.batch import StepBatch
from monobatch.kv.dense import DenseKv
from monobatch.models.rope import RotaryEmbedding, rope_inv_freq


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
