"""The varlen paged attention kernel (kernels/varlen_attention.py) against attend_chunk, the eager
path's attention, on each chunk's gathered keys; and its batch invariance (a row's bits depend on
its keys alone). Runs in Triton's CPU interpreter where Triton is installed, and on CUDA."""

from __future__ import annotations

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
    from monobatch.kernels.varlen_attention import build_meta, tokens_per_tile, varlen_paged_attention
    tol = {torch.float32: 2e-5, torch.bfloat16: 2e-2}[dtype]
    bs = 16
    for n_q, n_kv, chunks, window in [
        (8, 2, [(0, 1), (37, 1), (0, 70), (100, 33), (5, 1)], 0),
        (9, 3, [(0, 130), (64, 1), (200, 17)], 0),
        (8, 2, [(0, 150), (90, 40), (300, 1)], 48),
    ]:
        q, k, v, tables, layout = _case(chunks, n_q, n_kv, 64, bs, dtype, device)
        ref = _oracle(q, k, v, tables, layout, bs, window)
        for det in (False, True):
            bt = tokens_per_tile(n_q, n_kv, det)
            meta = build_meta(layout, tables, bt, torch.device(device))
            out = varlen_paged_attention(q, k, v, meta, bs, window=window)
            torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
            if det:  # batch invariance: a chunk alone, split in two, each token alone as a decode row
                # On the GPU a row's MMA arithmetic does not depend on its place in the tile, so
                # these are bitwise equal. The CPU interpreter's numpy matmul picks its kernel by a
                # row's place in a block: close, not equal.
                def same(a, b, what):
                    if device == "cuda":
                        assert torch.equal(a, b), what
                    else:
                        torch.testing.assert_close(a, b, rtol=tol, atol=tol, msg=what)

                dev = torch.device(device)
                for table, (st, n, p) in zip(tables, layout):
                    alone = varlen_paged_attention(q[st:st + n], k, v, build_meta([(0, n, p)], [table], bt, dev), bs,
                                                   window=window)
                    assert torch.equal(alone, out[st:st + n]), "a chunk alone differs from itself in the step"
                    if n > 1:  # split off the first 5 tokens: the second part starts mid-tile
                        cut = min(5, n - 1)
                        split = varlen_paged_attention(q[st:st + n], k, v, build_meta(
                            [(0, cut, p), (cut, n - cut, p + cut)], [table, table], bt, dev), bs, window=window)
                        same(split, out[st:st + n], "a chunk split in two differs from the whole")
                    rows = range(n) if device == "cuda" else sorted({0, n // 2, n - 1})
                    for i in rows:  # every row (CUDA): blocks past a row's position must change nothing
                        row = varlen_paged_attention(q[st + i:st + i + 1], k, v,
                                                     build_meta([(0, 1, p + i)], [table], bt, dev), bs, window=window)
                        same(row, out[st + i:st + i + 1], f"a decode row differs from prefill row {i}")
    return "ok"


def test_varlen_attention_in_interpreter():
    run_in_triton_interpreter("test_varlen_attention", "check")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_varlen_attention_cuda(dtype):
    assert check("cuda", dtype) == "ok"


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
        if device == "cuda" and tile:  # one kernel and tile for both storages: the same bits
            assert torch.equal(outs["paged", True], outs["dense", True])
    return "ok"


def test_stores_on_varlen_kernel_in_interpreter():
    run_in_triton_interpreter("test_varlen_attention", "check_stores")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_stores_on_varlen_kernel_cuda():
    assert check_stores("cuda") == "ok"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_deterministic_mode_same_tokens_everywhere_cuda():
    """--deterministic on CUDA (batch-invariant kernels): dense and paged storage, CUDA graphs and
    eager decode, alone and batched, chunked prefill: the same greedy ids (a graph captured on
    padding must recompute the decode layout from each replay's inputs)."""
    from monobatch.engine.params import SamplingParams
    from monobatch.llm import LLM
    from monobatch.loader.dummy import dummy_model
    loaded = dummy_model("tiny", "cuda")
    prompts = [[(31 * i + 7 * j) % 500 + 1 for j in range(5 + 9 * i)] for i in range(4)]
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)

    def run(batch=True, **kw):
        llm = LLM(loaded=loaded, deterministic=True, **kw)
        if batch:
            return [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
        return [llm.generate([p], greedy, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]

    ref = run(batch=False, kv_storage="dense")
    assert run(kv_storage="dense") == ref
    assert run(batch=False, kv_storage="paged") == ref
    assert run(kv_storage="paged") == ref
    assert run(kv_storage="paged", enforce_eager=True) == ref
    assert run(kv_storage="paged", prefill_chunk=3) == ref


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
