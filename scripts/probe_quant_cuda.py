"""The packed GEMV's FMA variant on the GPU (kernels/quant_gemm.py; ADR 0006, CUDA): one command
checks it, then times it beside the DOT variant and the dense bf16 GEMV.

(a) ``check``: at every llama-1b and llama-8b weight shape (monobatch.models.shapes; the down
    projection with the gated input, as the model runs it) for Q4_0, Q4_K, Q8_0 and Q6_K random
    packed weights, M = 1..FMA_MAX_M: the FMA GEMV's float32 output against torch's fp32 product of the
    same bf16 x (``silu_mul(gate, up)`` for the down projection) and the fp32 dequantized weights,
    one ``PASS``/``FAIL`` line a case with the largest absolute and relative error (relative to
    the reference's largest magnitude; the bound is tests/test_quant_cuda.py's ``FP32_TOL``), and
    the same for the default config without split-K.
(b) ``bench``: per layout (Q4_K: Q4/32, Q8_0: Q8/32, Q6_K: Q8/16), shape and M = 1, 2, 4, the
    microseconds of the FMA variant's default config, the DOT variant's and the dense bf16 GEMV
    (kernels/gemv.py, the ``--weights dequant`` path), each in a replayed CUDA graph; on llama-1b's
    shapes also a sweep of FMA configs (:data:`SWEEP`: tile, bytes a step, warps, stages, each with
    and without split-K). One JSON object a line: ``"bench"`` rows, and ``"best"`` rows (the
    fastest FMA config per layout, shape and M, with the rule's time) after each product's rows.
    ``--variant dp4a --only bench``: the DP4A GEMV instead (its rule, ``dp4a_config``, and on the
    sweep shapes :data:`DP4A_SWEEP`), for its table entries (``scripts/packed_gemv_table.py``); with
    ``PROBE_MS=1,4`` the M = 1 best only among the configs at most 3 % slower than the rule at 4
    rows (:func:`dp4a_best`: an entry serves every M).

The check and every compile the bench needs run first in ``--jobs`` processes (spawned, sharing
the GPU and Triton's on-disk cache: the ~150 kernel variants compile in parallel), then one process
times everything in turn, reading the compiled kernels from that cache.

Usage (repo root, one GPU; 4 min 20 s on an H200 before the qk and v products were added, 2 min
10 s with ``--sweep-shapes ''``; ``--variant dp4a --only bench`` at M = 1 on the H100: 72 s at
llama-8b for Q4_K and Q6_K, 42 s at llama-1b for three types)::

    PYTHONPATH=src python3 scripts/probe_quant_cuda.py > probe.txt

``--only check`` or ``--only bench`` runs one part; ``--shapes llama-1b`` fewer shapes. Without a
GPU (``TRITON_INTERPRET=1``, tiny shapes: ``--shapes tiny``) it runs the check and calls every
sweep config once, timing nothing (a smoke test of the script).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
from gguf import GGMLQuantizationType as T  # noqa: E402

from monobatch.kernels import gemv as dense_gemv, quant_gemm as Q  # noqa: E402
from monobatch.kernels.fused import silu_mul  # noqa: E402
from monobatch.models.shapes import SHAPES as MODELS  # noqa: E402
from monobatch.quant.random_packed import random_weight  # noqa: E402


def model_shapes(name: str) -> dict[str, tuple[int, int, bool]]:
    """``layer -> (N, K, gated)`` of a named model shape's products (fused qkv and gate/up)."""
    if name == "tiny":  # the interpreter smoke test: N off the tiles, K of whole Q4_K/Q6_K blocks
        return {"qkv": (40, 256, False), "down": (24, 512, True)}
    c = MODELS[name]
    h, inter = c["hidden_size"], c["intermediate_size"]
    hd = c.get("head_dim", h // c["num_attention_heads"])
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    # qk and v: a Q4_K_M file's fused qkv as two parts (llama.cpp gives attn_v more bits: Q6_K)
    return {"qkv": (q + 2 * kv, h, False), "qk": (q + kv, h, False), "v": (kv, h, False), "o": (h, q, False),
            "gate_up": (2 * inter, h, False), "down": (h, inter, True), "lm_head": (c["vocab_size"], h, False)}


CHECK_TYPES = (T.Q4_0, T.Q4_K, T.Q8_0, T.Q6_K)
#: one type a layout (Q4/32, Q8/32, Q8/16); PROBE_TYPES / PROBE_MS (comma lists) narrow a run (spawned
#: workers read them too)
BENCH_TYPES = tuple(T[n] for n in os.environ.get("PROBE_TYPES", "Q4_K,Q8_0,Q6_K").split(","))
CHECK_MS = tuple(range(1, Q.FMA_MAX_M + 1))
BENCH_MS = tuple(int(v) for v in os.environ.get("PROBE_MS", "1,2,4").split(","))
#: FMA configs swept on llama-1b's shapes: (BLOCK_N, BLOCK_K for Q4 (Q8: half, the same bytes a
#: step), num_warps, num_stages); each with SPLIT_K 1 and with K split until ~528 programs (runtime
#: arguments: no extra compile). (64, 512, 4, 3) is gemv_config's at M = 1, (32, 512, 4, 3) above.
SWEEP = [(64, 512, 4, 3), (32, 512, 4, 3), (128, 512, 4, 3), (64, 256, 4, 3), (16, 512, 4, 3), (64, 512, 4, 1),
         (64, 512, 8, 3), (128, 256, 8, 2), (32, 256, 2, 3), (128, 1024, 8, 3),
         # 2026-12-05, for llama-8b's long rows: unpipelined and two-stage tiles of more bytes a program
         (64, 512, 4, 2), (128, 512, 4, 1), (128, 512, 8, 1), (64, 1024, 8, 1), (32, 1024, 4, 1), (256, 256, 8, 1)]
#: PROBE_VARIANT=dp4a (``--variant dp4a``): the bench times the DP4A GEMV's rule (``dp4a_config``)
#: and, on the sweep shapes, these tiles (BLOCK_N, BLOCK_K for Q4 (Q8: half), num_warps,
#: num_stages), each at SPLIT_K 1, half, once and twice the rule's split (runtime arguments: no extra
#: compile): the tiles of at most quant_gemm.DP4A_MAX_BYTES weight bytes a thread a step, which
#: ptxas compiles without spills at 4 rows (a DP4A table entry serves every M <= FMA_MAX_M).
DP4A_SWEEP = [(64, 512, 4, 1), (32, 512, 4, 1), (32, 1024, 4, 1), (64, 512, 4, 2), (64, 256, 4, 1), (128, 512, 8, 1),
              (64, 1024, 8, 1), (16, 1024, 4, 1), (32, 512, 2, 1), (16, 512, 2, 1), (32, 2048, 8, 1), (64, 512, 8, 1),
              (128, 256, 4, 1), (256, 256, 8, 1),
              # pipelined (two or three stages; ptxas: no spills at 4 rows either)
              (64, 256, 4, 2), (32, 512, 4, 2), (64, 256, 4, 3), (32, 512, 4, 3), (128, 256, 8, 2), (64, 512, 8, 2),
              (32, 1024, 8, 2), (16, 512, 2, 2), (32, 256, 2, 2)]
#: PROBE_DP4A_TILES="BN,BK,WARPS,STAGES;..." replaces DP4A_SWEEP (a short sweep: a fresh machine
#: compiles every tile at every product's layout and row count, ~170 s for all of them at llama-8b)
if os.environ.get("PROBE_DP4A_TILES"):
    try:
        DP4A_SWEEP = [tuple(int(v) for v in t.split(",")) for t in os.environ["PROBE_DP4A_TILES"].split(";")
                      if t.strip()]
    except ValueError:
        DP4A_SWEEP = []
    if not DP4A_SWEEP or any(len(t) != 4 for t in DP4A_SWEEP):
        sys.exit("PROBE_DP4A_TILES: expected BN,BK,WARPS,STAGES tiles of integers separated by ';'")
VARIANT = os.environ.get("PROBE_VARIANT", "fma")
if VARIANT not in ("fma", "dp4a"):
    sys.exit(f"PROBE_VARIANT={VARIANT!r}: expected fma or dp4a")
#: do_bench_cudagraph's ``rep`` (ms a measurement; PROBE_REP)
REP = int(os.environ.get("PROBE_REP", "20"))
#: |y - reference| / max |reference| allowed for the float32 output (tests/test_quant_cuda.FP32_TOL).
FP32_TOL = 1e-4


def sweep_configs(N: int, K: int, M: int, layout) -> list[tuple]:
    if VARIANT == "dp4a":
        return dp4a_sweep_configs(N, K, layout)
    out = []
    for bn, bk4, warps, stages in SWEEP:
        if M > 1 and bn * bk4 > 32768:  # the larger tiles spill registers at M > 1 (sm_90 SASS)
            continue
        bk = max(32, min(bk4 if layout.q4 else bk4 // 2, Q._pow2(K)))
        wide = Q.wide_split(N, K, bn, bk)
        for splits in sorted({1, wide}):
            out.append((bn, bk, splits, warps, stages, False))
    return out


def dp4a_sweep_configs(N: int, K: int, layout) -> list[tuple]:
    """:data:`DP4A_SWEEP`'s configs for one product, each that quant_gemm.entry_problem takes."""
    out = []
    for bn, bk4, warps, stages in DP4A_SWEEP:
        bk = max(32, min(bk4 if layout.q4 else bk4 // 2, Q._pow2(K)))
        steps = -(-K // bk)
        wide = Q.wide_split(N, K, bn, bk)
        for splits in sorted({1, max(1, wide // 2), wide, min(steps, 2 * wide)}):
            cfg = (bn, bk, splits, warps, stages, Q.DP4A)
            if Q.entry_problem(Q.dp4a_key(N, K, layout), cfg) is None and cfg not in out:
                out.append(cfg)
    return out


def time_us(fn) -> float:
    """Median microseconds of a replayed CUDA graph of ``fn``."""
    import triton
    return triton.testing.do_bench_cudagraph(fn, rep=REP) * 1e3


def check_case(shape: str, layer: str, qtype: T, dev: torch.device, gen: torch.Generator) -> tuple[list[str], int]:
    """The check's lines for one (shape, layer, type), and how many failed."""
    N, K, gated = model_shapes(shape)[layer]
    part = random_weight(qtype, N, K, dev, gen).parts[0]
    args = (part,)
    w = Q.dequantize(*args)
    lines, fails = [], 0
    for M in CHECK_MS:
        dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
        x = torch.randn(M, 2 * K if gated else K, device=dev, generator=gen).to(dtype)
        ref = (silu_mul(x) if gated else x).float() @ w.T
        cfg = Q.gemv_config(N, K, M, part.layout, "fma")
        for c in (cfg, cfg[:2] + (1,) + cfg[3:]) if cfg[2] > 1 else (cfg,):
            y = Q.gemv(x, *args, config=c, gated=gated, out_dtype=torch.float32)
            err = (y - ref).abs().max().item()
            rel = err / max(ref.abs().max().item(), 1e-30)
            ok = rel <= FP32_TOL and bool(torch.isfinite(y).all())
            fails += not ok
            lines.append(f"{'PASS' if ok else 'FAIL'} {qtype.name} {shape} {layer} {N}x{K}{' gated' if gated else ''}"
                         f" M={M} cfg={list(c)} max_abs_err={err:.3e} rel={rel:.3e}")
    return lines, fails


def bench_configs(shape: str, N: int, K: int, M: int, layout, sweep_shapes: list[str]) -> dict[str, tuple]:
    """name -> config of what the bench times for one product (the first: the rule the best is
    measured against)."""
    if VARIANT == "dp4a":
        cfgs = {"dp4a": Q.gemv_config(N, K, M, layout, "dp4a", table=False)}
    else:
        cfgs = {"fma": Q.gemv_config(N, K, M, layout, "fma", table=False),  # the rule, whatever table is installed
                "dot": Q.gemv_config(N, K, M, layout, "dot")}
    if shape in sweep_shapes:
        cfgs.update({f"sweep{i}": c for i, c in enumerate(sweep_configs(N, K, M, layout))})
    return cfgs


def warm(task: tuple) -> tuple[list[str], int]:
    """One (shape, layer, type) in a worker process: its check cases (when ``do_check``), then every
    kernel the bench will time called once (no timing), so that Triton's compiles of the whole run
    happen in parallel and land in its on-disk cache, which the timing process then reads."""
    shape, layer, tname, do_check, sweep_shapes, dense_too = task
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # (cpu: TRITON_INTERPRET=1)
    gen = torch.Generator(device=dev).manual_seed(sum(map(ord, shape + layer + tname)))
    qtype = T[tname]
    out = check_case(shape, layer, qtype, dev, gen) if do_check else ([], 0)
    N, K, gated = model_shapes(shape)[layer]
    if qtype in BENCH_TYPES:
        part = random_weight(qtype, N, K, dev, gen).parts[0]
        args = (part,)
        for M in BENCH_MS:
            x = torch.randn(M, 2 * K if gated else K, device=dev, generator=gen)
            x = x.to(torch.bfloat16 if dev.type == "cuda" else torch.float32)
            for cfg in bench_configs(shape, N, K, M, part.layout, sweep_shapes).values():
                Q.gemv(x, *args, config=cfg, gated=gated)
            if dense_too:
                dense = torch.randn(N, K, device=dev, generator=gen).to(x.dtype)
                dense_gemv.gated_linear(x, dense) if gated else dense_gemv.linear(x, dense)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    return out


def check_and_warm(shapes: list[str], sweep_shapes: list[str], only: str | None, jobs: int) -> int:
    """The check (unless ``only`` is "bench") and the compiles of the bench, in ``jobs`` processes."""
    import multiprocessing as mp
    tasks = []
    for shape in shapes:
        for layer in model_shapes(shape):
            for i, t in enumerate(BENCH_TYPES if only == "bench" else dict.fromkeys(CHECK_TYPES + BENCH_TYPES)):
                if only == "check" and t not in CHECK_TYPES:
                    continue
                tasks.append((shape, layer, t.name, only != "bench" and t in CHECK_TYPES,
                              tuple(sweep_shapes) if only != "check" else (), only != "check" and i == 0))
    fails = cases = 0
    with mp.get_context("spawn").Pool(jobs) as pool:
        for lines, f in pool.imap(warm, tasks):
            for line in lines:
                print(line, flush=True)
            cases += len(lines)
            fails += f
    if only != "bench":
        print(f"check: {cases - fails} of {cases} PASS{'' if not fails else f', {fails} FAIL'}", flush=True)
    return fails


def check_inline(shapes: list[str], dev: torch.device, gen: torch.Generator) -> int:
    fails = cases = 0
    for shape in shapes:
        for layer in model_shapes(shape):
            for qtype in CHECK_TYPES:
                lines, f = check_case(shape, layer, qtype, dev, gen)
                for line in lines:
                    print(line, flush=True)
                cases += len(lines)
                fails += f
    print(f"check: {cases - fails} of {cases} PASS{'' if not fails else f', {fails} FAIL'}", flush=True)
    return fails


#: ``--variant dp4a`` with more than one M in PROBE_MS (e.g. ``1,4``): a DP4A entry serves every M <=
#: FMA_MAX_M, so the M = 1 best is taken among the configs at most this much slower than the rule at
#: each other timed M (the rule wins a product where none is).
DP4A_OTHER_M_SLACK = 0.03


def dp4a_best(times: dict[tuple, dict[int, float]], rule: tuple) -> tuple[tuple, dict[int, list]] | None:
    """The M = 1 best of one product's DP4A configs, ``times``: config -> {M: us}, among those within
    :data:`DP4A_OTHER_M_SLACK` of ``rule``'s time at every other M; with ``{M: [its us, the rule's]}``
    for those other Ms. None without an M = 1 time."""
    others = sorted(m for m in times.get(rule, {}) if m != 1)
    ok = [cfg for cfg, t in times.items() if 1 in t and all(
        m in t and t[m] <= times[rule][m] * (1 + DP4A_OTHER_M_SLACK) for m in others)]
    if not ok:
        return None
    cfg = min(ok, key=lambda c: times[c][1])
    return cfg, {m: [round(times[cfg][m], 2), round(times[rule][m], 2)] for m in others}


def bench(shapes: list[str], sweep_shapes: list[str], dev: torch.device, gen: torch.Generator) -> None:
    timing = dev.type == "cuda"
    best: dict[tuple, tuple[float, tuple]] = {}
    times: dict[tuple, dict[tuple, dict[int, float]]] = {}  # (type, layout, shape, layer) -> cfg -> {M: us}
    for shape in shapes:
        for layer, (N, K, gated) in model_shapes(shape).items():
            dense = torch.randn(N, K, device=dev, generator=gen).to(torch.bfloat16 if timing else torch.float32) * 0.02
            parts = {t: random_weight(t, N, K, dev, gen).parts[0] for t in BENCH_TYPES}
            for M in BENCH_MS:
                x = torch.randn(M, 2 * K if gated else K, device=dev, generator=gen)
                x = x.to(torch.bfloat16 if timing else torch.float32)
                row = {"bench": True, "shape": shape, "layer": layer, "N": N, "K": K, "M": M, "gated": gated}
                if timing:
                    fn = (lambda: dense_gemv.gated_linear(x, dense)) if gated else (lambda: dense_gemv.linear(x, dense))
                    row["dense_us"] = round(time_us(fn), 2)
                for t, part in parts.items():
                    args = (part,)
                    for name, cfg in bench_configs(shape, N, K, M, part.layout, sweep_shapes).items():
                        fn = lambda: Q.gemv(x, *args, config=cfg, gated=gated)  # noqa: E731
                        us = time_us(fn) if timing else (fn(), 0.0)[1]
                        if not name.startswith("sweep"):
                            row[f"{t.name}_{name}_cfg"] = list(cfg)
                            row[f"{t.name}_{name}_us"] = round(us, 2)
                            row[f"{t.name}_{name}_gbps"] = round(part.nbytes / max(us, 1e-9) / 1e3, 1)
                        if name != "dot":
                            key = (t.name, part.layout.name, shape, layer, M)
                            if key not in best or us < best[key][0]:
                                best[key] = (us, cfg, N, K, row.get(f"{t.name}_{VARIANT}_us"))
                            times.setdefault(key[:4], {}).setdefault(cfg, {})[M] = us
                print(json.dumps(row), flush=True)
            for key in [k for k in best if k[2:4] == (shape, layer)]:  # this product's best, as soon as known
                value, other_m = best.pop(key), None
                if VARIANT == "dp4a" and key[4] == 1 and len(BENCH_MS) > 1:
                    layout = next(p.layout for t, p in parts.items() if t.name == key[0])
                    picked = dp4a_best(times[key[:4]], Q.dp4a_config(N, K, layout))  # (the rule)
                    if picked is not None:
                        cfg, other_m = picked
                        value = (times[key[:4]][cfg][1], cfg, *value[2:])
                _print_best(key, value, other_m)
            for key in [k for k in times if k[2:4] == (shape, layer)]:
                del times[key]
            del dense, parts
            if timing:
                torch.cuda.empty_cache()


def _print_best(key: tuple, value: tuple, other_m: dict | None = None) -> None:
    (tname, lname, shape, layer, M), (us, cfg, N, K, rule_us) = key, value
    row = {"best": True, "variant": VARIANT, "type": tname, "layout": lname, "shape": shape, "layer": layer,
           "M": M, "N": N, "K": K, "cfg": list(cfg), "us": round(us, 2), "rule_us": rule_us}
    if other_m is not None:  # dp4a: the pick's and the rule's us at the other Ms ({M: [pick, rule]})
        row["other_m_us"] = other_m
    print(json.dumps(row), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="llama-1b,llama-8b")
    p.add_argument("--sweep-shapes", default="llama-1b", help="shapes whose configs (FMA, or DP4A with --variant "
                   "dp4a) are swept ('' none)")
    p.add_argument("--only", choices=("check", "bench"))
    p.add_argument("--jobs", type=int, default=8, help="processes for the check and the compiles (GPU)")
    p.add_argument("--variant", choices=("fma", "dp4a"), help="the GEMV swept and timed (PROBE_VARIANT; default "
                   "fma); dp4a: its rule and DP4A_SWEEP, timed only (no check: tests/test_quant_cuda.py's dp4a tests)")
    ns = p.parse_args()
    global VARIANT
    if ns.variant:
        os.environ["PROBE_VARIANT"] = VARIANT = ns.variant  # (the spawned workers read the environment)
    if VARIANT == "dp4a" and ns.only != "bench":
        p.error("--variant dp4a times only: add --only bench")
    if VARIANT == "dp4a" and max(BENCH_MS) > Q.FMA_MAX_M:
        p.error(f"--variant dp4a: PROBE_MS up to {Q.FMA_MAX_M} (the DP4A GEMV's rows)")
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    dev = torch.device("cpu" if interpreted else "cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    shapes = ns.shapes.split(",")
    sweep_shapes = [s for s in ns.sweep_shapes.split(",") if s] if not interpreted else shapes
    print(f"# MONOBATCH_PACKED_GEMV={Q.VARIANT} FMA_MAX_M={Q.FMA_MAX_M} FMA_DEFAULT_M={Q.FMA_DEFAULT_M} device={dev}"
          f"{' ' + torch.cuda.get_device_name(dev) if dev.type == 'cuda' else ''}", flush=True)
    if interpreted and ns.jobs <= 1:
        fails = 0 if ns.only == "bench" else check_inline(shapes, dev, gen)
    else:
        fails = check_and_warm(shapes, sweep_shapes, ns.only, ns.jobs)
    if ns.only != "check":
        bench(shapes, sweep_shapes, dev, gen)
    return 1 if fails else 0


if __name__ == "__main__":
    sys.exit(main())
