"""Decode attention timed alone on the GPU: the default mode's paged split-K kernel
(kernels/paged_decode.py, with the step's K/V store folded in, as the decode graphs run it) and the
deterministic mode's varlen kernel on decode rows (kernels/varlen_attention.py, fixed KV split),
one JSON object a line on stdout.

Each case is ``--layers`` launches (one per layer, each its own pool, as a model's step) captured in
one CUDA graph and replayed, so launch overhead is the graph's; ``us`` is the time of one launch
(replay time / layers). Each variant runs in a fresh process with its environment (the kernels'
knobs are read at import: ``MONOBATCH_DECODE_BLOCK_N``, ``_MIN_PART``, ``_STAGES``, ``_WARPS``,
``_SPLITS``; ``MONOBATCH_VARLEN_BLOCK_N``, ``_WARPS``, ``_STAGES``, ``MONOBATCH_DET_SPLIT``), and each
kernel's output (an eager call before the capture) is compared with the torch reference in fp32
(``err``: the largest absolute difference; ``ok``: within :data:`TOL`). A variant that fails or
runs past 300 s prints an ``error`` line and the sweep goes on.

Caveat: the 16 pools (8 MiB at 256 keys, 32 MiB at 1,024) stay in the H200's ~50 MB L2 across
replays, where a model's step streams its weights between two attention launches; the times are
the kernel's with warm keys, not its share of a step.

Usage (repo root, a GPU)::

    python3 scripts/bench_decode_attention.py [--batch 1,8] [--ctx 256,1024,8192] \
        [--variant "name:ENV=V ENV=V" ...] > attention.jsonl

Without ``--variant`` it runs the built-in sweep (:data:`SWEEP`). Shape: llama-1b's attention
(32 query heads, 8 KV heads, head dim 64, bf16, 16-token blocks).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

#: name -> environment of a variant (the kernels' defaults when empty).
SWEEP = {
    "base": "",
    "warps2": "MONOBATCH_DECODE_WARPS=2 MONOBATCH_VARLEN_WARPS=2",
    "warps8": "MONOBATCH_DECODE_WARPS=8 MONOBATCH_VARLEN_WARPS=8",
    "stages1": "MONOBATCH_DECODE_STAGES=1 MONOBATCH_VARLEN_STAGES=1",
    "bn32": "MONOBATCH_DECODE_BLOCK_N=32",
    "bn128": "MONOBATCH_DECODE_BLOCK_N=128 MONOBATCH_VARLEN_BLOCK_N=128",
    "bn128w8": "MONOBATCH_DECODE_BLOCK_N=128 MONOBATCH_DECODE_WARPS=8 MONOBATCH_VARLEN_BLOCK_N=128 MONOBATCH_VARLEN_WARPS=8",
    "bn256": "MONOBATCH_DECODE_BLOCK_N=256",
    "bn256w8": "MONOBATCH_DECODE_BLOCK_N=256 MONOBATCH_DECODE_WARPS=8",
    "bn256w8s1": "MONOBATCH_DECODE_BLOCK_N=256 MONOBATCH_DECODE_WARPS=8 MONOBATCH_DECODE_STAGES=1",
    "waves4": "MONOBATCH_DECODE_SPLITS=64,4",
    "det64": "MONOBATCH_DET_SPLIT=64,32",
    "det128w1": "MONOBATCH_DET_SPLIT=128,32,1",
}
N_Q, N_KV, HD, BS = 32, 8, 64, 16
#: Largest absolute difference from the fp32 reference accepted for bf16 inputs (``ok``).
TOL = 1e-2


def child(batch: list[int], ctxs: list[int], layers: int, reps: int) -> None:
    """Time every (batch, context) case of both kernels in this process; print JSON lines."""
    import torch

    from monobatch.kernels import paged_decode, varlen_attention

    dev = torch.device("cuda")
    torch.manual_seed(0)
    for B in batch:
        for ctx in ctxs:
            nb = -(-ctx // BS)
            pools = [(torch.randn(B * nb * BS, N_KV, HD, device=dev, dtype=torch.bfloat16),
                      torch.randn(B * nb * BS, N_KV, HD, device=dev, dtype=torch.bfloat16)) for _ in range(layers)]
            tables = torch.randperm(B * nb, device=dev, dtype=torch.int64).view(B, nb).to(torch.int32)
            lens = torch.full((B,), ctx, device=dev, dtype=torch.int32)
            last = ctx - 1
            slots = (tables[:, last // BS].long() * BS + last % BS)
            q = torch.randn(B, N_Q, HD, device=dev, dtype=torch.bfloat16)
            k_new = torch.randn(B, N_KV, HD, device=dev, dtype=torch.bfloat16)
            v_new = torch.randn(B, N_KV, HD, device=dev, dtype=torch.bfloat16)
            for k, v in pools:  # the reference reads the new rows from the pool
                k[slots] = k_new
                v[slots] = v_new
            ref = paged_decode.paged_decode_torch(q.float(), pools[0][0].float(), pools[0][1].float(), tables, lens, BS)
            chunks = [(b, 1, ctx - 1) for b in range(B)]
            meta = varlen_attention.build_meta(chunks, tables.tolist(), varlen_attention.tokens_per_tile(N_Q, N_KV, True),
                                               dev, fixed_split=True)
            runs = {
                "paged": lambda k, v: paged_decode.paged_decode_triton(q, k, v, tables, lens, BS, k_new, v_new, slots),
                "det_varlen": lambda k, v: varlen_attention.varlen_paged_attention(q, k, v, meta, BS),
            }
            for name, fn in runs.items():
                err = (fn(*pools[0]).float() - ref).abs().max().item()
                stream = torch.cuda.Stream()
                stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(stream):
                    for k, v in pools:
                        fn(k, v)
                torch.cuda.current_stream().wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for k, v in pools:
                        fn(k, v)
                for _ in range(10):
                    graph.replay()
                times = []
                for _ in range(5):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(reps):
                        graph.replay()
                    end.record()
                    torch.cuda.synchronize()
                    times.append(start.elapsed_time(end) * 1000 / (reps * layers))
                times.sort()
                print(json.dumps({"variant": os.environ.get("BENCH_VARIANT", "base"), "kernel": name, "batch": B,
                                  "ctx": ctx, "us": round(times[len(times) // 2], 3), "us_min": round(times[0], 3),
                                  "err": err, "ok": err <= TOL}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", default="1")
    ap.add_argument("--ctx", default="256,1024,8192")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--variant", action="append", help="NAME:ENV=V ENV=V (space-separated; repeatable); default: the built-in sweep")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    batch = [int(b) for b in args.batch.split(",")]
    ctxs = [int(c) for c in args.ctx.split(",")]
    if args.child:
        child(batch, ctxs, args.layers, args.reps)
        return
    variants = dict(v.split(":", 1) for v in args.variant) if args.variant else SWEEP
    for name, env_text in variants.items():
        env = dict(os.environ, BENCH_VARIANT=name)
        env.update(kv.split("=", 1) for kv in env_text.split())
        try:
            proc = subprocess.run([sys.executable, __file__, "--child", "--batch", args.batch, "--ctx", args.ctx,
                                   "--layers", str(args.layers), "--reps", str(args.reps)], env=env,
                                  capture_output=True, text=True, timeout=300)
        except subprocess.TimeoutExpired as e:
            sys.stdout.write(e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or "")
            print(json.dumps({"variant": name, "error": "timed out after 300 s"}), flush=True)
            continue
        sys.stdout.write(proc.stdout)
        if proc.returncode:
            print(json.dumps({"variant": name, "error": proc.stderr[-600:]}), flush=True)


if __name__ == "__main__":
    main()
