"""Tune the Triton skinny GEMM (:mod:`monobatch.kernels.gemv`) against cuBLAS on this GPU.

For the decode linears of llama-1b, smollm2-135m and llama-8b (the LM heads with float32
output) and M = 1, 2, 4, 8, 16 rows it sweeps (BLOCK_N, BLOCK_K, SPLIT_K, num_warps,
num_stages, DOT), times every config as one CUDA graph of back-to-back calls (launch gaps as in
the decode graphs), each call on its own copy of the weight (copies together >= 4x the L2, so
every call reads its weight from HBM, as in a real decode step: >= 50 calls, up to 400 for small
weights), checks each against a float64 product (and a second run for identical bits), and times
F.linear / torch.mm(out_dtype=float32) the same way. bf16 only. About 3600 timed configs and 180
compiled kernels (--quick: 1100 and 50); estimated 2-3 minutes on an H200.

    PYTHONPATH=src python3 scripts/tune_gemv.py [--quick] [--json OUT.json] [--jobs 14]

Prints (a) a table: shape, M, cuBLAS us, best Triton us, GB/s (weight + x + y bytes over the
time), % of --peak-tbs, speedup, config; (b) the ``CONFIGS`` dict literal for gemv.py (None
where cuBLAS was not beaten by 2 %: :func:`monobatch.kernels.gemv.linear` then calls cuBLAS).
Kernels are compiled first in ``--jobs`` processes (Triton's disk cache then serves them).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing
import sys
import time

import torch
import torch.nn.functional as F

SHAPES = {  # model: {linear: (N, K)}; N = out features
    "llama-1b": {"qkv": (3072, 2048), "o": (2048, 2048), "gate_up": (16384, 2048), "down": (2048, 8192),
                 "lm_head": (49152, 2048)},
    "smollm2-135m": {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536),
                     "lm_head": (49152, 576)},
    "llama-8b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
}
MS = (1, 2, 4, 8, 16)
SPLITS = (1, 2, 4, 8)
DTYPE = torch.bfloat16
DEVICE = "cuda"


def base_configs(mb: int, quick: bool) -> list[tuple]:
    """(BLOCK_N, BLOCK_K, 1, num_warps, num_stages, DOT) worth trying for M bucket ``mb``.
    FMA (M <= 4): 8..64 W elements a thread, at most 64 fp32 accumulators a thread. DOT (M >= 2):
    the pipelined tiles must fit in shared memory (<= 160 KB)."""
    out = []
    if mb <= 4:
        bns, bks, warps = ((8, 16) if mb < 4 else (4, 8), (256, 512), (4,)) if quick else \
            ((4, 8, 16), (256, 512, 1024), (4, 8))
        for bn in bns:
            for bk in bks:
                for w in warps:
                    per_thread = bn * bk // (32 * w)
                    if 8 <= per_thread and mb * per_thread <= 64:
                        out += [(bn, bk, 1, w, s, False) for s in (1, 3)]
    if mb >= 2:
        bns, bks, stages = ((32, 64), (128, 256), (3,)) if quick else ((16, 32, 64), (128, 256, 512), (3, 4))
        for bn in bns:
            for bk in bks:
                out += [(bn, bk, 1, 4, s, True) for s in stages if s * (bn + 16) * bk * 2 <= 160 * 1024]
    return out


def candidates(N: int, K: int, mb: int, quick: bool, sms: int) -> list[tuple]:
    """Base configs times the split-K counts that change the slicing and keep <= 4 programs/SM."""
    from monobatch.kernels.gemv import slices
    out = []
    for bn, bk, _, w, s, dot in base_configs(mb, quick):
        if bk > max(128, 1 << (K - 1).bit_length()):
            continue  # a block longer than K (rounded up) only adds masked lanes
        tiles, seen = -(-N // bn), set()
        for sp in SPLITS:
            eff = slices(K, bk, sp)[1]
            if eff not in seen and (eff == 1 or tiles * eff <= 4 * sms):
                seen.add(eff)
                out.append((bn, bk, eff, w, s, dot))
    return out


def variant(M: int, cfg: tuple, out_f32: bool) -> tuple:
    """What selects a compiled kernel: rows padded (16 for DOT), config less SPLIT_K, output type."""
    return (16 if cfg[5] else 1 << (M - 1).bit_length(), (cfg[0], cfg[1], 1) + tuple(cfg[3:]), out_f32)


def _compile(task) -> str | None:
    """Worker: compile one kernel variant by running it on a stand-in shape (N, K multiples of
    16 like the model's, so the specialization and Triton's disk-cache key match)."""
    mb, cfg, out_f32 = task
    try:
        from monobatch.kernels.gemv import gemv
        x = torch.zeros(mb, 2048, dtype=DTYPE, device="cuda")
        w = torch.zeros(256, 2048, dtype=DTYPE, device="cuda")
        gemv(x, w, out_dtype=torch.float32 if out_f32 else None, config=cfg)
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - reported, the config is skipped later
        return f"{cfg}: {type(e).__name__}: {str(e)[:200]}"
    return None


_GRAPH: dict = {}  # one capture stream for all the (sequential) graphs; each graph its own memory pool


def graph_us(call, n_calls: int, reps: int) -> float:
    """Median microseconds per call of ``call(i)``, i = 0..n_calls-1 captured in one CUDA graph,
    over ``reps`` replays."""
    if not _GRAPH:
        _GRAPH.update(stream=torch.cuda.Stream())
    g, stream = torch.cuda.CUDAGraph(), _GRAPH["stream"]
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # capture_begin directly: torch.cuda.graph() adds gc + empty_cache each time
        call(0)  # warm-up on the capture stream (cuBLAS workspace)
        g.capture_begin()  # a shared pool trips an allocator assert once graphs are freed
        try:
            for i in range(n_calls):
                call(i)
        finally:
            g.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    g.replay()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in events:
        a.record()
        g.replay()
        b.record()
    torch.cuda.synchronize()
    del g
    ts = sorted(a.elapsed_time(b) * 1e3 / n_calls for a, b in events)
    return ts[len(ts) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="a smaller config grid")
    ap.add_argument("--json", help="write all results here")
    ap.add_argument("--jobs", type=int, default=min(14, multiprocessing.cpu_count()),
                    help="processes compiling the kernels up front (0: compile while sweeping)")
    ap.add_argument("--models", default=",".join(SHAPES), help="comma-separated subset of " + ",".join(SHAPES))
    ap.add_argument("--ms", default=",".join(map(str, MS)), help="row counts M")
    ap.add_argument("--calls", type=int, default=50, help="calls per graph (more for small weights, see above)")
    ap.add_argument("--reps", type=int, default=3, help="graph replays per config (median)")
    ap.add_argument("--peak-tbs", type=float, default=4.8, help="HBM bandwidth for the %% column")
    ns = ap.parse_args()
    t0 = time.time()
    from monobatch.kernels import gemv as G
    if G.triton is None or not torch.cuda.is_available():
        sys.exit("needs CUDA and Triton")
    props = torch.cuda.get_device_properties(0)
    sms, l2 = props.multi_processor_count, getattr(props, "L2_cache_size", 50 << 20) or 50 << 20
    torch.backends.cuda.matmul.allow_tf32 = False  # an exact reference
    ms = [int(m) for m in ns.ms.split(",")]
    cases = [(model, name, N, K, M, name == "lm_head") for model in ns.models.split(",")
             for name, (N, K) in SHAPES[model].items() for M in ms]
    cands = {(N, K, M): candidates(N, K, G._pow2(M), ns.quick, sms) for _, _, N, K, M, _ in cases}

    # 1. compile every variant once, in parallel (variant = everything but N, K, M, SPLIT_K)
    tasks = sorted({variant(M, c, f32) for _, _, N, K, M, f32 in cases for c in cands[N, K, M]}, key=str)
    broken = set()
    if ns.jobs > 0:
        try:
            with cf.ProcessPoolExecutor(ns.jobs, mp_context=multiprocessing.get_context("spawn")) as ex:
                for task, err in zip(tasks, ex.map(_compile, tasks)):
                    if err:
                        broken.add(task)
                        print("compile failed:", task, err, file=sys.stderr)
        except Exception as e:  # noqa: BLE001 - a broken pool: compile while sweeping instead
            print(f"# parallel compile failed ({type(e).__name__}: {e}); compiling in the sweep", file=sys.stderr)
    print(f"# {len(tasks)} kernel variants compiled in {time.time() - t0:.0f} s, {ns.jobs} processes", file=sys.stderr)

    # 2. sweep
    results, table = [], {}
    for model, name, N, K, M, f32 in cases:
        out_dtype = torch.float32 if f32 else None
        wbytes = N * K * 2
        copies = max(2, min(400, -(-4 * l2 // wbytes)))
        n_calls = max(ns.calls, copies)
        g = torch.Generator(device=DEVICE).manual_seed(0)
        ws = torch.randn(copies, N, K, generator=g, device=DEVICE, dtype=DTYPE)
        x = torch.randn(M, K, generator=g, device=DEVICE, dtype=DTYPE)
        exact = (x.double() @ ws[0].double().t()).float()
        scale = exact.abs().max().item()
        tol = 1e-4 if f32 else 1e-2
        if f32:
            try:
                torch.mm(x, ws[0].t(), out_dtype=torch.float32)
                ref_call = lambda i: torch.mm(x, ws[i % copies].t(), out_dtype=torch.float32)  # noqa: E731
            except (TypeError, RuntimeError):
                ref_call = lambda i: F.linear(x, ws[i % copies]).float()  # noqa: E731
        else:
            ref_call = lambda i: F.linear(x, ws[i % copies])  # noqa: E731
        ref_call(0)
        cublas = graph_us(ref_call, n_calls, ns.reps)
        timed, failed = [], []
        for cfg in cands[N, K, M]:
            if variant(M, cfg, f32) in broken:
                continue
            try:
                y = G.gemv(x, ws[0], out_dtype=out_dtype, config=cfg)
                err = (y.float() - exact).abs().max().item() / scale
                if not err <= tol or not torch.equal(y, G.gemv(x, ws[0], out_dtype=out_dtype, config=cfg)):
                    failed.append((cfg, f"rel err {err:.2e}" if not err <= tol else "bits differ between runs"))
                    continue
                timed.append((graph_us(lambda i: G.gemv(x, ws[i % copies], out_dtype=out_dtype, config=cfg),
                                       n_calls, ns.reps), cfg, err))
            except Exception as e:  # noqa: BLE001
                failed.append((cfg, f"{type(e).__name__}: {str(e)[:200]}"))
        timed.sort(key=lambda t: t[0])
        if failed:
            print(f"# {model} {name} M={M}: {len(failed)} configs failed, e.g. {failed[0]}", file=sys.stderr)
        best = None
        if timed:  # re-time the winner and cuBLAS with more replays
            cfg = timed[0][1]
            best = graph_us(lambda i: G.gemv(x, ws[i % copies], out_dtype=out_dtype, config=cfg), n_calls, 3 * ns.reps)
            cublas = min(cublas, graph_us(ref_call, n_calls, 3 * ns.reps))
        nbytes = wbytes + M * K * 2 + M * N * (4 if f32 else 2)
        key = (N, K, G._pow2(M), "bfloat16")
        win = best is not None and best < 0.98 * cublas
        note = f"{model} {name} M={M}: {best or 0:.1f} us vs cuBLAS {cublas:.1f} us"
        table.setdefault(key, (timed[0][1] if win else None, note))
        results.append(dict(model=model, linear=name, N=N, K=K, M=M, out="float32" if f32 else "bfloat16",
                            cublas_us=cublas, triton_us=best, config=timed[0][1] if timed else None,
                            max_rel_err=timed[0][2] if timed else None, calls_per_graph=n_calls, weight_copies=copies,
                            gbps=nbytes / best / 1e3 if best else None, speedup=cublas / best if best else None,
                            top=[(c, t) for t, c, _ in timed[:8]], n_configs=len(cands[N, K, M]), failed=failed))
        print(f"# {time.time() - t0:5.0f} s  {model:13s} {name:8s} M={M:<2d} {len(timed)} configs", file=sys.stderr)
        del ws, x, exact

    # 3. report
    print(f"{'model':13s} {'linear':8s} {'N x K':>12s} {'M':>3s} {'cuBLAS us':>9s} {'Triton us':>9s} {'GB/s':>7s} "
          f"{'% peak':>6s} {'speedup':>7s}  config (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages, DOT)")
    for r in results:
        t = r["triton_us"]
        print(f"{r['model']:13s} {r['linear']:8s} {r['N']:>5d} x {r['K']:<5d} {r['M']:>3d} {r['cublas_us']:9.2f} "
              + (f"{t:9.2f} {r['gbps']:7.0f} {r['gbps'] / ns.peak_tbs / 10:6.1f} {r['speedup']:7.2f}  {r['config']}"
                 if t else f"{'-':>9s}"))
    print("\nCONFIGS: dict[tuple[int, int, int, str], tuple[int, int, int, int, int, bool] | None] = {")
    for key, (cfg, note) in table.items():
        print(f'    ({key[0]}, {key[1]}, {key[2]}, "{key[3]}"): {cfg!r},  # {note}')
    print("}")
    print(f"# total {time.time() - t0:.0f} s", file=sys.stderr)
    if ns.json:
        with open(ns.json, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name(0), torch=torch.__version__, triton=G.triton.__version__,
                           sms=sms, l2_bytes=l2, quick=ns.quick, results=results,
                           configs={",".join(map(str, k)): v for k, (v, _) in table.items()}), f, indent=1)


if __name__ == "__main__":
    main()
