"""The varlen paged attention kernel (kernels/varlen_attention.py) against attend_chunk, the eager
path's attention, on each chunk's gathered keys; and its batch invariance (a row's bits depend on
its keys alone). Runs in Triton's CPU interpreter where Triton is installed, and on CUDA."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from helpers import run_in_triton_interpreter
from monobatch.kv.attention import attend_chunk


def _case(chunks, n_q, n_kv, hd, bs, dtype, device, seed=0):
    """A pool holding every chunk's keys (positions 0 .. pos+len-1, blocks shuffled), queries for
    the chunks' new tokens, and the metadata of one step over them (``chunks``: (pos, len))."""
    from monobatch.kernels.varlen_attention import build_meta
    g = torch.Generator().manual_seed(seed)
    need = [-(-(p + n) // bs) for p, n in chunks]
    blocks = sum(need) + 2
    k = torch.randn(blocks * bs, n_kv, hd, generator=g).to(device, dtype)
    v = torch.randn(blocks * bs, n_kv, hd, generator=g).to(device, dtype)
    perm = torch.randperm(blocks, generator=g).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at:at + n])
        at += n
    T = sum(n for _, n in chunks)
    q = torch.randn(T, n_q, hd, generator=g).to(device, dtype)
    starts, s = [], 0
    for _, n in chunks:
        starts.append(s)
        s += n
    return q, k, v, tables, [(st, n, p) for st, (p, n) in zip(starts, chunks)]


def _oracle(q, k, v, tables, layout, bs, window=0):
    out = torch.empty_like(q)
    for table, (st, n, p) in zip(tables, layout):
        slots = (torch.tensor(table)[:, None] * bs + torch.arange(bs)).reshape(-1)[:p + n].to(q.device)
        if window:  # row by row: each row sees its last `window` keys
            for i in range(n):
                lo = max(0, p + i - window + 1)
                out[st + i:st + i + 1] = attend_chunk(q[st + i:st + i + 1], k[slots[lo:p + i + 1]],
                                                      v[slots[lo:p + i + 1]], p + i - lo)
        else:
            out[st:st + n] = attend_chunk(q[st:st + n], k[slots], v[slots], p)
    return out


def check(device: str = "cpu", dtype=torch.float32) -> str:
    """Every path on small shapes: chunks of one token (decode rows), short and long prompt chunks,
    a chunk continuing a cache (pos > 0), GQA groups of 4 and 3 (padded to 4), a sliding window;
    then batch invariance: each chunk alone gives the bits it gives inside the step."""
    tol = {torch.float32: 2e-5, torch.bfloat16: 2e-2}[dtype]
    bs = 16
    patched = row_independent_dot() if dtype == torch.float32 else contextlib.nullcontext(False)
    # the interpreter: 6 splits at most (its merge is unrolled over them); the GPU: the default
    setting = split_setting(64, 4) if device == "cpu" else contextlib.nullcontext()
    with patched as anywhere, setting:
        _check_cases(device, dtype, tol, bs, anywhere)
    return "ok"


def _check_cases(device, dtype, tol, bs, anywhere):
    from monobatch.kernels.varlen_attention import build_meta, tokens_per_tile, varlen_paged_attention
    for n_q, n_kv, chunks, window in [
        (8, 2, [(0, 1), (37, 1), (0, 70), (100, 33), (5, 1)], 0),
        (9, 3, [(0, 130), (64, 1), (200, 17)], 0),
        (8, 2, [(0, 150), (90, 40), (300, 1)], 48),
    ]:
        q, k, v, tables, layout = _case(chunks, n_q, n_kv, 64, bs, dtype, device)
        ref = _oracle(q, k, v, tables, layout, bs, window)
        for det in (False, True):
            bt = tokens_per_tile(n_q, n_kv, det)
            meta = build_meta(layout, tables, bt, torch.device(device), fixed_split=det)
            out = varlen_paged_attention(q, k, v, meta, bs, window=window)
            torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
            if det:  # batch invariance: a chunk alone, split in two, each token alone as a decode row
                # On the GPU a row's MMA arithmetic does not depend on its place in the tile, so
                # these are bitwise equal. The CPU interpreter's numpy matmul picks its kernel by a
                # row's place in a block: close, not equal, unless row_independent_dot is in force.
                def same(a, b, what):
                    if device == "cuda" or anywhere:
                        assert torch.equal(a, b), what
                    else:
                        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=what)

                dev = torch.device(device)
                for table, (st, n, p) in zip(tables, layout):
                    alone = varlen_paged_attention(q[st:st + n], k, v, build_meta([(0, n, p)], [table], bt, dev, True),
                                                   bs, window=window)
                    assert torch.equal(alone, out[st:st + n]), "a chunk alone differs from itself in the step"
                    if n > 1:  # split off the first 5 tokens: the second part starts mid-tile
                        cut = min(5, n - 1)
                        split = varlen_paged_attention(q[st:st + n], k, v, build_meta(
                            [(0, cut, p), (cut, n - cut, p + cut)], [table, table], bt, dev, True), bs, window=window)
                        same(split, out[st:st + n], "a chunk split in two differs from the whole")
                    rows = range(n) if device == "cuda" else sorted({0, n // 2, n - 1})
                    for i in rows:  # every row (CUDA): blocks past a row's position must change nothing
                        row = varlen_paged_attention(q[st + i:st + i + 1], k, v,
                                                     build_meta([(0, 1, p + i)], [table], bt, dev, True), bs,
                                                     window=window)
                        same(row, out[st + i:st + i + 1], f"a decode row differs from prefill row {i}")


def test_varlen_attention_in_interpreter():
    run_in_triton_interpreter("test_varlen_attention", "check")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_attention_cuda(dtype):
    assert check("cuda", dtype) == "ok"


@contextlib.contextmanager
def row_independent_dot():
    """In Triton's interpreter, ``tl.dot`` on float32 by ``numpy.einsum`` instead of
    ``numpy.matmul``, whose BLAS rounds a row by its place in the tile (a GPU's MMA does not:
    ADR 0002): so a row's bits can be compared wherever it sits in a tile, as on CUDA. Yields
    whether it is in force (False on CUDA, or where the interpreter's builder has changed shape)."""
    try:
        import numpy as np
        from triton.runtime import interpreter
        builder, real = interpreter.InterpreterBuilder, interpreter.InterpreterBuilder.create_dot
    except (ImportError, AttributeError):
        yield False
        return

    def create_dot(self, a, b, d, *args, **kwargs):
        out = real(self, a, b, d, *args, **kwargs)
        if a.data.dtype == np.float32 and b.data.dtype == np.float32:
            out.data = (np.einsum("ik,kj->ij", a.data, b.data) + d.data).astype(out.data.dtype)
        return out

    builder.create_dot = create_dot
    try:
        yield os.environ.get("TRITON_INTERPRET") == "1"
    finally:
        builder.create_dot = real


@contextlib.contextmanager
def split_setting(smallest: int, parts: int):
    """Deterministic mode's split constants set to ``(smallest, parts)`` for the block (the
    kernel reads them at each launch), e.g. (64, 4): split sizes 64 .. 1024 over 3K keys at a
    few splits a row, what the interpreter can afford."""
    from monobatch.kernels import varlen_attention as va
    saved = va.SPLIT_MIN, va.SPLIT_PARTS, va.MAX_SPLITS
    va.SPLIT_MIN, va.SPLIT_PARTS, va.MAX_SPLITS = smallest, parts, parts + 2
    try:
        yield
    finally:
        va.SPLIT_MIN, va.SPLIT_PARTS, va.MAX_SPLITS = saved


def check_fixed_split(device: str = "cpu", smallest: int = 64, parts: int = 4, keys: int = 1140,
                      positions: tuple[int, ...] = (70, 255, 256, 511, 512, 700, 1023, 1024, 1060),
                      windows: tuple[int, ...] = (0, 300), dtype=torch.float32) -> str:
    """Deterministic mode's fixed KV split (kernels/varlen_attention.py, rules 2 and 3): a row's
    bits are the same as a decode row alone (the split grid: default ``splits``, or 2 programs),
    as a decode row beside other sequences' rows (the grid, or one program), and inside prompt
    chunks of other lengths and offsets (the loop schedule, tiles straddling a change of split
    size, the split grid of short steps), with and without a sliding window (blocks before it
    NaN, as released blocks may hold); and all of them are attend_chunk's result within
    tolerance. ``positions`` sit at changes of the split size (with (64, 4): 64, then 128 from
    position 256, 256 from 512, 512 from 1024; a window of 300 keys: 128 from position 256).

    Bitwise everywhere, in the interpreter with :func:`row_independent_dot` (without it rows
    are compared bitwise only at the same place of a tile, ``(position - chunk start) % BT``).
    """
    from monobatch.kernels.varlen_attention import build_meta, split_size, tokens_per_tile, varlen_paged_attention
    dev = torch.device(device)
    n_q, n_kv, hd, bs = (2, 1, 16, 16) if device == "cpu" else (8, 2, 64, 16)
    tol = {torch.float32: 2e-5, torch.bfloat16: 2e-2}[dtype]
    bt = tokens_per_tile(n_q, n_kv, True)
    g = torch.Generator().manual_seed(3)
    nblocks = -(-keys // bs)
    k = torch.randn((2 * nblocks + 1) * bs, n_kv, hd, generator=g).to(dev, dtype)
    v = torch.randn((2 * nblocks + 1) * bs, n_kv, hd, generator=g).to(dev, dtype)
    scratch = 2 * nblocks  # NaN: where paged storage points blocks released past a window (never read)
    k[scratch * bs:], v[scratch * bs:] = float("nan"), float("nan")
    perm = torch.randperm(2 * nblocks, generator=g).tolist()
    table_x, table_y = perm[:nblocks], perm[nblocks:]  # two sequences over one pool
    q_x = torch.randn(keys, n_q, hd, generator=g).to(dev, dtype)  # the query of each position of x
    q_y = torch.randn(keys, n_q, hd, generator=g).to(dev, dtype)
    slots_x = (torch.tensor(table_x)[:, None] * bs + torch.arange(bs)).reshape(-1).to(dev)

    # attend_chunk over all of x's positions at once, per window: every row's reference
    oracle = {w: attend_chunk(q_x.float(), k[slots_x[:keys]].float(), v[slots_x[:keys]].float(), 0, window=w)
              for w in windows}

    def run(chunks, window, splits=None):
        """One step of ``chunks`` ((sequence, first position, length)); each chunk's rows."""
        q = torch.cat([(q_x if seq == "x" else q_y)[p:p + n] for seq, p, n in chunks])
        layout, at = [], 0
        for _, p, n in chunks:
            layout.append((at, n, p))
            at += n
        tables = []
        for seq, p, _ in chunks:  # blocks wholly before the chunk's window: the scratch block
            table = list(table_x if seq == "x" else table_y)
            gone = max(0, p - window + 1) // bs if window else 0
            tables.append([scratch] * gone + table[gone:])
        out = varlen_paged_attention(q, k, v, build_meta(layout, tables, bt, dev, fixed_split=True), bs,
                                     window=window, splits=splits)
        return [out[st:st + n] for st, n, _ in layout]

    with split_setting(smallest, parts), row_independent_dot() as anywhere:
        assert len({split_size(p) for p in positions}) >= 4, "the positions must cross split sizes"
        for window in windows:
            seen: dict[tuple[int, int], torch.Tensor] = {}  # (position, place in its tile) -> bits

            def same(rows, first, what):
                for i in range(rows.shape[0]):
                    p = first + i
                    place = 0 if device == "cuda" or anywhere else i % bt
                    torch.testing.assert_close(rows[i:i + 1].float(), oracle[window][p:p + 1], rtol=tol, atol=tol,
                                               msg=f"{what}, position {p}: not attend_chunk's")
                    ref = seen.setdefault((p, place), rows[i:i + 1])
                    assert torch.equal(rows[i:i + 1], ref), f"{what}, position {p}, window {window}: other bits"

            for p in positions:  # decode rows alone: the split grid, two programs (one: the batch below)
                for splits in (None, 2):
                    same(run([("x", p, 1)], window, splits)[0], p, f"decode row alone, splits={splits}")
            # decode rows beside each other and beside another sequence's rows
            step = [("y", keys - 100, 1), ("y", 40, 1)] + [("x", p, 1) for p in positions]
            for splits in (None, 1):
                for rows, (seq, p, _) in zip(run(step, window, splits), step):
                    if seq == "x":
                        same(rows, p, f"decode row in a batch, splits={splits}")
            # inside prompt chunks: each position a tile's first token (40 tokens from p - bt: 2
            # tiles), the first of a 3-token chunk (a short step: the split grid), one chunk of 130
            # tokens across the change at 1024 and the same tokens as two chunks (one starting a
            # tile later) behind another sequence's chunk
            for rows, p in zip(run([("x", p - bt, 40) for p in positions], window), positions):
                same(rows, p - bt, "prompt chunk of 40")
            for splits in (None, 1):
                for rows, p in zip(run([("x", p, 3) for p in positions], window, splits), positions):
                    same(rows, p, f"prompt chunk of 3, splits={splits}")
            same(run([("x", 1000, 130)], window)[0], 1000, "prompt chunk of 130")
            parts_out = run([("y", 900, 17), ("x", 1000, bt), ("x", 1000 + bt, 130 - bt)], window)
            same(parts_out[1], 1000, "first part of a split chunk")
            same(parts_out[2], 1000 + bt, "second part of a split chunk")
    return "ok"


def test_fixed_split_in_interpreter():
    run_in_triton_interpreter("test_varlen_attention", "check_fixed_split")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("setting", [(64, 4), (64, 32)])
def test_fixed_split_cuda(setting, dtype):
    """On the GPU, bitwise for every row, bf16 (wgmma) and float32 (IEEE): the interpreter's
    config, and the default split (64, 32) with contexts to 9K keys (split sizes 64 .. 512)."""
    if setting == (64, 4):
        assert check_fixed_split("cuda", *setting, dtype=dtype) == "ok"
    else:
        assert check_fixed_split("cuda", *setting, keys=9000, positions=(100, 2047, 2048, 4095, 4096, 4500, 8191,
                                                                          8192, 8800), windows=(0, 700),
                                 dtype=dtype) == "ok"


def check_stores(device: str = "cpu") -> str:
    """PagedKv and DenseKv on the varlen kernel against their torch path (``varlen`` False), over
    three steps of one layer: two prompts in chunks (one continuing a cache hit's blocks), then
    a mixed step of decode rows and a prompt chunk; in both modes (deterministic: ``row_tile``)."""
    from monobatch.batch import StepBatch
    from monobatch.kv.dense import DenseKv
    from monobatch.kv.paged import PagedKv
    g = torch.Generator().manual_seed(1)
    n_q, n_kv, hd = 8, 2, 64
    steps = [[(1, 40, 0), (2, 70, 0)], [(1, 1, 40), (2, 30, 70), (3, 33, 0)], [(1, 1, 41), (2, 1, 100), (3, 1, 33)]]
    for tile in (0, 8):
        outs = {}
        for name in ("paged", "dense"):
            for varlen in (False, True):
                if name == "paged":
                    kv = PagedKv(1, n_kv, hd, 256, torch.float32, torch.device(device), num_blocks=64, block_size=16)
                else:
                    kv = DenseKv(1, n_kv, hd, 256, torch.float32, torch.device(device), growth=32)
                kv.varlen = varlen
                g.manual_seed(1)
                res = []
                for step in steps:
                    batch = StepBatch.build([(s, [5] * n, p, True) for s, n, p in step], device, row_tile=tile)
                    T = batch.num_tokens
                    q, k, v = (torch.randn(T, h, hd, generator=g).to(device) for h in (n_q, n_kv, n_kv))
                    kv.prepare(batch)
                    res.append(kv.attend(0, q, k, v, batch))
                    kv.commit(batch)
                outs[name, varlen] = torch.cat(res)
        for key, out in outs.items():
            torch.testing.assert_close(out, outs["paged", False], rtol=2e-5, atol=2e-5, msg=str(key))
        if device == "cuda" and tile:  # one kernel, tile and KV split for both storages (dense: a launch
            # per chunk, so other split grids): the same bits
            assert torch.equal(outs["paged", True], outs["dense", True])
    return "ok"


def test_stores_on_varlen_kernel_in_interpreter():
    run_in_triton_interpreter("test_varlen_attention", "check_stores")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_stores_on_varlen_kernel_cuda():
    assert check_stores("cuda") == "ok"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("lengths,setting,logprobs", [((5, 14, 23, 32), None, None), ((120, 61, 200, 5), (64, 2), 0)])
def test_deterministic_mode_same_tokens_everywhere_cuda(lengths, setting, logprobs):
    """--deterministic on CUDA (batch-invariant kernels): dense and paged storage, CUDA graphs and
    eager decode, alone and batched, chunked prefill: the same greedy ids (a graph captured on
    padding must recompute the decode layout from each replay's inputs). Second case: prompts to
    200 tokens with the split constants at (64, 2), so that rows have up to 4 splits and the split
    size changes (64 -> 128 at position 128) inside prompts and during decode; the tokens'
    logprobs too (each a function of its row's logits: equal floats, equal logits in practice)."""
    from monobatch.engine.params import SamplingParams
    from monobatch.llm import LLM
    from monobatch.loader.dummy import dummy_model
    loaded = dummy_model("tiny", "cuda")
    prompts = [[(31 * i + 7 * j) % 500 + 1 for j in range(n)] for i, n in enumerate(lengths)]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=logprobs)

    def run(batch=True, **kw):
        llm = LLM(loaded=loaded, deterministic=True, **kw)
        if batch:
            outs = llm.generate(prompts, greedy, use_tqdm=False)
        else:
            outs = [llm.generate([p], greedy, use_tqdm=False)[0] for p in prompts]
        return [(o.outputs[0].token_ids, [lp for _, lp, _ in o.outputs[0].logprobs or []]) for o in outs]

    with split_setting(*setting) if setting else contextlib.nullcontext():
        ref = run(batch=False, kv_storage="dense")
        assert run(kv_storage="dense") == ref
        assert run(batch=False, kv_storage="paged") == ref
        assert run(kv_storage="paged") == ref
        assert run(kv_storage="paged", enforce_eager=True) == ref
        assert run(kv_storage="paged", prefill_chunk=3) == ref
        assert run(kv_storage="paged", prefill_chunk=37) == ref


def check_prefill_graphs(device: str = "cpu") -> str:
    """PrefillGraphs' static-buffer forward (capture=False; graphs on CUDA) against the eager
    varlen path, on the tiny shape: prompt chunks, a chunk continuing its cache, decode rows
    mixed in, several buckets; the same logits and, after each step, the same KV."""
    from monobatch.batch import StepBatch
    from monobatch.engine.cuda_graphs import PrefillGraphs
    from monobatch.engine.engine import Engine, EngineConfig
    from monobatch.loader.dummy import dummy_model
    loaded = dummy_model("tiny", device)
    engines = [Engine(loaded, EngineConfig(kv_cache_memory=1 << 22, cuda_graphs=False)) for _ in range(2)]
    for e in engines:
        e.kv.varlen = True
    graphs = PrefillGraphs(loaded.model, engines[1].kv, capture=device == "cuda")
    steps = [[(1, 20, 0), (2, 7, 0)], [(1, 1, 20), (2, 9, 7), (3, 30, 0)], [(1, 1, 21), (2, 1, 16), (3, 1, 30), (4, 3, 0)]]
    tol = 1e-4 if loaded.model.dtype == torch.float32 else 3e-2  # bf16 GEMMs of T and padded rows
    for step in steps:
        batch = StepBatch.build([(s, [(7 * s + 3 * i) % 500 + 1 for i in range(n)], p, True) for s, n, p in step])
        assert graphs.handles(batch)
        eager = engines[0].forward(batch.to(engines[0].device))
        static = graphs.forward(batch)
        torch.testing.assert_close(static, eager, rtol=tol, atol=tol)
        end = engines[0].kv.scratch_block * engines[0].kv.block_size  # padding rows write the scratch block
        torch.testing.assert_close(engines[1].kv.cache[:, :, :end], engines[0].kv.cache[:, :, :end], rtol=tol, atol=tol)
    return "ok"


def test_prefill_graphs_static_path_in_interpreter():
    run_in_triton_interpreter("test_varlen_attention", "check_prefill_graphs")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefill_graphs_cuda():
    assert check_prefill_graphs("cuda") == "ok"


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8])
def test_build_meta_parts_start_16_byte_aligned(n):
    """Triton specialises a kernel on each pointer's 16-byte alignment: every part of the step's
    layout starts aligned whatever the chunk and tile counts, so one compile serves every step
    (issue 16: unaligned parts made serving's first requests wait for JIT compiles)."""
    from monobatch.kernels.varlen_attention import build_meta, tile_layout

    chunks = [(3 * i, 1 + (i * 5) % 7, 10 * i) for i in range(n)]
    tables = [list(range(i, i + 2 + i % 3)) for i in range(n)]
    meta = build_meta(chunks, tables, 2, torch.device("cpu"))
    for part in (meta.block_tables, meta.q_start, meta.q_len, meta.pos, meta.tile_chunk, meta.tile_off):
        assert part.data_ptr() % 16 == 0
    assert meta.q_start.tolist() == [c[0] for c in chunks] and meta.q_len.tolist() == [c[1] for c in chunks]
    assert meta.pos.tolist() == [c[2] for c in chunks]
    assert [t[:len(tables[i])] for i, t in enumerate(meta.block_tables.tolist())] == tables
    tiles = tile_layout(chunks, 2)
    assert meta.tile_chunk.tolist() == [c for c, _ in tiles] and meta.tile_off.tolist() == [o for _, o in tiles]
