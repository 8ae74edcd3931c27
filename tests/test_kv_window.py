"""Sliding-window layers in the KV store (ADR 0005): the window's attention, paged = dense, block
release past the window, and the prefix cache's rule (a hit needs the window's blocks)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from monobatch.batch import StepBatch
from monobatch.kv.attention import attend_chunk
from monobatch.kv.block_manager import blocks_per_sequence, layer_groups
from monobatch.kv.dense import DenseKv
from monobatch.kv.paged import PagedKv

N_Q, N_KV, HD, BS, W = 4, 2, 16, 16, 40
#: Gemma 3's pattern on 6 layers: layer 5 global, the others local (window W).
WINDOWS = (W, W, W, W, W, 0)


def reference(q, k, v, pos, window):
    """Masked attention over every key 0 .. pos+L-1: q [L, n_q, hd], k/v [pos+L, n_kv, hd]."""
    L, S = q.shape[0], k.shape[0]
    g = q.shape[1] // k.shape[1]
    qp = torch.arange(pos, pos + L)[:, None]
    kp = torch.arange(S)[None, :]
    mask = (kp <= qp) & ((kp > qp - window) if window else True)
    kk, vv = k.repeat_interleave(g, 1).transpose(0, 1), v.repeat_interleave(g, 1).transpose(0, 1)
    return F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask).transpose(0, 1)


def test_window_attention_matches_the_masked_reference():
    g = torch.Generator().manual_seed(0)
    for pos, L in ((0, 50), (30, 1), (70, 9), (100, 1)):
        q = torch.randn(L, N_Q, HD, generator=g)
        k, v = torch.randn(pos + L, N_KV, HD, generator=g), torch.randn(pos + L, N_KV, HD, generator=g)
        want = reference(q, k, v, pos, W)
        ks = max(0, pos - W + 1)
        for per_row in (False, True):
            got = attend_chunk(q, k[ks:], v[ks:], pos, per_row, W, ks)
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        if pos:  # a chunk given more keys than it needs (key_start 0) computes the same
            torch.testing.assert_close(attend_chunk(q, k, v, pos, False, W, 0), want, rtol=1e-5, atol=1e-5)


def test_groups_follow_the_pattern():
    groups = layer_groups((512,) * 5 + (0,) + (512,) * 5 + (0,) + (512,) * 5 + (0,))  # Gemma 3 270M
    assert [(grp.window, grp.layers) for grp in groups] == [
        (0, (5, 11, 17)), (512, (0, 1, 2)), (512, (3, 4, 6)), (512, (7, 8, 9)), (512, (10, 12, 13)),
        (512, (14, 15, 16))]
    assert [grp.layers for grp in layer_groups((0,) * 4)] == [(0, 1, 2, 3)]  # no windows: one group
    # a 32K context: 2048 blocks in the full group, 161 in each local one (512 + a 2048 chunk)
    assert blocks_per_sequence((512,) * 15 + (0,) * 3, 32768, 16, 2048) == 2048 + 5 * 161


def run(kv, steps, seed=1, g=None):
    """steps: per step, (seq, first position, token ids); random q/k/v from ``g`` (or a generator
    seeded ``seed``); returns each step's [layers, T, n_q, hd]."""
    g = g or torch.Generator().manual_seed(seed)
    outs = []
    for step in steps:
        batch = StepBatch.build([(s, ids, pos, True) for s, pos, ids in step]).to(kv.device)
        kv.prepare(batch)  # the batch attend() gets, as Engine.forward does (attend checks it is the prepared one)
        T = batch.num_tokens
        per_layer = []
        for layer in range(len(WINDOWS)):
            q, k, v = (torch.randn(T, n, HD, generator=g).to(kv.device) for n in (N_Q, N_KV, N_KV))
            per_layer.append(kv.attend(layer, q, k, v, batch))
        kv.commit(batch)
        outs.append(torch.stack(per_layer))
    return outs


def stores(num_blocks=256, device="cpu"):
    args = (len(WINDOWS), N_KV, HD, 512, torch.float32, torch.device(device))
    return DenseKv(*args, windows=WINDOWS), PagedKv(*args, num_blocks=num_blocks, block_size=BS, windows=WINDOWS)


def test_paged_equals_dense_and_releases_blocks_past_the_window():
    """Two sequences in chunks then decodes, paged and dense: the same bits at every layer; a
    long sequence holds a window's blocks in each local group, every block in the full one."""
    a = list(range(1, 301))
    b = list(range(500, 560))
    steps = [[(0, 0, a[:64]), (1, 0, b[:37])], [(0, 64, a[64:250]), (1, 37, b[37:])],
             [(0, 250, a[250:]), (1, 60, [7])]] + [[(0, 300 + i, [9 + i]), (1, 61 + i, [3])] for i in range(20)]
    dense, paged = stores()
    for want, got in zip(run(dense, steps), run(paged, steps)):
        assert torch.equal(want, got)
    n = paged.seq_len(0)
    assert n == 320
    groups = paged.groups
    full = [g for g, grp in enumerate(groups) if grp.window == 0]
    local = [g for g, grp in enumerate(groups) if grp.window]
    for g in full:
        assert None not in paged.block_table(0, g) and len(paged.block_table(0, g)) == 20
    for g in local:  # positions n - W + 1 .. n - 1 are kept: blocks 17 .. 19
        table = paged.block_table(0, g)
        assert table[:17] == [None] * 17 and None not in table[17:], table
    held = paged.usage().used_blocks
    live = {s: -(-paged.seq_len(s) // BS) - (paged.seq_len(s) - W + 1) // BS for s in (0, 1)}  # 3 and 4 blocks
    assert held == sum(-(-paged.seq_len(s) // BS) for s in (0, 1)) * len(full) + sum(live.values()) * len(local)
    paged.free(0)
    paged.free(1)
    assert paged.usage().used_blocks == 0


def test_a_prefix_hit_needs_the_window_and_gives_the_cold_bits():
    """A finished sequence's blocks serve a hit whose window is still cached (the tail computed
    on it equals the cold run bit for bit); once the window's blocks are evicted, the hit is cut
    back to a prefix whose window survives, and never adopts a released block."""
    ids = list(range(1, 131))  # 8 full blocks + 2 tokens
    dense, paged = stores()
    prefix = [[(0, 0, ids[:96])], [(0, 96, ids[96:128])]]
    run(paged, prefix, seed=3)
    run(paged, [[(0, 128, ids[128:])]], seed=5)
    paged.free(0)
    assert paged.adopt_prefix(1, ids[:129]) == 128  # whole blocks, the last token excluded
    for g, grp in enumerate(paged.groups):
        table = paged.block_table(1, g)
        assert len(table) == 8 and (None not in table if grp.window == 0 else table[:5] == [None] * 5)
    hit = run(paged, [[(1, 128, ids[128:])]], seed=4)
    run(dense, prefix, seed=3)  # the same cached keys, computed cold
    cold_tail = run(dense, [[(0, 128, ids[128:])]], seed=4)
    assert torch.equal(hit[0], cold_tail[0])
    paged.free(1)
    # Evict the most recently released blocks (the local groups' windows were released last by
    # free(), so LRU keeps them longest): take every free block, then evict until a local
    # window block goes. The hit then shrinks to a prefix whose window survives, or to 0.
    pool, taken = paged.pool, []
    while pool._free:
        taken.append(pool.allocate())
    local_keys = {paged.blocks._key(key, g) for g, grp in enumerate(paged.groups) if grp.window
                  for key in paged.blocks._keys.get(0, [])}
    evicted = 0
    while pool.num_evictable:
        taken.append(pool.allocate())
        evicted += 1
        n = paged.adopt_prefix(2, ids[:129])
        for g, grp in enumerate(paged.groups):  # whatever it adopted is held, and still keyed
            assert all(b is None or pool.is_cached(b) for b in paged.block_table(2, g))
            if grp.window and n:
                lo = max(0, n - W + 1) // BS
                assert None not in paged.block_table(2, g)[lo:]
        paged.free(2)
        if n < 128:
            break
    assert n < 128 and evicted >= 1 and local_keys is not None
    for b in taken:
        pool.release(b)


def test_trim_past_the_window_is_refused():
    dense, paged = stores()
    run(paged, [[(0, 0, list(range(1, 121)))]])
    paged.trim(0, 119)  # its window (positions 80 ..) is held: fine
    assert paged.seq_len(0) == 119
    try:
        paged.trim(0, 110)  # would need position 71, released
    except ValueError as e:
        assert "sliding window" in str(e)
    else:
        raise AssertionError("trim past the window was accepted")


def check_varlen(device: str = "cpu") -> str:
    """Paged storage's CUDA path (the varlen kernel, here in Triton's interpreter on CPU tensors)
    against its torch path, with windows: chunks crossing the window, decodes after released
    blocks; the scratch block (where released entries point) is NaN, so a kernel that read a
    released key would poison the output."""
    a, b = list(range(1, 121)), list(range(500, 530))  # W = 40: crossed in the chunks and the decodes
    steps = [[(0, 0, a[:64]), (1, 0, b)], [(0, 64, a[64:])], [(0, 120, [9]), (1, 30, [3])]]
    for make in (lambda: stores(device=device)[1],):  # paged: released entries (dense: test_varlen_attention)
        want_kv, got_kv = make(), make()
        want_kv.varlen, got_kv.varlen = False, True
        if isinstance(got_kv, PagedKv):
            bs = got_kv.block_size
            got_kv.cache[:, :, got_kv.scratch_block * bs:] = float("nan")
        for want, got in zip(run(want_kv, steps), run(got_kv, steps)):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    return "ok"


def check_decode_layout(paged, step) -> None:
    """The deterministic decode layout (``PagedKv._decode_meta``) from the host-written positions
    equals the one derived on the device (``seq_lens - 1``) in every field, in every layer group;
    padding rows (length 1) sit at position 0."""
    import dataclasses

    assert torch.equal(step.positions, step.seq_lens - 1)
    for g in range(len(paged.groups)):
        got = paged._decode_meta(step, g, N_Q)
        assert got.pos.data_ptr() == step.positions.data_ptr()  # read where the host wrote it
        want = paged._decode_meta(dataclasses.replace(step, positions=None), g, N_Q)
        for field in dataclasses.fields(want):
            a, b = getattr(got, field.name), getattr(want, field.name)
            assert torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b, field.name
        # the row numbers, ones and zeros of a batch size are made once, not per step
        assert [t.data_ptr() for t in (got.q_start, got.q_len, got.tile_off)] == \
            [t.data_ptr() for t in (want.q_start, want.q_len, want.tile_off)]


def test_static_decode_steps_read_the_window():
    """The CUDA-graph decode path (static DecodeStep tensors, one block table and slot per layer
    group; here its torch reference on CPU) equals the eager path once blocks were released; the
    scratch block that released entries point at is NaN, so reading one would show."""
    from monobatch.engine.cuda_graphs import DecodeInputs

    a, b = list(range(1, 201)), list(range(300, 330))
    prefill = [[(0, 0, a[:120]), (1, 0, b)], [(0, 120, a[120:])]]
    decodes = [[(0, 200 + i, [5 + i]), (1, 30 + i, [7])] for i in range(4)]
    dense, paged = stores()
    run(dense, prefill, seed=2)
    run(paged, prefill, seed=2)
    paged.cache[:, :, paged.scratch_block * BS:] = float("nan")
    inputs = DecodeInputs(4, paged.max_blocks_per_seq, "cpu", groups=len(paged.groups))
    g_dense, g_paged = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    for step in decodes:
        want = run(dense, [step], g=g_dense)[0]
        batch = StepBatch.build([(s, ids, pos, True) for s, pos, ids in step])
        paged.prepare_decode(batch, inputs.step.rows(4), inputs.step.rows(4))  # 2 rows of padding
        check_decode_layout(paged, inputs.step.rows(4))
        qkv = [[torch.randn(2, n, HD, generator=g_paged) for n in (N_Q, N_KV, N_KV)] for _ in WINDOWS]
        pad = [[torch.cat([t, t.new_zeros(2, *t.shape[1:])]) for t in layer] for layer in qkv]
        got = torch.stack([paged.attend(layer, *pad[layer], batch)[:2] for layer in range(len(WINDOWS))])
        paged.commit(batch)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert paged.block_table(0, 1)[0] is None  # the local groups did release blocks


def check_decode_kernel(device: str = "cpu") -> str:
    """The Triton paged decode kernel (interpreter, CPU tensors) with a window: equal to the torch
    reference; block-table entries before each row's window point at a NaN block, which neither
    reads; with the step's new K/V stored by the same launch, and several partitions (splits);
    and the same bits with those rows already in the pool (no store)."""
    from monobatch.kernels.paged_decode import paged_decode_torch, paged_decode_triton

    g = torch.Generator().manual_seed(5)
    bs, nb, n_kv, n_q, hd, window = 16, 24, 2, 8, 64, 100
    lens = torch.tensor([1, 90, 101, 230, 384], dtype=torch.int32)
    B = len(lens)
    pool = B * nb + 1
    k_cache, v_cache = torch.randn(pool * bs, n_kv, hd, generator=g), torch.randn(pool * bs, n_kv, hd, generator=g)
    nan_block = pool - 1
    k_cache[nan_block * bs:], v_cache[nan_block * bs:] = float("nan"), float("nan")
    tables = torch.arange(B * nb, dtype=torch.int32).view(B, nb)
    for b, n in enumerate(lens.tolist()):
        released = max(0, n - window) // bs  # whole blocks before the window
        tables[b, :released] = nan_block
    q = torch.randn(B, n_q, hd, generator=g)
    k_new, v_new = torch.randn(B, n_kv, hd, generator=g), torch.randn(B, n_kv, hd, generator=g)
    slots = torch.stack([tables[b, (n - 1) // bs].long() * bs + (n - 1) % bs for b, n in enumerate(lens.tolist())])
    kc, vc = k_cache.clone(), v_cache.clone()
    kc[slots], vc[slots] = k_new, v_new
    want = paged_decode_torch(q, kc, vc, tables, lens, bs, window)
    assert torch.isfinite(want).all()
    dev = [t.to(device) for t in (q, k_cache, v_cache, tables, lens, k_new, v_new, slots)]
    got = paged_decode_triton(*dev[:5], bs, *dev[5:], window=window)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dev[1][dev[7]].cpu(), k_new)  # stored by the launch
    # the newest rows already in the pool (the kernel before stored them): the same result
    stored = [t.to(device) for t in (q, kc, vc, tables, lens)]
    assert torch.equal(paged_decode_triton(*stored, bs, window=window), got)
    return "ok"


def test_deterministic_rows_do_not_depend_on_chunking_or_storage():
    """Per-row attention (``--deterministic``) with windows: a position's output is the same bits
    whether its sequence was computed in one chunk, in chunks of 7 or 50 tokens, or one token at a
    time (the window crossed in every way), on dense and paged storage."""
    g = torch.Generator().manual_seed(11)
    n = 90
    q = torch.randn(len(WINDOWS), n, N_Q, HD, generator=g)
    k, v = (torch.randn(len(WINDOWS), n, N_KV, HD, generator=g) for _ in range(2))
    results = []
    for make in (lambda: stores()[0], lambda: stores()[1]):
        for sizes in ([n], [7] * (n // 7) + [n % 7], [1] * n):
            kv, out, pos = make(), torch.empty(len(WINDOWS), n, N_Q, HD), 0
            for size in sizes:
                batch = StepBatch.build([(0, list(range(pos, pos + size)), pos, True)], row_tile=8)
                kv.prepare(batch)
                for layer in range(len(WINDOWS)):
                    s = slice(pos, pos + size)
                    out[layer, s] = kv.attend(layer, q[layer, s], k[layer, s], v[layer, s], batch)
                kv.commit(batch)
                pos += size
            results.append(out)
    for other in results[1:]:
        assert torch.equal(other, results[0])
    torch.testing.assert_close(results[0][0], reference(q[0], k[0], v[0], 0, W), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("check", ["check_varlen", "check_decode_kernel"])
def test_window_kernels_in_interpreter(check):
    from helpers import run_in_triton_interpreter
    run_in_triton_interpreter("test_kv_window", check)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA")
@pytest.mark.parametrize("check", [check_varlen, check_decode_kernel])
def test_window_kernels_cuda(check):
    assert check("cuda") == "ok"


def test_decode_inputs_rewrite_changed_rows_only_and_equal_a_fresh_write():
    """The CUDA-graph decode path's host buffer is kept across steps and a row's block tables are
    rewritten only when its sequence's tables changed (:meth:`BlockManager.stamp`): through
    reordered rows, block crossings, released window blocks, copy-on-write after a fork, a trim,
    and a freed sequence whose id comes back, every row equals a fresh buffer's write and the
    tables themselves (what the kernel reads: the blocks up to each row's length)."""
    from monobatch.engine.cuda_graphs import DecodeInputs

    _, paged = stores()
    nb, G = paged.max_blocks_per_seq, len(paged.groups)
    kept = DecodeInputs(6, nb, "cpu", groups=G)
    lens = {}

    def extend(seq, ids):
        batch = StepBatch.build([(seq, ids, lens.get(seq, 0), True)])
        paged.prepare(batch)
        paged.commit(batch)
        lens[seq] = lens.get(seq, 0) + len(ids)

    for seq, n in ((0, 15), (1, 16), (2, 33), (3, 140)):
        extend(seq, list(range(100 + seq, 100 + seq + n)))
    paged.fork(1, 4)  # shares 1's full block: 4's next write goes to a block of its own
    lens[4] = lens[1]
    rng = torch.Generator().manual_seed(3)
    order = [0, 1, 2, 3, 4]
    stamps_seen = set()
    for step in range(40):
        if step == 10:
            paged.trim(2, 20)
            lens[2] = 20
        if step == 20:
            paged.free(0)
            del lens[0]
            extend(0, [5, 6, 7])  # the id again, other blocks
        if step % 7 == 3:  # another row order (rows hold other sequences)
            order = [order[i] for i in torch.randperm(len(order), generator=rng).tolist()]
        rows = order[:4] if step % 5 == 4 else order  # sometimes fewer rows (padding)
        batch = StepBatch.build([(s, [step + s], lens[s], True) for s in rows])
        paged.prepare_decode(batch, kept.step.rows(6), kept.step.rows(6))
        assert torch.equal(kept.step.positions, kept.step.seq_lens - 1)  # rows left by a shrunk batch: 0
        stamps_seen |= {paged.blocks.stamp(s) for s in rows}
        fresh = DecodeInputs(6, nb, "cpu", groups=G)
        paged.prepare_decode(batch, fresh.step.rows(6), fresh.step.rows(6))
        assert torch.equal(kept.step.slot_mapping, fresh.step.slot_mapping)
        assert torch.equal(kept.step.seq_lens, fresh.step.seq_lens)
        for i, s in enumerate(rows):
            used = -(-(lens[s] + 1) // BS)
            for g in range(G):
                want = [paged.scratch_block if b is None else b for b in paged.block_table(s, g)][:used]
                assert kept.step.block_tables[i, g, :used].tolist() == want
                assert fresh.step.block_tables[i, g, :used].tolist() == want
        assert kept.step.block_tables[len(rows):, :, 0].eq(paged.scratch_block).all()
        paged.commit(batch)
        for s in rows:
            lens[s] += 1
    assert paged.block_table(3, 1)[0] is None  # windows released blocks on the way
    assert len(stamps_seen) > len(order)  # tables did change (and rows were rewritten)
