"""The CUDA-graph decode path (engine/cuda_graphs.py) and its paged-decode attention kernel.

On CPU the same static-buffer forward runs without capture (``capture=False``), so these tests
check what a graph replays: padding to a captured size, the scratch block, block tables read on
the device, and the same tokens and KV as the eager path. The Triton kernel itself is checked
against the torch reference on CUDA (scripts/gpu_check.sh) and, where Triton is installed, in
its CPU interpreter.
"""

from __future__ import annotations

import pytest
import torch

from helpers import run_in_triton_interpreter
from monobatch.kernels import common
from monobatch.engine.cuda_graphs import DecodeGraphs, capture_sizes
from monobatch.engine.engine import Engine, EngineConfig
from monobatch.engine.params import SamplingParams
from monobatch.engine.scheduler import BatchScheduler
from monobatch.engine.sequence import Request
from monobatch.kernels.paged_decode import paged_decode_torch
from monobatch.kv.attention import attend_chunk

pytestmark = pytest.mark.usefixtures("one_cpu_thread")  # see conftest: oversubscription on a shared box



def test_capture_sizes_cover_every_batch():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert capture_sizes(5) == [1, 2, 4, 5]
    assert capture_sizes(1) == [1]


def _paged_case(B, n_q, n_kv, hd, bs, lens, dtype=torch.float32, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    nb = max(-(-n // bs) for n in lens) + 1
    blocks = B * nb + 3
    k = torch.randn(blocks * bs, n_kv, hd, generator=g).to(device, dtype)
    v = torch.randn(blocks * bs, n_kv, hd, generator=g).to(device, dtype)
    tables = torch.randperm(blocks, generator=g)[:B * nb].view(B, nb).to(device, torch.int32)
    q = torch.randn(B, n_q, hd, generator=g).to(device, dtype)
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32, device=device)


def _oracle(q, k, v, tables, lens, bs):
    """attend_chunk (the eager path's attention) on each row's keys, gathered by hand."""
    rows = []
    for b, n in enumerate(lens.tolist()):
        slots = (tables[b].long()[:, None] * bs + torch.arange(bs, device=q.device)).reshape(-1)[:n]
        rows.append(attend_chunk(q[b:b + 1], k[slots], v[slots], n - 1)[0])
    return torch.stack(rows)


@pytest.mark.parametrize("shape", [(3, 32, 8, 64, 16, [1, 37, 600]), (2, 9, 3, 64, 16, [130, 1100])])
def test_torch_paged_decode_matches_attend_chunk(shape):
    *dims, lens = shape
    q, k, v, tables, seq_lens = _paged_case(*dims, lens)
    out = paged_decode_torch(q, k, v, tables, seq_lens, dims[-1])
    torch.testing.assert_close(out, _oracle(q, k, v, tables, seq_lens, dims[-1]), rtol=1e-5, atol=1e-5)


def test_torch_paged_decode_ignores_garbage_past_each_length():
    """The pool is torch.empty: slots past a row's length (the tail of its last block, unused
    table entries) may hold NaN or Inf bits left by earlier allocations. They must not reach the
    output (SDPA alone lets a NaN key or value through its mask: the static decode path once
    emitted token 1 for every request after a long test session)."""
    q, k, v, tables, seq_lens = _paged_case(3, 8, 2, 16, 16, [5, 17, 40])
    want = paged_decode_torch(q, k, v, tables, seq_lens, 16)
    slots = (tables.long()[:, :, None] * 16 + torch.arange(16)).reshape(3, -1)
    for b, n in enumerate(seq_lens.tolist()):
        for bits in (float("nan"), float("inf")):
            k[slots[b, n:]], v[slots[b, n:]] = bits, bits
            got = paged_decode_torch(q, k, v, tables, seq_lens, 16)
            assert torch.equal(got[b], want[b]), (b, bits)
            torch.testing.assert_close(got[b], _oracle(q, k, v, tables, seq_lens, 16)[b], rtol=1e-5, atol=1e-5)


def _check_fused_store(lens, dtype=torch.float32, device="cpu"):
    """The attention launch that also stores the step's new K/V rows (k_new/v_new) equals
    store_kv then attention: the same output and pool, bit for bit (v_new a strided view, as the
    model's slice of the packed projection)."""
    from monobatch.kernels.paged_decode import paged_decode_triton, store_kv
    q, k, v, tables, seq_lens = _paged_case(len(lens), 32, 8, 64, 16, lens, dtype, device, seed=3)
    slots = torch.stack([tables[b, (n - 1) // 16].long() * 16 + (n - 1) % 16 for b, n in enumerate(lens)])
    new = torch.randn(len(lens), 24, 64, generator=torch.Generator().manual_seed(4)).to(device, dtype)
    k_new, v_new = new[:, :8].contiguous(), new[:, 16:]
    k1, v1 = k.clone(), v.clone()
    store_kv(k_new, v_new, k1, v1, slots)
    ref = paged_decode_triton(q, k1, v1, tables, seq_lens, 16)
    k2, v2 = k.clone(), v.clone()
    out = paged_decode_triton(q, k2, v2, tables, seq_lens, 16, k_new, v_new, slots)
    assert torch.equal(out, ref) and torch.equal(k2, k1) and torch.equal(v2, v1)
    # Padding rows of a captured batch: one key each, all in the same (scratch) slot, written by
    # several programs at once; each row still attends to its own new row (softmax over one key:
    # the output is that row's v, exactly), whichever write lands last.
    B = len(lens)
    pad_tables = tables[:1, :1].expand(B, tables.shape[1]).contiguous()
    pad_slots = torch.full((B,), int(tables[0, 0]) * 16, dtype=torch.int64, device=device)
    out = paged_decode_triton(q, k.clone(), v.clone(), pad_tables, torch.ones_like(seq_lens), 16, k_new, v_new, pad_slots)
    assert torch.equal(out, v_new.repeat_interleave(4, dim=1))


def _check_triton_interpreter() -> str:
    """The split-K kernel (partitions and their fused merge in one launch) against the oracle,
    run in a TRITON_INTERPRET=1 subprocess. Cases (partitions per (sequence, KV head) from
    num_splits with 16 "SMs"): B=3 with lengths 1 / 513 / 1100 (2 splits: one sequence with a
    single partition holding keys, written directly, and one past its length), B=1 with 1100
    keys (16 splits, 9 holding keys, 7 past the length: the merge skips them), B=2 with 5 / 70
    keys (one direct, one merged), B=16 (1 split), and G = 3 query heads per KV head (padded
    rows). Each case runs twice with the same counters: identical bits (the merge's order does
    not depend on the arrival order) and the counters are left zeroed for the next call."""
    from monobatch.kernels.paged_decode import num_splits, paged_decode_triton, store_kv
    cpu = torch.device("cpu")
    cases = [((3, 32, 8, 64, 16, [1, 513, 1100]), 2), ((1, 6, 2, 64, 16, [1100]), 16),
             ((2, 6, 2, 64, 16, [5, 70]), 2), ((16, 4, 2, 64, 16, [1, 3, 64, 65, 200, 7, 9, 100] * 2), 1)]
    for (*dims, lens), splits in cases:
        q, k, v, tables, seq_lens = _paged_case(*dims, lens)
        assert num_splits(dims[0], dims[2], tables.shape[1] * 16, cpu) == splits
        first = paged_decode_triton(q, k, v, tables, seq_lens, 16)
        torch.testing.assert_close(first, _oracle(q, k, v, tables, seq_lens, 16), rtol=1e-4, atol=1e-4)
        assert int(common.COUNTERS[cpu].abs().sum()) == 0  # reset by each merging program
        assert torch.equal(paged_decode_triton(q, k, v, tables, seq_lens, 16), first)
    kc, vc = torch.zeros(40, 2, 64), torch.zeros(40, 2, 64)
    kv = torch.randn(3, 6, 64)
    slots = torch.tensor([7, 0, 39])
    store_kv(kv[:, :2], kv[:, 4:], kc, vc, slots)
    assert torch.equal(kc[slots], kv[:, :2]) and torch.equal(vc[slots], kv[:, 4:])
    assert kc.abs().sum(-1).sum(-1).count_nonzero() == 3
    _check_fused_store([1, 70, 1100])
    return "ok"


def test_triton_kernel_in_interpreter():
    """:func:`_check_triton_interpreter` in a subprocess (the interpreter is chosen when Triton
    is imported). The interpreter runs programs one after another, so it checks the arithmetic
    and the counter protocol, not the memory ordering between concurrent programs."""
    run_in_triton_interpreter("test_decode_graphs", "_check_triton_interpreter")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_kernel_on_cuda(dtype):
    from monobatch.kernels.paged_decode import paged_decode_triton, triton_usable
    if not triton_usable(torch.device("cuda"), 64):
        pytest.skip("Triton not installed")
    for lens in ([1, 16, 17, 511, 512, 513], [8192], [300], [3000, 1, 9000]):
        case = _paged_case(len(lens), 32, 8, 64, 16, lens, dtype, "cuda")
        ref = _oracle(*(t.float() if t.is_floating_point() else t for t in case), 16)
        out = paged_decode_triton(*case, 16)
        torch.testing.assert_close(out.float(), ref, rtol=2e-2, atol=2e-2)
        for _ in range(3):  # the fused merge: same bits whichever partition finishes last
            assert torch.equal(paged_decode_triton(*case, 16), out)
        assert int(common.COUNTERS[case[0].device].abs().sum()) == 0  # left zeroed for the next call
        _check_fused_store(lens, dtype, "cuda")


try:  # for the slow writer below (the CUDA test; CPU-only installs have no Triton)
    import triton
    import triton.language as tl
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:
    triton = None

if triton is not None:

    @triton.jit
    def _now(z):
        # the GPU's nanosecond clock (%globaltimer), one value per element of z
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [z], dtype=tl.int64, is_pure=False,
                                         pack=1)

    @triton.jit
    def _slow_writer(SRC, DST, IDX, W, stride_d, ns, BLOCK: tl.constexpr):
        # Launched with PDL: lets the next grid launch at once, waits for the one before it, spins ns
        # nanoseconds, and only then copies row r of SRC ([R, W]) to row IDX[r] of DST (row stride
        # stride_d): a producer that writes late while the kernel after it already runs.
        r = tl.program_id(0)
        gdc_launch_dependents()
        gdc_wait()
        z = tl.zeros([1], tl.int32)
        t0 = tl.sum(_now(z), 0)
        t = t0
        while t - t0 < ns:
            t = tl.sum(_now(z), 0)
        offs = tl.arange(0, BLOCK)
        mask = offs < W
        row = tl.load(IDX + r).to(tl.int64)
        tl.store(DST + row * stride_d + offs, tl.load(SRC + r * W + offs, mask=mask), mask=mask)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
@pytest.mark.parametrize("store", [False, True])
def test_attention_waits_for_a_slow_writer(store):
    """The decode attention loads its lengths, block table and first key tile before its PDL wait
    (kernels/pdl.py's one exception): everything a kernel before it writes — the query, and the
    newest key and value row (in the pool, or as this launch's inputs with ``store``) — must be
    read after the wait. Two slow writers (PDL, triggering at once, spinning 50 µs before they
    write) put the real query and newest rows in place of stale ones while the attention has
    already launched; its output must equal the output on inputs written beforehand, bit for bit."""
    from monobatch.kernels import pdl
    from monobatch.kernels.paged_decode import paged_decode_triton, triton_usable
    dev = torch.device("cuda")
    if not triton_usable(dev, 64) or not pdl.enabled(dev):
        pytest.skip("needs Triton and PDL (Hopper, CUDA >= 12.3)")
    writer = _slow_writer
    lens = [1, 5, 17, 64, 300]
    q, k, v, tables, seq_lens = _paged_case(len(lens), 32, 8, 64, 16, lens, torch.bfloat16, "cuda", seed=5)
    B = len(lens)
    slots = torch.stack([tables[b, (n - 1) // 16].long() * 16 + (n - 1) % 16 for b, n in enumerate(lens)])
    g = torch.Generator().manual_seed(6)
    k_new, v_new = (torch.randn(B, 8, 64, generator=g).to(dev, torch.bfloat16) for _ in range(2))
    k[slots], v[slots] = k_new, v_new
    args = (k_new, v_new, slots) if store else ()
    want = paged_decode_triton(q, k.clone(), v.clone(), tables, seq_lens, 16, *args)
    stale = lambda t: torch.randn(t.shape, generator=g).to(dev, t.dtype)  # noqa: E731
    rows = torch.arange(B, device=dev)
    for W, BLOCK in ((3072, 4096), (2048, 2048), (512, 512)):  # compiled before the timed launches
        scratch = torch.empty(B, W, device=dev, dtype=torch.bfloat16)
        writer[(B,)](scratch, scratch, rows, W, W, 16, BLOCK=BLOCK, launch_pdl=True)  # (ns as specialized below)
    torch.cuda.synchronize()
    for _ in range(3):
        # the stale inputs made first (a copy from the host waits for the GPU); then every launch
        # queues behind a 100 ms GPU sleep (a kernel without PDL), so the attention launches while
        # the first writer still spins, whatever the host's pace; the sleep still running after the
        # last launch shows they queued
        q2, k2, v2 = stale(q), k.clone(), v.clone()
        k2[slots], v2[slots] = stale(k_new), stale(v_new)  # the newest rows stale in the pool too
        if store:  # the inputs: query, new key, new value in one buffer, one late copy
            late = torch.cat([q, k_new, v_new], dim=1).reshape(B, -1)
            buf = stale(late)
            q_in, k_in, v_in = (part for part in buf.view(B, 48, 64).split([32, 8, 8], dim=1))
        torch.cuda.synchronize()
        torch.cuda._sleep(200_000_000)
        slept = torch.cuda.Event()
        slept.record()
        if store:
            writer[(B,)](late, buf, rows, late.shape[1], buf.stride(0), 50_000, BLOCK=4096, launch_pdl=True)
            out = paged_decode_triton(q_in, k2, v2, tables, seq_lens, 16, k_in, v_in, slots)
        else:  # the query, then the pool's newest key and value rows (row = slot), each late
            writer[(B,)](q, q2, rows, q[0].numel(), q2.stride(0), 50_000, BLOCK=2048, launch_pdl=True)
            writer[(B,)](k_new, k2, slots, 512, k2.stride(0), 20_000, BLOCK=512, launch_pdl=True)
            writer[(B,)](v_new, v2, slots, 512, v2.stride(0), 20_000, BLOCK=512, launch_pdl=True)
            out = paged_decode_triton(q2, k2, v2, tables, seq_lens, 16)
        assert not slept.query(), "the launches did not queue behind the sleep"
        assert torch.equal(out, want)


def _run(scheduler, prompts, n=12):
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    reqs = [Request(f"r{i}", p, params, bypass_prefix_cache=True) for i, p in enumerate(prompts)]
    ids = {r.request_id: [] for r in reqs}
    for out in scheduler.run(reqs):
        ids[out.request_id] += out.token_ids
    return [ids[r.request_id] for r in reqs]


def assert_same_or_near_tie(loaded, prompts: dict, ref: dict, got: dict) -> None:
    """Each request's greedy tokens equal, or the first divergence is at a near-tie (top-2 margin
    < 1e-3 after the common prefix): in the fast mode the padded static step is a GEMM of more rows
    than the eager one, and the CPU BLAS sums by the row count (not batch-invariant, ADR 0002), so
    a near-tie may flip; one did in a full-suite run."""
    from monobatch.engine.engine import Engine

    for key, want in ref.items():
        have = got[key]
        i = next((j for j, (a, b) in enumerate(zip(want, have)) if a != b), None)
        if i is None:
            assert len(want) == len(have), key
            continue
        margin = Engine(loaded).top2_margin(prompts[key] + want[:i])
        assert margin < 1e-3, f"{key}: diverged at {i} with top-2 margin {margin}"


def test_static_decode_path_matches_eager(dequantized):
    """Three sequences crossing block boundaries, padded to a batch of 4: the static-buffer
    decode forward gives the eager path's tokens and writes the same KV (the padding row writes
    only the scratch block). On ``--weights dequant``: the path is under test, and on packed
    weights the two paths' float differences flip some of the GEMV's int16 roundings (KV ~5e-3
    apart; ADR 0006, "int16 activations")."""
    device = torch.device("cpu")
    prompts = [list(range(100, 100 + n)) for n in (5, 14, 30)]
    eager = BatchScheduler(Engine(dequantized, EngineConfig(max_model_len=256, kv_cache_memory=64 << 20)))
    static_engine = Engine(dequantized, EngineConfig(max_model_len=256, kv_cache_memory=64 << 20))
    static_engine.graphs = DecodeGraphs(static_engine.model, static_engine.kv, max_batch=4, capture=False)
    static = BatchScheduler(static_engine)
    assert static_engine.graphs.padded(3) == 4 and static_engine.kv.device == device
    for kv in (static_engine.kv, eager.engine.kv):  # the pools are torch.empty: blocks never written differ
        kv.cache.zero_()
    got, ref = _run(static, prompts), _run(eager, prompts)
    assert_same_or_near_tie(dequantized, dict(enumerate(prompts)), dict(enumerate(ref)), dict(enumerate(got)))
    assert static_engine.graphs.replays > 0
    # Same block allocation order on both sides: the pools hold the same K/V (not the scratch block),
    # up to float32 rounding: the padded step's projections are a GEMM of 4 rows, the eager step's of
    # 3, and the CPU BLAS picks its kernel (and summation order) by the row count. The bound is the
    # accumulation error of a K = 576 dot product in float32 (K * eps ~ 7e-5, relative), not 1e-5,
    # which a fresh clone once missed by 1.3e-5 (the fast mode is not batch-invariant; ADR 0002).
    used = static_engine.kv.pool.num_blocks * static_engine.kv.block_size
    torch.testing.assert_close(static_engine.kv.cache[:, :, :used], eager.engine.kv.cache[:, :, :used],
                               rtol=2e-4, atol=2e-4)
    assert static_engine.kv.usage().used_blocks == 0  # every sequence freed its blocks


def test_every_step_reads_the_rope_table(loaded, monkeypatch):
    """Prefill, eager decode and the static (graph) decode all gather RoPE from the table the
    Engine built: the on-the-fly formula is never called."""
    engine = Engine(loaded, EngineConfig(max_model_len=128, kv_cache_memory=32 << 20))
    engine.graphs = DecodeGraphs(engine.model, engine.kv, max_batch=4, capture=False)
    assert engine.model.rope.table.shape[0] >= 128

    def formula(*_):
        raise AssertionError("RoPE computed on the fly")
    monkeypatch.setattr(engine.model.rope, "_compute", formula)
    out = _run(BatchScheduler(engine), [list(range(100, 120)), list(range(50, 53))], n=6)
    assert all(len(ids) == 6 for ids in out) and engine.graphs.replays > 0


def test_graphs_only_where_they_apply(loaded):
    """CPU, dense storage, deterministic mode or --enforce-eager: no graphs (eager steps)."""
    for cfg in (EngineConfig(max_model_len=64), EngineConfig(max_model_len=64, kv_storage="dense"),
                EngineConfig(max_model_len=64, deterministic=True), EngineConfig(max_model_len=64, cuda_graphs=False)):
        assert Engine(loaded, cfg).graphs is None


def _staged(scheduler, waves, n=10):
    """Requests arriving in waves (each wave added after the previous one has decoded a few
    steps), so batches grow and shrink and several padded sizes are used; prefix cache on."""
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    ids: dict[str, list[int]] = {}
    for w, prompts in enumerate(waves):
        for i, p in enumerate(prompts):
            scheduler.add_request(Request(f"w{w}r{i}", p, params))
            ids[f"w{w}r{i}"] = []
        for _ in range(3):
            for out in scheduler.step():
                ids[out.request_id] += out.token_ids
    while scheduler.has_unfinished():
        for out in scheduler.step():
            ids[out.request_id] += out.token_ids
    return ids


def _waves():
    prefix = list(range(200, 240))  # 2.5 blocks: a hit adopts 2 and recomputes into the third (COW)
    return [[prefix + [1, 2, 3]], [prefix + [4, 5], list(range(300, 317))],
            [prefix + [6], list(range(400, 405)), prefix + [7, 8, 9, 10], list(range(500, 533))]]


def test_static_path_with_prefix_hits_and_changing_batches(loaded):
    """Batches of 1..5 rows (sizes 1, 2, 4, 8 padded), prefix-cache hits whose recomputed token
    lands in a shared block: the static-buffer path gives the eager path's tokens. Both pools start
    as NaN (a torch.empty pool holds whatever an earlier allocation left): no path may read a slot
    it did not write."""
    def make(static):
        engine = Engine(loaded, EngineConfig(max_model_len=128, kv_cache_memory=32 << 20))
        engine.kv.cache.fill_(float("nan"))
        if static:
            engine.graphs = DecodeGraphs(engine.model, engine.kv, max_batch=8, capture=False)
        return BatchScheduler(engine)
    static = make(True)
    got, ref = _staged(static, _waves()), _staged(make(False), _waves())
    prompts = {f"w{w}r{i}": p for w, wave in enumerate(_waves()) for i, p in enumerate(wave)}
    assert_same_or_near_tie(loaded, prompts, ref, got)
    assert static.stats().prefix_cache_hits > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
def test_captured_graphs_equal_static_eager():
    """On CUDA: replayed graphs give exactly the tokens of the same static-buffer forward run
    eagerly (same kernels, same shapes), with captures happening mid-run at several sizes."""
    from monobatch.loader.dummy import dummy_model
    loaded = dummy_model("smollm2-135m", "cuda")

    def run(capture):
        engine = Engine(loaded, EngineConfig(max_model_len=256, kv_cache_memory=256 << 20))
        assert engine.graphs is not None
        engine.graphs = DecodeGraphs(engine.model, engine.kv, max_batch=8, capture=capture)
        out = _staged(BatchScheduler(engine), _waves())
        return out, sorted(s for s, g in engine.graphs.graphs.items() if g is not None)
    graphed, sizes = run(True)
    assert sizes and len(sizes) >= 3
    assert graphed == run(False)[0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
def test_graphs_keep_the_rope_tables_they_read():
    """A second Engine on the same model with a longer context replaces the model's RoPE table;
    the first Engine's graphs keep the table they captured alive (they read it by address) and
    give the same tokens as before."""
    from monobatch.loader.dummy import dummy_model
    loaded = dummy_model("smollm2-135m", "cuda")
    first = BatchScheduler(Engine(loaded, EngineConfig(max_model_len=128, kv_cache_memory=64 << 20)))
    graphs = first.engine.graphs
    before = _run(first, [list(range(100, 110))], n=6)
    old = loaded.model.rope.table
    assert len(graphs.rope_tables) == 1 and graphs.rope_tables[0] is old
    Engine(loaded, EngineConfig(max_model_len=256, kv_cache_memory=64 << 20))
    assert loaded.model.rope.table is not old and loaded.model.rope.table.shape[0] == 256
    torch.empty_like(old).fill_(7)  # memory a freed table would have had
    assert _run(first, [list(range(100, 110))], n=6) == before
    _run(first, [list(range(100, 110)), list(range(7, 12))], n=4)  # a new size captures on the new table
    assert len(graphs.rope_tables) == 2 and graphs.rope_tables[0] is old


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA only")
def test_programmatic_dependent_launch_changes_no_bit(monkeypatch):
    """On CUDA: the graphs captured with PDL (kernels/pdl.py: each kernel starts before the
    previous one ends and waits for its activations) give the logits, bit for bit, and the tokens
    of the same graphs captured without it, through batches of changing sizes."""
    from monobatch.kernels import pdl
    from monobatch.loader.dummy import dummy_model
    if not pdl.enabled(torch.device("cuda")):
        pytest.skip("PDL needs a Hopper (sm_90) or newer GPU")
    loaded = dummy_model("smollm2-135m", "cuda")

    def run(on):
        monkeypatch.setattr(pdl, "ON", on)
        engine = Engine(loaded, EngineConfig(max_model_len=256, kv_cache_memory=256 << 20))
        engine.graphs = DecodeGraphs(engine.model, engine.kv, max_batch=8, capture=True)
        logits = []
        forward = engine.forward

        def keep(batch, *a, **k):
            out = forward(batch, *a, **k)
            logits.append(out.clone())
            return out
        engine.forward = keep
        return _staged(BatchScheduler(engine), _waves()), logits
    with_pdl, logits_pdl = run(True)
    without, logits_plain = run(False)
    assert with_pdl == without
    assert len(logits_pdl) == len(logits_plain) and all(torch.equal(a, b) for a, b in zip(logits_pdl, logits_plain))
