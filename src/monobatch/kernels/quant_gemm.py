"""Dequantizing matmuls on CUDA (Triton) over the packed layouts of :mod:`monobatch.quant.formats`.

``y = x W^T (+ b)`` where W ``[N, K]`` is held packed (ADR 0006): **Q4** ``qs`` uint8 ``[N, K/2]``
(in each 32-column group byte j = column j low nibble | column j+16 high nibble), or **Q8** ``qs``
int8 ``[N, K]``; per group of G columns (32, or 16 for Q6_K) a scale and a min, ``w = q * scale +
min``, held as the layout's codes say (:mod:`monobatch.quant.formats`): float32 or float16
``[N, K/G]`` (DIRECT); the K-quants' integer factors ``[N, K/G]`` under a float16 ``(d, dmin)``
pair per 256 columns, ``sup`` ``[N, K/256, 2]`` (FACTORED); no min tensor where it is -0.0 (ZERO)
or ``-8 scale`` (NEG8). Every kernel forms a group's float32 scale and min in registers
(``_group_scales``; exact products, so the bits of the float32 layout). The functions take a
packed part ``w``: any object with ``qs``, ``scale``, ``minimum``, ``sup`` and ``layout``
(:class:`~monobatch.quant.packed.PackedPart`). The GEMV and the tiled GEMM never materialise the weight: each program
loads a tile of the packed bytes and its groups' scales, dequantizes it in registers and
multiplies it at once (from :data:`DEQUANT_MIN_M` rows a temporary is made instead, below). Every GGUF
type the CPU path packs (Q4_0, Q4_1, Q4_K -> Q4/32; Q8_0, Q5_0, Q5_K -> Q8/32; Q6_K -> Q8/16) runs
through these kernels; the layout's (Q4, G, scale and min codes) are compile-time constants.

A Q4 tile is used in its byte order, not its column order: byte p of a row holds columns
``c = (p // 16) * 32 + p % 16`` (low nibble) and ``c + 16`` (high nibble), so the kernels load the
activations at those two column sets and sum the two halves' products (the sum's order is fixed
by the tile, like any other). No shuffle of nibbles into column order is needed.

* :func:`gemv` (decode rows, M <= :data:`MAX_M`), three variants (:func:`gemv_config` picks;
  ``MONOBATCH_PACKED_GEMV=fma|dot|dp4a``, read at import, :data:`VARIANT`, is the A/B switch):

  - **FMA** (M <= :data:`FMA_MAX_M` = 4; with ``MONOBATCH_PACKED_GEMV=fma`` taken for M <=
    :data:`FMA_DEFAULT_M` = 2; CUDA cores; ADR 0006, "the FMA GEMV as integer-weighted group
    sums"): the packed bytes are read as int32 words (``QW``: ``qs.view(torch.int32)``), a K step's ``[BLOCK_N, NG * GW]`` words in
    16-byte loads (GW: a group's words). Each 4- or 8-bit field becomes a float with one masked
    AND of ``w | 0x4B000000`` (2^23's exponent) and one exact subtract — the field's integer times
    2^offset; x at the field's column is taken times 2^-offset, so every product is ``q * x``
    exactly — and a group's scale and min apply once: ``acc += s * sum(q x) + m * sum(x)``, one
    ``[BLOCK_N, NG]`` fp32 accumulator a row of x (unrolled), reduced over NG after the K loop.
    No weight is rounded to bf16 (the results differ from the DOT and dequantized bf16 paths by
    the weights' bf16 rounding, closer to the fp32 product).
  - **DOT** (every M, 1..16; the default above FMA_MAX_M, with ``fma`` above FMA_DEFAULT_M): the
    ``[BLOCK_N, BLOCK_K]`` tile rounded to x's dtype (bf16: the dequant path's weights exactly,
    which are rounded to bf16 at load) times x^T padded to 16 columns on the tensor cores, fp32 accumulation.

  - **DP4A** (the default, ``MONOBATCH_PACKED_GEMV=dp4a``; every layout, Q4/32,
    Q8/32 and Q8/16, at M <= :data:`FMA_MAX_M`; M above it the DOT variant; ADR 0006, "CUDA: a dp4a
    GEMV"): llama.cpp's MMVQ scheme. Each program rounds the x columns of its K slice to int8
    per 32-column group whatever the weights' group (q8_1: ``d = amax / 127``,
    ``xi = x (127 / amax)`` rounded half away from zero, so ``|x - d xi| <= d / 2`` up to two
    float32 roundings; a NaN in a group makes its output NaN), every row on its own (one config
    for every M, so a row's bits should not depend on M or on the other rows: so in the
    interpreter and on the H100, ``test_dp4a_rows_cuda``; no extra launch, so the CUDA graphs
    are as before). Q4:
    the nibbles become unsigned bytes (``w & 0x0F0F0F0F``, ``(w >> 4) & 0x0F0F0F0F``) against x's
    words in the nibbles' column order, ``dp4a.u32.s32``; Q8: the int8 words as they are (4
    consecutive columns a word) against x's words in column order, ``dp4a.s32.s32``. ``dp4a``
    (4 byte products and their sum, one instruction) gives each weight group's exact int32
    ``sumi = sum q xi`` (Q8/16: two weight groups a x group, each its own sumi and scale times the
    x group's d); a weight group adds ``s d sumi + m d sum xi`` (scale s and min m from
    ``_group_scales``) to its float32 accumulator in a fixed order. At M = 1, ~1.6-2.2 SASS
    instructions a weight and row in the K loop against the FMA variant's ~4.3-5.7 (Q4_0 1.62 /
    4.30, Q4_K 2.09 / 4.66, Q8_0 1.66 / 5.12, Q5_K 2.23 / 5.67, Q6_K 1.93 / 5.41); its results
    differ from the FMA variant's by x's int8 rounding (~1e-2 of max |y|).

  :func:`gemv_pair` (``MONOBATCH_PACKED_GEMV_PAIR=1``, an A/B switch): a weight's two parts
  of other layouts (a Q4_K_M file's qkv) in one DP4A launch, each part's programs its own launch's.

  All three: split-K as :mod:`monobatch.kernels.gemv`'s (partials in a workspace, the last slice of a
  tile sums them in slice order: deterministic), and PDL (the first weight tile is loaded before
  :func:`monobatch.kernels.pdl.wait_prior`). One launch, no host sync, no data-dependent
  allocation: CUDA-graph capturable. A gated input (SwiGLU's down projection) is
  ``silu(gate) * up`` computed as it is loaded, with :func:`monobatch.kernels.fused.silu_mul`'s
  bits. The batch-invariant mode uses none of them (below).
* From :data:`DEQUANT_MIN_M` rows (prefill, batches; 16-bit activations): :func:`matmul`
  dequantizes the weight into a temporary (:func:`dequantized`) and multiplies it by cuBLAS
  (:func:`monobatch.kernels.gemv.linear`): the ``--weights dequant`` path's bits.
* :func:`gemm` (the batch-invariant mode, float32 activations, or rows below
  :data:`DEQUANT_MIN_M`): ``[BM, BN]`` output tiles, K walked in ascending ``BK`` steps; each step
  dequantizes a ``[BN, BK]`` tile of W in registers (rounded to x's dtype) and ``tl.dot``-s it
  with the x tile into one fp32 accumulator. No split-K.
* **Batch invariance** (``--deterministic``, :func:`monobatch.kernels.invariant_gemm.active`):
  :func:`matmul` sends every M, decode rows included, to :func:`gemm` with the one tile
  :data:`INVARIANT_TILE`, so a row's sum has the same order (same MMA steps over the same K
  tiles) whatever the batch holds and wherever the row sits in it.

* :func:`take`: the embedding lookup, gathered rows dequantized in one launch.

The packed integers become floats by the exact "magic number" trick (``2^23 + q`` has q as its
mantissa bits; subtracting ``2^23`` is exact), not by int-to-float instructions (a quarter of the
FMA rate on Hopper).

The configs are fixed functions of (N, K, M, layout) and the GPU model (:func:`gemv_config`,
:func:`gemm_config`), never timed at run time: the DOT GEMV's from one H200 sweep at M = 1
(``scripts/bench_packed_cuda.py --sweep``), the FMA GEMV's rule at M <= 2 from one H200 run of
``scripts/probe_quant_cuda.py`` (which checks the FMA GEMV at the model shapes and sweeps its
configs), the DP4A GEMV's rule the dp4a probe's guess (:func:`dp4a_config`); where the GPU's tuned
table lists a product (:func:`tuned_configs`, written from such a sweep: ``--variant dp4a`` for the
DP4A entries) the table's; the GEMM's untuned.
"""

from __future__ import annotations

import os
import re
import sys

import torch

from monobatch import env
from monobatch.kernels import fused, invariant_gemm, pdl
from monobatch.kernels.common import COUNTERS, counters, tl, triton
from monobatch.quant.formats import DIRECT, FACTORED, NEG8, Layout

if triton is not None:
    from monobatch.kernels.common import grouped_tile, split_k_store
    from monobatch.kernels.gemv import _load_x  # x, or SwiGLU's silu(gate) * up computed as it is loaded

#: Most rows the GEMV takes; more go to :func:`dequant_matmul` or the tiled GEMM (:func:`matmul`).
MAX_M = 16
#: Most rows the FMA variant of the GEMV takes (a config asking for it, or ``variant="fma"``).
FMA_MAX_M = 4
#: Most rows :func:`gemv_config` gives the FMA variant with ``MONOBATCH_PACKED_GEMV=fma`` (the
#: default, "dp4a", takes the DP4A variant up to FMA_MAX_M): on the H200 (2026-12-02,
#: ``scripts/probe_quant_cuda.py``) the earlier FMA kernel beat the DOT variant at M = 1 (1.1-2x)
#: and about tied at M = 2 for Q4; the 2026-12-03 kernel is 1.7-2.5x DOT at M = 1 (not yet timed
#: at M = 2..4, so the bound is kept).
FMA_DEFAULT_M = 2
#: ``MONOBATCH_PACKED_GEMV`` (read once, at import): ``dp4a`` (the default since 2026-12-05: the
#: DP4A variant for every layout at M <= :data:`FMA_MAX_M`, what ``fma`` picks above; faster than
#: the FMA variant end to end on the three Q4 files of the H100 lease, ADR 0006), ``fma`` (the FMA
#: variant for M <= FMA_DEFAULT_M, DOT above: no int8 rounding of the activations) or ``dot``
#: (the DOT variant for every M); the A/B switch.
VARIANT = env.choice("MONOBATCH_PACKED_GEMV", "dp4a", ("fma", "dot", "dp4a"))
#: The sixth element of a GEMV config naming the DP4A variant (False: FMA, True: DOT). An integer,
#: not a bool, so no FMA or DOT config can be taken for one (:func:`entry_problem` keeps a table's
#: FMA entries, ``M<M>`` keys, and DP4A entries, ``dp4a`` keys, apart by it).
DP4A = 2
#: Most weight bytes a thread loads a K step (BLOCK_N x BLOCK_K's bytes / threads) in a DP4A config
#: of the tuned table: Triton 3.6's sm_90 SASS of the kernel spills registers above it at 4 rows
#: (ptxas, 2026-12-05, one and two stages: 64 x 512 Q4 weights on 4 warps, 128 bytes a thread, none;
#: over it, 8-3,104 bytes of spills), and a DP4A entry serves every M <= FMA_MAX_M.
DP4A_MAX_BYTES = 128
#: The DP4A kernel's dp4a: PTX inline assembly when compiled, integer ops in the interpreter (which
#: runs no inline assembly; the same int32 results).
_DP4A_ASM = os.environ.get("TRITON_INTERPRET") != "1"
#: Tuned GEMV configs, per GPU model: ``kernels/configs/packed_gemv_<device name>.json`` (spaces
#: as ``_``; vLLM's per-device tables of fused-MoE configs are the model), written by
#: ``scripts/packed_gemv_table.py`` from a ``scripts/probe_quant_cuda.py`` sweep on that GPU. Its
#: ``configs`` map ``"<layout name> <N>x<K> M<M>"`` to an FMA config (:func:`table_key`) and
#: ``"<layout name> <N>x<K> dp4a"`` to a DP4A config for every M <= :data:`FMA_MAX_M`
#: (:func:`dp4a_key`: one config whatever M, so a row's bits never depend on the rows beside it);
#: a product the table lacks takes the rule below. ``MONOBATCH_PACKED_GEMV_CONFIGS``: another
#: table file, or ``""`` for none (the rule alone: the A/B switch and the probe's baseline).
TABLE_ENV = "MONOBATCH_PACKED_GEMV_CONFIGS"
_TABLES: dict[str, dict[str, tuple]] = {}


def table_path(device_name: str) -> str | None:
    """The tuned-config file :func:`gemv_config` reads on a GPU named ``device_name`` (see
    :data:`TABLE_ENV`): the environment's, else the packaged one, or None where neither is."""
    if TABLE_ENV in os.environ:
        return os.environ[TABLE_ENV] or None
    path = os.path.join(os.path.dirname(__file__), "configs", f"packed_gemv_{device_name.replace(' ', '_')}.json")
    return path if os.path.exists(path) else None


def tuned_configs(device: torch.device | None = None) -> dict[str, tuple]:
    """The tuned GEMV configs of ``device``'s GPU model (default: the current CUDA device;
    :data:`TABLE_ENV`), read once a model; ``{}`` without CUDA or a table. A table that cannot be
    read is reported once on stderr and ignored (``MONOBATCH_PACKED_GEMV_CONFIGS`` naming a missing
    or unreadable file: one ``monobatch: warning:`` line naming the variable); an entry :func:`entry_problem` refuses is dropped
    with one warning (a bad entry would otherwise fail inside a decode step or a graph capture).

    Returns:
        ``"<layout name> <N>x<K> M<M>"`` -> ``(BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, False)``
        (FMA) and ``"<layout name> <N>x<K> dp4a"`` -> ``(..., DP4A)``.
    """
    name = _gpu_name(device)
    if name not in _TABLES:
        path, table = table_path(name) if name else None, {}
        if path:
            try:
                import json

                with open(path, encoding="utf-8") as f:
                    doc = json.load(f)
                raw = {k: tuple(v) for k, v in doc["configs"].items()}
                bad = {k: why for k, cfg in raw.items() if (why := entry_problem(k, cfg))}
                table = {k: cfg for k, cfg in raw.items() if k not in bad}
                if bad:
                    key, why = next(iter(bad.items()))
                    print(f"monobatch: warning: {TABLE_ENV} table {path!r}: {len(bad)} entries dropped "
                          f"(first: {key!r}: {why})", file=sys.stderr)
                if doc.get("device") not in (None, name):
                    print(f"monobatch: warning: {TABLE_ENV} table {path!r} was tuned on {doc['device']!r}, "
                          f"this GPU is {name!r}", file=sys.stderr)
            except OSError as e:
                if os.environ.get(TABLE_ENV) == path:  # the variable names a file that is not there
                    env.warn(TABLE_ENV, path, f"is not a readable file ({e.strerror or e})", "the rule")
                else:
                    print(f"monobatch: warning: {TABLE_ENV} table {path!r} not read ({e}): using the rule",
                          file=sys.stderr)
            except (ValueError, KeyError, TypeError, AttributeError) as e:
                print(f"monobatch: warning: {TABLE_ENV} table {path!r} not read ({e}): using the rule", file=sys.stderr)
        _TABLES[name] = table
    return _TABLES[name]


def entry_problem(key: str, cfg: tuple) -> str | None:
    """Why a tuned-table entry cannot run, or None: its key must be ``"<layout> <N>x<K> M<M>"``
    with M <= :data:`FMA_MAX_M` and an FMA config, or ``"<layout> <N>x<K> dp4a"`` and a DP4A
    config (sixth element :data:`DP4A`; BLOCK_K / 32 a power of two: the kernel's groups a step);
    either six integers, BLOCK_N and BLOCK_K's bytes powers of two, BLOCK_K a multiple of 32 and
    at most K rounded up to a power of two, 1 to K's steps splits, 1-8 warps (a power of two) and
    at least one stage."""
    m = re.fullmatch(r"(Q[48])/(\d+)(:\S*)? (\d+)x(\d+) (M(\d+)|dp4a)", key)
    if m is None:
        return "not a '<layout> <N>x<K> M<M>' or '<layout> <N>x<K> dp4a' key"
    if len(cfg) != 6 or not all(type(v) is int for v in cfg[:5]) or not isinstance(cfg[5], int):
        return "not six integers"
    q4, k, rows = m.group(1) == "Q4", int(m.group(5)), m.group(7)
    bn, bk, splits, warps, stages, dot = cfg
    bw = bk // (2 if q4 else 1)  # bytes of a row's K step (a power of two: bk / 32 groups a step)
    if rows is None:
        if isinstance(dot, bool) or dot != DP4A:
            return "not a DP4A config"
        if warps in (1, 2, 4, 8) and bn * bw > DP4A_MAX_BYTES * warps * 32:
            return f"more than {DP4A_MAX_BYTES} weight bytes a thread a step (spills at {FMA_MAX_M} rows)"
    elif dot is not False or not 1 <= int(rows) <= FMA_MAX_M:
        return f"not an FMA config of 1..{FMA_MAX_M} rows"
    if bk < 32 or bk % 32 or bw & (bw - 1) or bn < 1 or bn & (bn - 1) or bk > _pow2(k):
        return "BLOCK_N or BLOCK_K off"
    if not 1 <= splits <= -(-k // bk) or warps not in (1, 2, 4, 8) or stages < 1:
        return "split, warps or stages off"
    return None


_NAMES: dict[int, str] = {}


def _gpu_name(device: torch.device | None = None) -> str:
    """The name of ``device``'s GPU (default: the current CUDA device), cached per device index;
    ``""`` without CUDA."""
    if (device is not None and device.type != "cuda") or not torch.cuda.is_available():
        return ""
    index = torch.cuda.current_device() if device is None or device.index is None else device.index
    if index not in _NAMES:
        _NAMES[index] = torch.cuda.get_device_name(index)
    return _NAMES[index]


def table_key(N: int, K: int, M: int, layout: Layout) -> str:
    """A product's FMA key in the tuned table (:func:`tuned_configs`)."""
    return f"{layout.name} {N}x{K} M{M}"


def dp4a_key(N: int, K: int, layout: Layout) -> str:
    """A product's DP4A key in the tuned table: one entry for every M <= :data:`FMA_MAX_M`."""
    return f"{layout.name} {N}x{K} dp4a"


#: ``(BM, BN, BK, num_warps, num_stages)`` of every product in batch-invariant mode, any M.
INVARIANT_TILE = (16, 32, 64, 4, 3)


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def gemv_config(N: int, K: int, M: int, layout: Layout, variant: str | None = None,
                device: torch.device | None = None, table: bool = True) -> tuple[int, int, int, int, int, bool]:
    """``(BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, DOT)`` for an ``[M, K] x [N, K]^T``
    product on ``layout`` (BLOCK_K in weights, a power of two times 32). By default
    (:data:`VARIANT` "dp4a") the DP4A variant for M <= :data:`FMA_MAX_M` (below); with
    ``MONOBATCH_PACKED_GEMV=fma`` the FMA variant (``DOT`` False: CUDA cores) for M <=
    :data:`FMA_DEFAULT_M`; else, and for every M with ``dot``, the DOT variant (tensor cores, x^T
    padded to 16 columns). ``variant`` "fma" (any M <= :data:`FMA_MAX_M`), "dot" or "dp4a"
    overrides :data:`VARIANT`, for A/B runs and the probe.

    DOT configs: from the H200 sweep of 2026-12-01 (``scripts/bench_packed_cuda.py --sweep``,
    llama-1b's five weight shapes at M = 1, docs/benchmarks): 64-row tiles of 128 weights, K in 4
    slices, 4 stages, were the fastest for the Q4 layout at every shape and for Q8_0's qkv and o;
    wider 8-bit outputs (gate/up, the LM head) took 256-weight steps without a split. FMA configs:
    the FMA variant since 2026-12-03 (integer-weighted group sums, ~4.4 instructions a weight in
    SASS at M = 1 against the earlier kernel's ~8.8): 64-row tiles of 512 weights a step for Q4
    and 256 for the 8-bit layouts, K split until the grid has ~528 programs (4 a multiprocessor on
    the H200's 132); at M = 1 unpipelined (one stage: the H200 sweep of 2026-12-03 at llama-1b's
    shapes, Q4_K and Q6_K, found it the fastest or within 10 % at every shape), from M = 2 32-row
    tiles (the accumulators' registers) and 3 stages (untimed). Where the tuned table of
    ``device``'s GPU (:func:`tuned_configs`) lists the product, its FMA config is the table's
    (``table=False``: the rule alone, the probe's baseline).

    ``variant`` (or :data:`VARIANT`) "dp4a": every layout (Q4/32, Q8/32, Q8/16) at M <=
    :data:`FMA_MAX_M` takes the tuned table's DP4A entry for the product (:func:`dp4a_key`, the
    same for every such M), else :func:`dp4a_config` (sixth element :data:`DP4A` either way);
    M > FMA_MAX_M the DOT variant."""
    chosen = variant or VARIANT
    if chosen == "dp4a" and M <= FMA_MAX_M:
        if table and (tuned := tuned_configs(device).get(dp4a_key(N, K, layout))) is not None:
            return tuned
        return dp4a_config(N, K, layout)
    fma = M <= FMA_MAX_M if variant == "fma" else chosen in ("fma", "dp4a") and M <= FMA_DEFAULT_M
    if fma and table and (tuned := tuned_configs(device).get(table_key(N, K, M, layout))) is not None:
        return tuned
    if fma:
        block_n, block_k = (64 if M == 1 else 32), (512 if layout.q4 else 256)
        block_k = max(32, min(block_k, _pow2(K)))
        return block_n, block_k, wide_split(N, K, block_n, block_k), 4, (1 if M == 1 else 3), False
    wide_q8 = not layout.q4 and N > 8192
    block_n, block_k, splits, warps, stages = (64, 256, 1, 4, 3) if wide_q8 else (64, 128, 4, 4, 4)
    block_k = max(32, min(block_k, _pow2(K)))
    return block_n, block_k, splits, warps, stages, True


def wide_split(N: int, K: int, block_n: int, block_k: int) -> int:
    """The FMA and DP4A rules' SPLIT_K: K cut until the grid has ~528 programs (4 a multiprocessor
    on the H200's 132), at most K's steps, at least 1."""
    return max(1, min(-(-K // block_k), -(-528 // -(-N // block_n))))


def dp4a_config(N: int, K: int, layout: Layout) -> tuple[int, int, int, int, int, int]:
    """The DP4A GEMV's rule ``(BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, DP4A)`` for an
    ``[M <= FMA_MAX_M, K] x [N, K]^T`` product on ``layout`` that the GPU's tuned table does not
    list (:func:`gemv_config`): the probe's best guess for Q4
    (``scripts/probe_dp4a_gemv.py``; not swept: on the H100 of 2026-12-05 it ran 0.95-1.99x the
    FMA rule's speed at llama-1b/8b's products, docs/benchmarks): 64-row tiles, steps of 512 weights (Q4) or 256
    (Q8: a word holds 4 weights, not 8, so the same 64 words a row and step; the FMA rule's
    steps), K split as the FMA rule splits it (until ~528 programs), 4 warps, one stage. The same
    for every M, so a row's bits do not depend on the rows beside it (one K order, one split, one
    reduction layout)."""
    block_n, block_k = 64, max(32, min(512 if layout.q4 else 256, _pow2(K)))
    return block_n, block_k, wide_split(N, K, block_n, block_k), 4, 1, DP4A


def gemm_config(M: int, N: int) -> tuple[int, int, int, int, int]:
    """``(BM, BN, BK, num_warps, num_stages)`` of the tiled GEMM for an ``[M, N]`` output (the
    batch-invariant mode ignores it: :data:`INVARIANT_TILE`)."""
    if M <= 32:
        return 32, 64, 64, 4, 3
    if M <= 256:
        return 64, 128, 64, 4, 3
    return 128, 128, 64, 8, 3


def _slices(K: int, block_k: int, splits: int) -> tuple[int, int]:
    """``(k_per, splits)``: K cut into at most ``splits`` slices of whole ``block_k`` blocks."""
    nk = -(-K // block_k)
    k_per = -(-nk // max(1, min(splits, nk))) * block_k
    return k_per, -(-K // k_per)


if triton is not None:

    @triton.jit
    def _small_int_to_float(u):
        # u: int32 in 0 .. 255 -> float32, exactly, without an int-to-float conversion (a quarter
        # of the FMA rate on Hopper): 2^23 + u has u as its mantissa bits, and subtracting 2^23 is
        # exact (the "magic number" conversion of FasterTransformer's and Marlin's int4 kernels).
        return (u | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0

    @triton.jit
    def _byte(v):
        # uint8 or int8 v -> float32, exactly, by _small_int_to_float (no int-to-float instruction)
        if v.dtype == tl.int8:
            return _small_int_to_float(v.to(tl.int32) + 128) - 128.0
        else:
            return _small_int_to_float(v.to(tl.int32))

    @triton.jit
    def _load(ptr, mask, other, MASKED: tl.constexpr):
        if MASKED:
            return tl.load(ptr, mask=mask, other=other)
        else:
            return tl.load(ptr)

    @triton.jit
    def _group_scales(s_rows, m_rows, d_rows, g0, rmask, gmask, NG: tl.constexpr, SCALES: tl.constexpr,
                      MINS: tl.constexpr, SUB: tl.constexpr, MASKED: tl.constexpr = True):
        # Groups g0 .. g0 + NG - 1 (g0 a multiple of NG) of rows s_rows/m_rows/d_rows [BN]
        # (pointers to each row's scales, mins and super-blocks' (d, dmin) pairs; rmask [BN] the
        # rows in bounds, gmask [BN, NG] the groups) -> (scale, min) float32 [BN, NG], the layout's
        # codes (formats.py): DIRECT a float load; FACTORED the integer factor times its
        # super-block's float16 d (SUB groups a super-block), -(dmin * m) for a min: products
        # exact in float32, the bits of formats.repack's float32 values. ZERO: the scale returned
        # in the min's place, unused (the callers add no min); NEG8: -8 * scale. MASKED False:
        # every load in bounds (the masks unused). Where NG divides SUB the groups share one
        # super-block, whose (d, dmin) is loaded once a row ([BN, 1]: fewer registers than a
        # [BN, NG] gather; Q6_K's FMA GEMV at M = 1 206 -> 96).
        g = g0 + tl.arange(0, NG)
        s = _load(s_rows[:, None] + g[None, :], gmask, 0, MASKED)
        if SUB % NG == 0:
            dp = d_rows[:, None] + (g0 // SUB * 2)
            dm = rmask[:, None]
        else:
            dp = d_rows[:, None] + (g // SUB * 2)[None, :]
            dm = gmask
        if SCALES == 1:
            s = _load(dp, dm, 0.0, MASKED).to(tl.float32) * _byte(s)
        else:
            s = s.to(tl.float32)
        if MINS == 0:
            m = _load(m_rows[:, None] + g[None, :], gmask, 0.0, MASKED).to(tl.float32)
        elif MINS == 1:
            dmin = _load(dp + 1, dm, 0.0, MASKED).to(tl.float32)
            m = -(dmin * _byte(_load(m_rows[:, None] + g[None, :], gmask, 0, MASKED)))
        elif MINS == 3:
            m = -8.0 * s
        else:
            m = s
        return s, m

    @triton.jit
    def _w_tile(q_rows, s_rows, m_rows, d_rows, nmask, b, b_hi, BN: tl.constexpr, BW: tl.constexpr,
                Q4: tl.constexpr, GROUP: tl.constexpr, SCALES: tl.constexpr, MINS: tl.constexpr):
        # The dequantized fp32 tile [BN, BW] of bytes b .. b + BW of rows q_rows/s_rows/m_rows/d_rows
        # [BN] (pointers to each row's start; b and b_hi multiples of a group's bytes): (low, high)
        # nibbles' weights for Q4, (w, w) for Q8. Loaded as [BN, groups, bytes of a group], so a
        # group's bytes are one vector load and its scale and min one load each (_group_scales).
        # A ZERO min adds nothing: q * s + (-0.0) is q * s, bit for bit.
        if Q4:
            GB: tl.constexpr = 16
        else:
            GB: tl.constexpr = GROUP
        NG: tl.constexpr = BW // GB
        g = b // GB + tl.arange(0, NG)
        gmask = nmask[:, None] & (g < b_hi // GB)[None, :]
        off = (g * GB)[None, :, None] + tl.arange(0, GB)[None, None, :]
        raw = tl.load(q_rows[:, None, None] + off, mask=gmask[:, :, None], other=0)
        s, m = _group_scales(s_rows, m_rows, d_rows, b // GB, nmask, gmask, NG, SCALES, MINS, 256 // GROUP)
        s = s[:, :, None]
        m = m[:, :, None]
        if Q4:
            u = raw.to(tl.int32)
            if MINS == 2:
                lo = _small_int_to_float(u & 15) * s
                hi = _small_int_to_float(u >> 4) * s
            else:
                lo = _small_int_to_float(u & 15) * s + m
                hi = _small_int_to_float(u >> 4) * s + m
            return tl.reshape(lo, (BN, BW)), tl.reshape(hi, (BN, BW))
        else:  # int8 q: q + 128 in 0 .. 255, converted, minus 128 (exact)
            if MINS == 2:
                w = (_small_int_to_float(raw.to(tl.int32) + 128) - 128.0) * s
            else:
                w = (_small_int_to_float(raw.to(tl.int32) + 128) - 128.0) * s + m
            return tl.reshape(w, (BN, BW)), tl.reshape(w, (BN, BW))

    @triton.jit
    def _cols(p, Q4: tl.constexpr):
        # the weight column of byte position p (Q4: the low nibble's; the high one's is +16)
        if Q4:
            return (p // 16) * 32 + p % 16
        else:
            return p

    @triton.jit
    def _gemv_step(acc, lo, hi, X, col, cmask, mmask, offs_m, K, stride_xm, IEEE: tl.constexpr, Q4: tl.constexpr,
                   GATED: tl.constexpr):
        # DOT: the tile times x^T at these columns [BW, M_PAD] on the tensor cores
        xp = X + offs_m[None, :] * stride_xm + col[:, None]
        xm = cmask[:, None] & mmask[None, :]
        xt = _load_x(xp, xm, K, GATED)
        if IEEE:
            acc = tl.dot(lo, xt, acc, input_precision="ieee")
        else:
            acc = tl.dot(lo.to(xt.dtype), xt, acc)
        if Q4:
            xt = _load_x(xp + 16, xm, K, GATED)
            if IEEE:
                acc = tl.dot(hi, xt, acc, input_precision="ieee")
            else:
                acc = tl.dot(hi.to(xt.dtype), xt, acc)
        return acc

    @triton.jit(do_not_specialize=["M", "splits"])
    def _gemv_kernel(X, QS, S, MN, SUP, B, Y, WS, CNT, M, N, K, NB, b_per, splits, stride_xm, stride_qn, stride_sn,
                     stride_dn, stride_ym, HAS_BIAS: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
                     BW: tl.constexpr, STAGES: tl.constexpr, IEEE: tl.constexpr, Q4: tl.constexpr, GROUP: tl.constexpr,
                     SCALES: tl.constexpr, MINS: tl.constexpr, GATED: tl.constexpr, PDL: tl.constexpr):
        # The DOT variant. NB: bytes of a row (K / 2 for Q4, K for Q8); BW: bytes a K step
        # (BLOCK_K / 2 or BLOCK_K); b_per: bytes a K slice. Positions p are bytes.
        pid_n, pid_k, offs_n, offs_m, nmask, mmask, b_lo, b_hi, q_rows, s_rows, m_rows, d_rows = _gemv_tile(
            QS, S, MN, SUP, M, N, NB, b_per, stride_qn, stride_sn, stride_dn, BLOCK_N, M_PAD)
        offs_b = tl.arange(0, BW)
        acc = tl.zeros((BLOCK_N, M_PAD), tl.float32)
        # The first W tile is loaded before the PDL wait (no kernel writes weights), x after it.
        p = b_lo + offs_b
        pmask = p < b_hi
        lo, hi = _w_tile(q_rows, s_rows, m_rows, d_rows, nmask, b_lo, b_hi, BLOCK_N, BW, Q4, GROUP, SCALES, MINS)
        pdl.wait_prior(PDL)
        acc = _gemv_step(acc, lo, hi, X, _cols(p, Q4), pmask, mmask, offs_m, K, stride_xm, IEEE, Q4, GATED)
        for b in tl.range(b_lo + BW, b_hi, BW, num_stages=STAGES):
            p = b + offs_b
            pmask = p < b_hi
            lo, hi = _w_tile(q_rows, s_rows, m_rows, d_rows, nmask, b, b_hi, BLOCK_N, BW, Q4, GROUP, SCALES, MINS)
            acc = _gemv_step(acc, lo, hi, X, _cols(p, Q4), pmask, mmask, offs_m, K, stride_xm, IEEE, Q4, GATED)
        split_k_store(acc, WS, CNT, B, Y, M, N, pid_n, pid_k, splits, offs_m, offs_n, mmask, nmask, stride_ym, HAS_BIAS)

    @triton.jit
    def _nib(wm, MASK: tl.constexpr, BIAS: tl.constexpr):
        # wm = a word with 2^23's exponent bits set (w | 0x4B000000): its bits MASK kept as the
        # mantissa of 2^23 + v, v = the field's integer times 2^(its offset), exactly; minus BIAS
        # (2^23, or 2^23 + 128 * 2^offset for an int8 field stored as q + 128): the field's value
        # times 2^offset, exact. One LOP3 and one FADD a weight.
        return (wm & (0x4B000000 | MASK)).to(tl.float32, bitcast=True) - BIAS

    @triton.jit
    def _fma_row(WM, TM, X, row: tl.constexpr, stride_xm, j, g0, jmask, K, BN: tl.constexpr, NG: tl.constexpr,
                 GW: tl.constexpr, Q4: tl.constexpr, GATED: tl.constexpr):
        # One row of x against a K step of packed words: (d [BN, NG] = each group's sum_j q_j x_j,
        # sx [NG] = each group's sum_j x_j). WM/TM [BN, NG * GW]: the step's words w with 2^23's
        # exponent or-ed in, of w and of w >> 12 (Q4) / w >> 16 (Q8). Each field's float is its
        # integer times 2^offset (_nib), so x at that column is taken times 2^-offset (exact): the
        # products are q * x exactly. Q4 word p of group g holds bytes 4p..4p+3; byte b's low nibble
        # is column 32g + b, its high one 32g + 16 + b. Q8 word p holds columns 4p..4p+3 (each byte
        # q + 128 after _fma_load's xor).
        xr = X + row * stride_xm
        if Q4:
            col = (g0 + j // GW) * 32 + (j % GW) * 4
            x0 = _load_x(xr + col, jmask, K, GATED).to(tl.float32)
            x1 = _load_x(xr + col + 16, jmask, K, GATED).to(tl.float32)
            x2 = _load_x(xr + col + 1, jmask, K, GATED).to(tl.float32)
            x3 = _load_x(xr + col + 17, jmask, K, GATED).to(tl.float32)
            x4 = _load_x(xr + col + 2, jmask, K, GATED).to(tl.float32)
            x5 = _load_x(xr + col + 18, jmask, K, GATED).to(tl.float32)
            x6 = _load_x(xr + col + 3, jmask, K, GATED).to(tl.float32)
            x7 = _load_x(xr + col + 19, jmask, K, GATED).to(tl.float32)
            sxw = ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7))
            p = _nib(WM, 0xF, 8388608.0) * x0[None, :]
            p += _nib(WM, 0xF0, 8388608.0) * (x1 * 0.0625)[None, :]
            p += _nib(WM, 0xF00, 8388608.0) * (x2 * 0.00390625)[None, :]
            p += _nib(WM, 0xF000, 8388608.0) * (x3 * 0.000244140625)[None, :]
            p += _nib(WM, 0xF0000, 8388608.0) * (x4 * 1.52587890625e-05)[None, :]
            p += _nib(TM, 0xF00, 8388608.0) * (x5 * 0.00390625)[None, :]  # byte 2's high nibble, w bits 20..23
            p += _nib(TM, 0xF000, 8388608.0) * (x6 * 0.000244140625)[None, :]
            p += _nib(TM, 0xF0000, 8388608.0) * (x7 * 1.52587890625e-05)[None, :]
        else:
            col = (g0 * GW + j) * 4
            x0 = _load_x(xr + col, jmask, K, GATED).to(tl.float32)
            x1 = _load_x(xr + col + 1, jmask, K, GATED).to(tl.float32)
            x2 = _load_x(xr + col + 2, jmask, K, GATED).to(tl.float32)
            x3 = _load_x(xr + col + 3, jmask, K, GATED).to(tl.float32)
            sxw = (x0 + x1) + (x2 + x3)
            p = _nib(WM, 0xFF, 8388736.0) * x0[None, :]
            p += _nib(WM, 0xFF00, 8421376.0) * (x1 * 0.00390625)[None, :]
            p += _nib(TM, 0xFF, 8388736.0) * x2[None, :]
            p += _nib(TM, 0xFF00, 8421376.0) * (x3 * 0.00390625)[None, :]
        return tl.sum(tl.reshape(p, (BN, NG, GW)), axis=2), tl.sum(tl.reshape(sxw, (NG, GW)), axis=1)

    @triton.jit
    def _fma_load(w_rows, s_rows, m_rows, d_rows, nmask, g0, g_hi, j, offs_g, GW: tl.constexpr, NG: tl.constexpr,
                  Q4: tl.constexpr, EVEN: tl.constexpr, SCALES: tl.constexpr, MINS: tl.constexpr, SUB: tl.constexpr):
        # A K step's words [BN, NG * GW] (16-byte loads; exponent bits or-ed in, of w and of its
        # shift) and its groups' scales and mins [BN, NG] (_group_scales); jmask [NG * GW]: the
        # words inside the slice
        g = g0 + offs_g
        if EVEN:  # N a multiple of BLOCK_N, K of the step: no masks on the words
            jmask = j < NG * GW
            w = tl.load(w_rows[:, None] + (g0 * GW + j)[None, :])
        else:
            jmask = g0 * GW + j < g_hi * GW
            w = tl.load(w_rows[:, None] + (g0 * GW + j)[None, :], mask=nmask[:, None] & jmask[None, :], other=0)
        s, m = _group_scales(s_rows, m_rows, d_rows, g0, nmask, nmask[:, None] & (g < g_hi)[None, :], NG, SCALES,
                             MINS, SUB, not EVEN)
        if Q4:
            t = w >> 12
        else:  # int8 q -> q + 128 in each byte (bias 2^23 + 128 * 2^offset in _nib)
            w = w ^ -2139062144  # 0x80808080
            t = w >> 16
        return w | 0x4B000000, t | 0x4B000000, s, m, jmask

    @triton.jit
    def _fma_acc(acc, s, m, d, sx, MINS: tl.constexpr):
        # acc [BN, NG] += s * sum_j q_j x_j + m * sum_j x_j, two roundings (the product and its min
        # contracted into one FMA, then the add). A ZERO min: acc + (s * d + 0.0), the same two
        # roundings and bits (fma(s, d, +-0) is s * d rounded, a zero's sign cannot change acc,
        # which starts at +0); not acc + s * d, which contracts into one FMA that rounds once.
        if MINS == 2:
            return acc + (s * d + 0.0)
        else:
            return acc + (s * d + m * sx[None, :])

    @triton.jit
    def _fma_step(acc0, acc1, acc2, acc3, WM, TM, s, m, X, stride_xm, j, g0, jmask, K, ROWS: tl.constexpr,
                  BN: tl.constexpr, NG: tl.constexpr, GW: tl.constexpr, Q4: tl.constexpr, GATED: tl.constexpr,
                  MINS: tl.constexpr):
        # every row (ROWS <= 4, unrolled): acc [BN, NG] += s * sum_j q_j x_j + m * sum_j x_j a group
        tl.static_assert(ROWS <= 4, "the FMA GEMV has four row accumulators")
        d, sx = _fma_row(WM, TM, X, 0, stride_xm, j, g0, jmask, K, BN, NG, GW, Q4, GATED)
        acc0 = _fma_acc(acc0, s, m, d, sx, MINS)
        if ROWS > 1:
            d, sx = _fma_row(WM, TM, X, 1, stride_xm, j, g0, jmask, K, BN, NG, GW, Q4, GATED)
            acc1 = _fma_acc(acc1, s, m, d, sx, MINS)
        if ROWS > 2:
            d, sx = _fma_row(WM, TM, X, 2, stride_xm, j, g0, jmask, K, BN, NG, GW, Q4, GATED)
            acc2 = _fma_acc(acc2, s, m, d, sx, MINS)
        if ROWS > 3:
            d, sx = _fma_row(WM, TM, X, 3, stride_xm, j, g0, jmask, K, BN, NG, GW, Q4, GATED)
            acc3 = _fma_acc(acc3, s, m, d, sx, MINS)
        return acc0, acc1, acc2, acc3

    @triton.jit
    def _put_row(acc, part, offs_m, row: tl.constexpr):
        # column ``row`` of the [BN, M_PAD] output tile <- the row's accumulator summed over groups
        return tl.where(offs_m[None, :] == row, tl.sum(part, axis=1)[:, None], acc)

    @triton.jit
    def _gemv_tile(QW, S, MN, SUP, M, N, NG_ROW, g_per, stride_wn, stride_sn, stride_dn, BLOCK_N: tl.constexpr,
                   M_PAD: tl.constexpr):
        # A packed GEMV program's tile (the DOT, FMA and DP4A kernels'): (pid_n, pid_k, its output
        # rows offs_n [BLOCK_N] and x rows offs_m [M_PAD] with their masks, its K slice's positions
        # g_lo .. g_hi (groups, or bytes for DOT), and each weight row's pointers: packed data,
        # scales, mins, super-block (d, dmin))
        return _gemv_tile_at(tl.program_id(0), tl.program_id(1), QW, S, MN, SUP, M, N, NG_ROW, g_per, stride_wn,
                             stride_sn, stride_dn, BLOCK_N, M_PAD)

    @triton.jit
    def _gemv_tile_at(pid_n, pid_k, QW, S, MN, SUP, M, N, NG_ROW, g_per, stride_wn, stride_sn, stride_dn,
                      BLOCK_N: tl.constexpr, M_PAD: tl.constexpr):
        # _gemv_tile of tile (pid_n, pid_k) (the two-part DP4A launch's tiles are not its program ids)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = tl.arange(0, M_PAD)
        g_lo = pid_k * g_per
        rows = offs_n.to(tl.int64)
        return (pid_n, pid_k, offs_n, offs_m, offs_n < N, offs_m < M, g_lo, tl.minimum(g_lo + g_per, NG_ROW),
                QW + rows * stride_wn, S + rows * stride_sn, MN + rows * stride_sn, SUP + rows * stride_dn)

    @triton.jit(do_not_specialize=["M", "splits"])
    def _gemv_fma_kernel(X, QW, S, MN, SUP, B, Y, WS, CNT, M, N, K, NG_ROW, g_per, splits, stride_xm, stride_wn,
                         stride_sn, stride_dn, stride_ym, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr,
                         M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, NG: tl.constexpr, GW: tl.constexpr,
                         STAGES: tl.constexpr, Q4: tl.constexpr, GATED: tl.constexpr, EVEN: tl.constexpr,
                         SCALES: tl.constexpr, MINS: tl.constexpr, SUB: tl.constexpr, PDL: tl.constexpr):
        # The FMA variant (CUDA cores, M = ROWS <= 4). QW: the packed bytes as int32 words, GW a
        # group (4 for Q4 and Q8/16, 8 for Q8/32); positions are groups: NG_ROW a row, NG a K step,
        # g_per a K slice.
        pid_n, pid_k, offs_n, offs_m, nmask, mmask, g_lo, g_hi, w_rows, s_rows, m_rows, d_rows = _gemv_tile(
            QW, S, MN, SUP, M, N, NG_ROW, g_per, stride_wn, stride_sn, stride_dn, BLOCK_N, M_PAD)
        offs_g = tl.arange(0, NG)
        j = tl.arange(0, NG * GW)
        acc0 = tl.zeros((BLOCK_N, NG), tl.float32)
        acc1, acc2, acc3 = acc0, acc0, acc0
        # The first step's words are loaded before the PDL wait (no kernel writes weights), x after it.
        WM, TM, s, m, jmask = _fma_load(w_rows, s_rows, m_rows, d_rows, nmask, g_lo, g_hi, j, offs_g, GW, NG, Q4,
                                        EVEN, SCALES, MINS, SUB)
        pdl.wait_prior(PDL)
        acc0, acc1, acc2, acc3 = _fma_step(acc0, acc1, acc2, acc3, WM, TM, s, m, X, stride_xm, j, g_lo, jmask, K,
                                           ROWS, BLOCK_N, NG, GW, Q4, GATED, MINS)
        for g0 in tl.range(g_lo + NG, g_hi, NG, num_stages=STAGES):
            WM, TM, s, m, jmask = _fma_load(w_rows, s_rows, m_rows, d_rows, nmask, g0, g_hi, j, offs_g, GW, NG, Q4,
                                            EVEN, SCALES, MINS, SUB)
            acc0, acc1, acc2, acc3 = _fma_step(acc0, acc1, acc2, acc3, WM, TM, s, m, X, stride_xm, j, g0, jmask, K,
                                               ROWS, BLOCK_N, NG, GW, Q4, GATED, MINS)
        acc = tl.zeros((BLOCK_N, M_PAD), tl.float32)  # reduce over the groups once; column r <- row r
        acc = _put_row(acc, acc0, offs_m, 0)
        if ROWS > 1:
            acc = _put_row(acc, acc1, offs_m, 1)
        if ROWS > 2:
            acc = _put_row(acc, acc2, offs_m, 2)
        if ROWS > 3:
            acc = _put_row(acc, acc3, offs_m, 3)
        split_k_store(acc, WS, CNT, B, Y, M, N, pid_n, pid_k, splits, offs_m, offs_n, mmask, nmask, stride_ym, HAS_BIAS)

    @triton.jit
    def _dp4a(w, x, acc, SIGNED: tl.constexpr, ASM: tl.constexpr):
        # acc + sum_b w.byte[b] * x.byte[b], int32 [BN, words]: x's bytes signed, w's unsigned (Q4's
        # nibbles) or signed where SIGNED (Q8's int8): PTX dp4a.u32.s32 / dp4a.s32.s32 (IDP.4A, one
        # instruction for 4 products and their sum), or the same in integer ops where ASM is False
        # (the interpreter runs no inline assembly; a signed byte sign-extended by << then >>)
        if ASM:
            if SIGNED:
                return tl.inline_asm_elementwise(asm="dp4a.s32.s32 $0, $1, $2, $3;", constraints="=r,r,r,r",
                                                 args=[w, x, acc], dtype=tl.int32, is_pure=True, pack=1)
            else:
                return tl.inline_asm_elementwise(asm="dp4a.u32.s32 $0, $1, $2, $3;", constraints="=r,r,r,r",
                                                 args=[w, x, acc], dtype=tl.int32, is_pure=True, pack=1)
        else:
            out = acc
            for b in tl.static_range(4):
                if SIGNED:
                    wb = (w << (24 - 8 * b)) >> 24  # (arithmetic >>: the byte's sign)
                else:
                    wb = (w >> (8 * b)) & 0xFF
                out += wb * ((x << (24 - 8 * b)) >> 24)
            return out

    @triton.jit
    def _int_to_float(v):
        # int32 |v| < 2^22 -> float32 exactly, without an int-to-float conversion: 1.5 * 2^23 + v
        # has v in its mantissa bits (_small_int_to_float's trick for signed values)
        return (v + 0x4B400000).to(tl.float32, bitcast=True) - 12582912.0

    @triton.jit
    def _max_nan(a, b):
        # max that propagates NaN (tl.max and tl.maximum drop it, as fmax does)
        return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def _amax(x):
        # x [NG, P, 4] -> max |x| [NG], NaN where the group holds one (its d becomes NaN, so the
        # output is NaN, as the FMA and DOT variants give; an inf gives d = inf and xi = 0: NaN)
        return tl.reduce(tl.reduce(tl.abs(x), 2, _max_nan), 1, _max_nan)

    @triton.jit
    def _q8_1_scale(amax):
        # a 32-column group's max |x| [NG] -> (d = amax / 127, 127 / amax or 0 where amax is 0), the
        # divisions IEEE-rounded (div_rn, not the approximate div.full): a float32 torch reference's
        # bits. A group with 0 < amax < 1e-30 (no activation is that small) is rounded on the scale
        # of amax = 1e-30 (127 / amax kept finite), so d xi understates its x by amax / 1e-30.
        dx = tl.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))
        inv = tl.div_rn(tl.full(amax.shape, 127.0, tl.float32), tl.maximum(amax, 1e-30))
        return dx, tl.where(amax > 0, inv, 0.0)

    @triton.jit
    def _q8_1(x, inv):
        # x * (127 / amax) rounded half away from zero (floor(|v| + 0.5)), int32 in -127 .. 127
        v = x * inv
        return tl.where(v < 0, -tl.floor(tl.abs(v) + 0.5), tl.floor(tl.abs(v) + 0.5)).to(tl.int32)

    @triton.jit
    def _x_words(q):
        # int8 values q [NG, P, 4] -> int32 words [NG, P], byte b of a word = q[..., b]
        shift = (tl.arange(0, 4) * 8)[None, None, :]
        return tl.sum((q & 0xFF) << shift, axis=2)  # disjoint bytes: their sum is their OR

    @triton.jit
    def _dp4a_x(X, row: tl.constexpr, stride_xm, g, gmask, K, GATED: tl.constexpr, Q4: tl.constexpr,
                GROUP: tl.constexpr):
        # Row ``row`` of x at 32-column groups g [NG] (gmask: the groups in the K slice; x at the
        # others is taken as 0) rounded to int8 as q8_1 (llama.cpp's MMVQ activations), per 32
        # columns whatever the weights' group: d = amax / 127 and xi = x * (127 / amax) rounded
        # half away from zero, so |x - d xi| <= d / 2 (up to the float32 roundings of 127 / amax
        # and of the product). -> (xl, xh, d, sx):
        # Q4: int32 words [NG * 4], word 4g + p holding xi of columns 32g + 4p + b (xl) and
        #   32g + 16 + 4p + b (xh) as byte b (the Q4 words' nibble order); d float32 [NG]; sx =
        #   sum_i xi int32 [NG].
        # Q8: words [NG * 8] in column order, word 8g + p holding columns 32g + 4p + b as byte b
        #   (the Q8 words' order: qs int8 [N, K] read as int32), as xl (xh the same, unused); d and
        #   sx per weight group [NG * 32 / GROUP] (GROUP 16: each x group's d twice, sx over the
        #   group's 16 columns).
        b = tl.arange(0, 4)
        xr = X + row * stride_xm
        NG: tl.constexpr = g.shape[0]
        if Q4:
            p = tl.arange(0, 4)
            col = g[:, None, None] * 32 + p[None, :, None] * 4 + b[None, None, :]  # [NG, 4, 4]
            cmask = gmask[:, None, None] & (col >= 0)
            xl = _load_x(xr + col, cmask, K, GATED).to(tl.float32)
            xh = _load_x(xr + col + 16, cmask, K, GATED).to(tl.float32)
            amax = _max_nan(_amax(xl), _amax(xh))
            dx, inv = _q8_1_scale(amax)
            ql = _q8_1(xl, inv[:, None, None])
            qh = _q8_1(xh, inv[:, None, None])
            sx = tl.sum(tl.sum(ql, axis=2), axis=1) + tl.sum(tl.sum(qh, axis=2), axis=1)
            return tl.reshape(_x_words(ql), (NG * 4,)), tl.reshape(_x_words(qh), (NG * 4,)), dx, sx
        else:
            p = tl.arange(0, 8)
            col = g[:, None, None] * 32 + p[None, :, None] * 4 + b[None, None, :]  # [NG, 8, 4]
            cmask = gmask[:, None, None] & (col >= 0)
            xv = _load_x(xr + col, cmask, K, GATED).to(tl.float32)
            dx, inv = _q8_1_scale(_amax(xv))
            q = _q8_1(xv, inv[:, None, None])
            words = tl.reshape(_x_words(q), (NG * 8,))
            NGW: tl.constexpr = NG * 32 // GROUP
            sx = tl.sum(tl.reshape(tl.sum(q, axis=2), (NGW, GROUP // 4)), axis=1)
            if GROUP == 16:
                dx = tl.reshape(tl.broadcast_to(dx[:, None], (NG, 2)), (NGW,))
            return words, words, dx, sx

    @triton.jit
    def _dp4a_acc(acc, s, m, dx, sumi, sx, MINS: tl.constexpr):
        # acc [BN, NGW] + a weight group's s d (float)sumi + m (d (float)sum xi), in that order
        # (float32; the scale and min from _group_scales, d the x group's). NEG8 (m = -8 s):
        # s (d (float)(sumi - 8 sum xi)), the min's part exact in int32; ZERO: no min.
        if MINS == 3:
            return acc + s * (dx[None, :] * _int_to_float(sumi - sx[None, :] * 8))
        elif MINS == 2:
            return acc + s * (dx[None, :] * _int_to_float(sumi))
        else:
            return acc + (s * (dx[None, :] * _int_to_float(sumi)) + m * (dx * _int_to_float(sx))[None, :])

    @triton.jit
    def _dp4a_row(acc, WL, WH, s, m, X, row: tl.constexpr, stride_xm, g, gmask, K, BN: tl.constexpr,
                  NG: tl.constexpr, GATED: tl.constexpr, Q4: tl.constexpr, GROUP: tl.constexpr, MINS: tl.constexpr,
                  ASM: tl.constexpr):
        # acc [BN, NGW] (a column a weight group: NGW = NG * 32 / GROUP) += one row of x against a K
        # step: x's 32-column groups quantized (_dp4a_x), the exact int32 weight-group dots
        # sumi = sum_i q_i xi_i, then _dp4a_acc. Q4: two dp4a.u32.s32 a word (the low nibbles WL,
        # the high ones WH, [BN, NG * 4]), 4 words a group. Q8: one dp4a.s32.s32 a word (WL, the
        # words as loaded, [BN, NG * 8]), GROUP / 4 words a weight group: Q8/32 one weight group a
        # x group; Q8/16 two (columns 32g .. 32g + 15 and 32g + 16 .. 32g + 31), each its own
        # sumi, scale and sum xi times the x group's one d. |sumi| <= 128 * 127 * 32 < 2^22.
        xl, xh, dx, sx = _dp4a_x(X, row, stride_xm, g, gmask, K, GATED, Q4, GROUP)
        if Q4:
            d = _dp4a(WL, xl[None, :], tl.zeros_like(WL), False, ASM)
            d = _dp4a(WH, xh[None, :], d, False, ASM)
            sumi = tl.sum(tl.reshape(d, (BN, NG, 4)), axis=2)  # exact: |sumi| <= 15 * 127 * 32
        else:
            d = _dp4a(WL, xl[None, :], tl.zeros_like(WL), True, ASM)
            sumi = tl.sum(tl.reshape(d, (BN, NG * 32 // GROUP, GROUP // 4)), axis=2)
        return _dp4a_acc(acc, s, m, dx, sumi, sx, MINS)

    @triton.jit
    def _dp4a_step(acc0, acc1, acc2, acc3, WL, WH, s, m, X, stride_xm, g, gmask, K, ROWS: tl.constexpr,
                   BN: tl.constexpr, NG: tl.constexpr, GATED: tl.constexpr, Q4: tl.constexpr, GROUP: tl.constexpr,
                   MINS: tl.constexpr, ASM: tl.constexpr):
        # every row (ROWS <= 4, unrolled as _fma_step), each on its own: the same code and order a row
        tl.static_assert(ROWS <= 4, "the DP4A GEMV has four row accumulators")
        acc0 = _dp4a_row(acc0, WL, WH, s, m, X, 0, stride_xm, g, gmask, K, BN, NG, GATED, Q4, GROUP, MINS, ASM)
        if ROWS > 1:
            acc1 = _dp4a_row(acc1, WL, WH, s, m, X, 1, stride_xm, g, gmask, K, BN, NG, GATED, Q4, GROUP, MINS, ASM)
        if ROWS > 2:
            acc2 = _dp4a_row(acc2, WL, WH, s, m, X, 2, stride_xm, g, gmask, K, BN, NG, GATED, Q4, GROUP, MINS, ASM)
        if ROWS > 3:
            acc3 = _dp4a_row(acc3, WL, WH, s, m, X, 3, stride_xm, g, gmask, K, BN, NG, GATED, Q4, GROUP, MINS, ASM)
        return acc0, acc1, acc2, acc3

    @triton.jit
    def _dp4a_load(w_rows, s_rows, m_rows, d_rows, nmask, g0, g_hi, j, NG: tl.constexpr, WPG: tl.constexpr,
                   EVEN: tl.constexpr, Q4: tl.constexpr, GROUP: tl.constexpr, SCALES: tl.constexpr,
                   MINS: tl.constexpr, SUB: tl.constexpr):
        # A K step's words (positions g0, g_hi: 32-column groups, WPG words each) -> (WL, WH, scale,
        # min, the x groups' mask [NG]). Q4 [BN, NG * 4] as two words of 4 unsigned bytes each (word
        # p of group g: the low nibbles of bytes 4p..4p+3, columns 32g + 4p + b, and the high ones,
        # 32g + 16 + 4p + b); Q8 [BN, NG * 8] as loaded (word p: int8 of columns 4p .. 4p + 3), WH
        # the same (unused). Scales and mins [BN, NGW] of the NGW = NG * 32 / GROUP weight groups
        # (_group_scales; SUB weight groups a super-block).
        R: tl.constexpr = 32 // GROUP
        if EVEN:
            w = tl.load(w_rows[:, None] + (g0 * WPG + j)[None, :])
        else:
            w = tl.load(w_rows[:, None] + (g0 * WPG + j)[None, :],
                        mask=nmask[:, None] & (g0 * WPG + j < g_hi * WPG)[None, :], other=0)
        gw = g0 * R + tl.arange(0, NG * R)
        s, m = _group_scales(s_rows, m_rows, d_rows, g0 * R, nmask, nmask[:, None] & (gw < g_hi * R)[None, :], NG * R,
                             SCALES, MINS, SUB, not EVEN)
        gmask = g0 + tl.arange(0, NG) < g_hi
        if Q4:
            return w & 0x0F0F0F0F, (w >> 4) & 0x0F0F0F0F, s, m, gmask
        else:
            return w, w, s, m, gmask

    @triton.jit
    def _dp4a_program(pid_n, pid_k, X, QW, S, MN, SUP, B, Y, WS, CNT, M, N, K, NG_ROW, g_per, splits, stride_xm,
                      stride_wn, stride_sn, stride_dn, stride_ym, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr,
                      M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, NG: tl.constexpr, STAGES: tl.constexpr,
                      Q4: tl.constexpr, GROUP: tl.constexpr, GATED: tl.constexpr, EVEN: tl.constexpr,
                      SCALES: tl.constexpr, MINS: tl.constexpr, SUB: tl.constexpr, ASM: tl.constexpr,
                      PDL: tl.constexpr):
        # One program of the DP4A variant, tile (pid_n, pid_k) (every layout, M = ROWS <= 4):
        # integer dot products of the weights' integers with x rounded to int8 per 32 columns,
        # quantized here (each program the groups of its K slice it reads, every row on its own: no
        # extra launch, and a row's bits do not depend on the others). QW: the packed bytes as int32
        # words, 4 (Q4) or 8 (Q8) a 32-column group; positions are 32-column groups: NG_ROW a row,
        # NG a K step, g_per a K slice (as _gemv_fma_kernel, whose epilogue this is). Order: a
        # float32 accumulator column per weight group of the step (NGW = NG * 32 / GROUP: Q4 and
        # Q8/32 one a x group, Q8/16 two), each adding its group's s d sumi (+ m d sum xi) step after
        # step in ascending K; after the loop the NGW columns are summed (one fixed reduction tree),
        # the slices in slice order.
        if Q4:
            WPG: tl.constexpr = 4
        else:
            WPG: tl.constexpr = 8
        NGW: tl.constexpr = NG * 32 // GROUP
        pid_n, pid_k, offs_n, offs_m, nmask, mmask, g_lo, g_hi, w_rows, s_rows, m_rows, d_rows = _gemv_tile_at(
            pid_n, pid_k, QW, S, MN, SUP, M, N, NG_ROW, g_per, stride_wn, stride_sn, stride_dn, BLOCK_N, M_PAD)
        offs_g = tl.arange(0, NG)
        j = tl.arange(0, NG * WPG)
        acc0 = tl.zeros((BLOCK_N, NGW), tl.float32)
        acc1, acc2, acc3 = acc0, acc0, acc0
        # The first step's words are loaded before the PDL wait (no kernel writes weights), x after it.
        WL, WH, s, m, gmask = _dp4a_load(w_rows, s_rows, m_rows, d_rows, nmask, g_lo, g_hi, j, NG, WPG, EVEN, Q4,
                                         GROUP, SCALES, MINS, SUB)
        pdl.wait_prior(PDL)
        acc0, acc1, acc2, acc3 = _dp4a_step(acc0, acc1, acc2, acc3, WL, WH, s, m, X, stride_xm, g_lo + offs_g, gmask,
                                            K, ROWS, BLOCK_N, NG, GATED, Q4, GROUP, MINS, ASM)
        for g0 in tl.range(g_lo + NG, g_hi, NG, num_stages=STAGES):
            WL, WH, s, m, gmask = _dp4a_load(w_rows, s_rows, m_rows, d_rows, nmask, g0, g_hi, j, NG, WPG, EVEN, Q4,
                                             GROUP, SCALES, MINS, SUB)
            acc0, acc1, acc2, acc3 = _dp4a_step(acc0, acc1, acc2, acc3, WL, WH, s, m, X, stride_xm, g0 + offs_g,
                                                gmask, K, ROWS, BLOCK_N, NG, GATED, Q4, GROUP, MINS, ASM)
        acc = tl.zeros((BLOCK_N, M_PAD), tl.float32)  # reduce over the groups once; column r <- row r
        acc = _put_row(acc, acc0, offs_m, 0)
        if ROWS > 1:
            acc = _put_row(acc, acc1, offs_m, 1)
        if ROWS > 2:
            acc = _put_row(acc, acc2, offs_m, 2)
        if ROWS > 3:
            acc = _put_row(acc, acc3, offs_m, 3)
        split_k_store(acc, WS, CNT, B, Y, M, N, pid_n, pid_k, splits, offs_m, offs_n, mmask, nmask, stride_ym, HAS_BIAS)

    @triton.jit(do_not_specialize=["M", "splits"])
    def _gemv_dp4a_kernel(X, QW, S, MN, SUP, B, Y, WS, CNT, M, N, K, NG_ROW, g_per, splits, stride_xm, stride_wn,
                          stride_sn, stride_dn, stride_ym, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr,
                          M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, NG: tl.constexpr, STAGES: tl.constexpr,
                          Q4: tl.constexpr, GROUP: tl.constexpr, GATED: tl.constexpr, EVEN: tl.constexpr,
                          SCALES: tl.constexpr, MINS: tl.constexpr, SUB: tl.constexpr, ASM: tl.constexpr,
                          PDL: tl.constexpr):
        # The DP4A variant: one program a (tile, K slice), _dp4a_program.
        _dp4a_program(tl.program_id(0), tl.program_id(1), X, QW, S, MN, SUP, B, Y, WS, CNT, M, N, K, NG_ROW, g_per,
                      splits, stride_xm, stride_wn, stride_sn, stride_dn, stride_ym, HAS_BIAS, ROWS, M_PAD, BLOCK_N,
                      NG, STAGES, Q4, GROUP, GATED, EVEN, SCALES, MINS, SUB, ASM, PDL)

    @triton.jit(do_not_specialize=["M", "tiles_a", "splits_a", "tiles_b", "splits_b"])
    def _gemv_dp4a_pair_kernel(X, M, K, NG_ROW, stride_xm, stride_ym, tiles_a, tiles_b,
                               QW_A, S_A, MN_A, SUP_A, B_A, Y_A, WS_A, CNT_A, N_A, g_per_a, splits_a, stride_wn_a,
                               stride_sn_a, stride_dn_a,
                               QW_B, S_B, MN_B, SUP_B, B_B, Y_B, WS_B, CNT_B, N_B, g_per_b, splits_b, stride_wn_b,
                               stride_sn_b, stride_dn_b,
                               ROWS: tl.constexpr, M_PAD: tl.constexpr, GATED: tl.constexpr,
                               ASM: tl.constexpr, PDL: tl.constexpr,
                               HAS_BIAS_A: tl.constexpr, BLOCK_N_A: tl.constexpr, NG_A: tl.constexpr,
                               STAGES_A: tl.constexpr, Q4_A: tl.constexpr, GROUP_A: tl.constexpr,
                               EVEN_A: tl.constexpr, SCALES_A: tl.constexpr, MINS_A: tl.constexpr,
                               SUB_A: tl.constexpr,
                               HAS_BIAS_B: tl.constexpr, BLOCK_N_B: tl.constexpr, NG_B: tl.constexpr,
                               STAGES_B: tl.constexpr, Q4_B: tl.constexpr, GROUP_B: tl.constexpr,
                               EVEN_B: tl.constexpr, SCALES_B: tl.constexpr, MINS_B: tl.constexpr,
                               SUB_B: tl.constexpr):
        # Two parts of one weight in one launch (gemv_pair), a 1-D grid of exactly their programs:
        # the first tiles_a * splits_a are part A's (tile, K slice) in _gemv_dp4a_kernel's order
        # (tile fastest), the rest part B's; each part with its own config and split, its
        # _dp4a_program the same as its own launch's.
        pid = tl.program_id(0)
        if pid < tiles_a * splits_a:
            _dp4a_program(pid % tiles_a, pid // tiles_a, X, QW_A, S_A, MN_A, SUP_A, B_A, Y_A, WS_A, CNT_A, M, N_A, K,
                          NG_ROW, g_per_a, splits_a, stride_xm, stride_wn_a, stride_sn_a, stride_dn_a, stride_ym,
                          HAS_BIAS_A, ROWS, M_PAD, BLOCK_N_A, NG_A, STAGES_A, Q4_A, GROUP_A, GATED, EVEN_A,
                          SCALES_A, MINS_A, SUB_A, ASM, PDL)
        else:
            pid -= tiles_a * splits_a
            _dp4a_program(pid % tiles_b, pid // tiles_b, X, QW_B, S_B, MN_B, SUP_B, B_B, Y_B, WS_B, CNT_B, M, N_B, K,
                          NG_ROW, g_per_b, splits_b, stride_xm, stride_wn_b, stride_sn_b, stride_dn_b, stride_ym,
                          HAS_BIAS_B, ROWS, M_PAD, BLOCK_N_B, NG_B, STAGES_B, Q4_B, GROUP_B, GATED, EVEN_B,
                          SCALES_B, MINS_B, SUB_B, ASM, PDL)

    @triton.jit
    def _gemm_kernel(X, QS, S, MN, SUP, B, Y, M, N, NB, stride_xm, stride_qn, stride_sn, stride_dn, stride_ym,
                     HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BW: tl.constexpr,
                     GROUP_M: tl.constexpr, IEEE: tl.constexpr, Q4: tl.constexpr, GROUP: tl.constexpr,
                     SCALES: tl.constexpr, MINS: tl.constexpr):
        pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        offs_b = tl.arange(0, BW)
        mmask = offs_m < M
        nmask = offs_n < N
        rows = offs_n.to(tl.int64)
        q_rows = QS + rows * stride_qn
        s_rows = S + rows * stride_sn
        m_rows = MN + rows * stride_sn
        d_rows = SUP + rows * stride_dn
        x_rows = X + offs_m.to(tl.int64)[:, None] * stride_xm
        acc = tl.zeros([BM, BN], tl.float32)
        for b in range(0, NB, BW):  # ascending K, one accumulator: the order every row sees
            p = b + offs_b
            pmask = p < NB
            lo, hi = _w_tile(q_rows, s_rows, m_rows, d_rows, nmask, b, NB, BN, BW, Q4, GROUP, SCALES, MINS)
            col = _cols(p, Q4)
            xmask = mmask[:, None] & pmask[None, :]
            xa = tl.load(x_rows + col[None, :], mask=xmask, other=0.0)
            if IEEE:
                acc = tl.dot(xa, tl.trans(lo), acc, input_precision="ieee")
            else:
                acc = tl.dot(xa, tl.trans(lo.to(xa.dtype)), acc)
            if Q4:
                xb = tl.load(x_rows + (col + 16)[None, :], mask=xmask, other=0.0)
                if IEEE:
                    acc = tl.dot(xb, tl.trans(hi), acc, input_precision="ieee")
                else:
                    acc = tl.dot(xb, tl.trans(hi.to(xb.dtype)), acc)
        if HAS_BIAS:
            acc = acc + tl.load(B + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        y_ptr = Y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :]
        tl.store(y_ptr, acc.to(Y.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


if triton is not None:

    @triton.jit
    def _take_kernel(IDS, QS, S, MN, SUP, Y, T, NB, stride_qn, stride_sn, stride_dn, stride_yt, BT: tl.constexpr,
                     BW: tl.constexpr, Q4: tl.constexpr, GROUP: tl.constexpr, SCALES: tl.constexpr,
                     MINS: tl.constexpr):
        # rows IDS[t] of the packed weight, dequantized, into Y [T, K]: program (t block, byte block)
        offs_t = tl.program_id(0) * BT + tl.arange(0, BT)
        tmask = offs_t < T
        rows = tl.load(IDS + offs_t, mask=tmask, other=0).to(tl.int64)
        b = tl.program_id(1) * BW
        lo, hi = _w_tile(QS + rows * stride_qn, S + rows * stride_sn, MN + rows * stride_sn, SUP + rows * stride_dn,
                         tmask, b, NB, BT, BW, Q4, GROUP, SCALES, MINS)
        p = b + tl.arange(0, BW)
        col = _cols(p, Q4)
        y = Y + offs_t.to(tl.int64)[:, None] * stride_yt + col[None, :]
        ymask = tmask[:, None] & (p < NB)[None, :]
        tl.store(y, lo.to(Y.dtype.element_ty), mask=ymask)
        if Q4:
            tl.store(y + 16, hi.to(Y.dtype.element_ty), mask=ymask)


def _scale_args(w) -> tuple:
    """A packed part's scale tensors as kernel arguments: ``(scale, min, sup, stride_sn, stride_dn)``
    (the scale tensor in the place of an absent min or sup: a pointer the kernel never reads)."""
    minimum = w.scale if w.minimum is None else w.minimum
    sup = w.scale if w.sup is None else w.sup
    return w.scale, minimum, sup, w.scale.stride(0), 0 if w.sup is None else w.sup.stride(0)


def _codes(w) -> dict:
    """The layout's compile-time constants: Q4, GROUP, SCALES, MINS."""
    return dict(Q4=w.layout.q4, GROUP=w.layout.group, SCALES=w.layout.scales, MINS=w.layout.mins)


def take(ids: torch.Tensor, w, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows ``ids`` (int64 ``[T]``, on the weight's device) of the packed part ``w`` dequantized:
    ``[T, K]`` in ``dtype``, one launch (the embedding lookup of a packed table). Float32 rows are
    bitwise :func:`dequantize`'s (``q * scale`` is exact, so a fused multiply-add rounds as the
    separate add does). ``out``: write there instead (``[T, K]`` in ``dtype``, unit stride along K;
    a row slice of a larger weight).

    Args:
        w: a packed part: an object with ``qs``, ``scale``, ``minimum``, ``sup`` and ``layout``
            (:class:`~monobatch.quant.packed.PackedPart`, or a
            :class:`~monobatch.quant.formats.Repacked` of tensors), on ``ids``' device.

    Raises:
        RuntimeError: no Triton. ValueError: ``out`` of another shape, dtype or stride.
    """
    if triton is None:
        raise RuntimeError("Triton is not installed")
    T = ids.shape[0]
    qs = w.qs
    nb = qs.shape[1]
    K = nb * (2 if w.layout.q4 else 1)
    if out is not None and (out.shape != (T, K) or out.dtype != dtype or out.stride(1) != 1):
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must be [{T}, {K}] {dtype} with unit stride along K")
    y = torch.empty((T, K), dtype=dtype, device=qs.device) if out is None else out
    if T == 0:
        return y
    bt, bw = 4, 512
    ids = ids if ids.is_contiguous() else ids.contiguous()
    scale, minimum, sup, stride_sn, stride_dn = _scale_args(w)
    _take_kernel[(triton.cdiv(T, bt), triton.cdiv(nb, bw))](ids, qs, scale, minimum, sup, y, T, nb, qs.stride(0),
                                                          stride_sn, stride_dn, y.stride(0), BT=bt, BW=bw,
                                                          **_codes(w), num_warps=4)
    return y


def _check(x: torch.Tensor, w, gated: bool = False) -> tuple[int, int]:
    if triton is None:
        raise RuntimeError("Triton is not installed")
    qs, scale, layout = w.qs, w.scale, w.layout
    N, K = qs.shape[0], qs.shape[1] * (2 if layout.q4 else 1)
    fits = x.shape[-1] == (2 if gated else 1) * K and K % 32 == 0 and scale.shape == (N, K // layout.group) \
        and qs.stride(1) == 1 and scale.stride(1) == 1 and (w.minimum is None or w.minimum.stride() == scale.stride())
    if fits and layout.super_block == 256:
        fits = K % 256 == 0 and w.sup is not None and w.sup.shape == (N, K // 256, 2) and w.sup.stride()[1:] == (2, 1)
    if not fits:
        raise ValueError(f"x {tuple(x.shape)} and a packed {layout.name} weight qs {tuple(qs.shape)} / "
                         f"scale {tuple(scale.shape)} do not fit (K a multiple of 32, of 256 where factored; "
                         "unit stride along K)")
    return N, K


def _out(x: torch.Tensor, N: int, out_dtype: torch.dtype | None, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return torch.empty((x.shape[0], N), dtype=out_dtype or x.dtype, device=x.device)
    if out.shape != (x.shape[0], N) or out.stride(1) != 1:
        raise ValueError(f"out {tuple(out.shape)} must be [{x.shape[0]}, {N}] with unit stride along N")
    return out


def gemv(x: torch.Tensor, w, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
         out: torch.Tensor | None = None, config: tuple | None = None, gated: bool = False) -> torch.Tensor:
    """``x @ W^T (+ bias)`` for a few rows, W packed (the module docstring's layouts).

    Args:
        x: ``[M, K]`` bf16/fp16 (fp32: IEEE products, the interpreter tests), M <= :data:`MAX_M`.
            With ``gated``: ``[M, 2K]`` packed ``[gate | up]`` rows, and the product's input is
            SwiGLU's ``silu(gate) * up`` with the bits of :func:`monobatch.kernels.fused.silu_mul`,
            computed as it is loaded (the down projection without its own SiLU launch).
        w: the packed part (as :func:`take`'s), x's device.
        bias: ``[N]`` or None (added in fp32).
        out_dtype: result dtype (None: x's; float32 for logits).
        out: write here instead (``[M, N]``, unit stride along N; a column slice of a wider
            output is fine); its dtype wins over ``out_dtype``.
        config: ``(BLOCK_N, BLOCK_K, SPLIT_K, num_warps, num_stages, DOT)``; None: :func:`gemv_config`.
            DOT False: the FMA variant (M <= :data:`FMA_MAX_M`; BLOCK_K of Q8/32 at least 32 weights,
            a step of whole groups); True: the DOT variant; :data:`DP4A`: the DP4A variant (any
            layout, M <= FMA_MAX_M; the tuned table's ``dp4a`` entry or :func:`dp4a_config`). Its
            numerics: each row of x rounded to
            int8 per 32 columns (``d = amax / 127`` in float32, ``xi = x * (127 / amax)`` rounded
            half away from zero; ``|x - d xi| <= d / 2``), exact int32 dots ``sumi`` of each
            weight group's integers and xi (Q8/16: two weight groups a 32-column x group), and a
            float32 accumulator of ``s d sumi + m d sum xi`` a weight group (NEG8:
            ``s d (sumi - 8 sum xi)``) in ascending K within a slice, the groups' accumulators
            summed after the K loop, the slices in order; so the result is ``(d xi) W^T`` to
            float32 rounding (the tests' bound: 1e-5 of max |y|), and differs from ``x W^T`` by at most
            ``sum_k (d_k / 2) |w_nk|``. A row's bits should be the same alone or in a batch (so
            in the interpreter; on the GPU pending ``test_dp4a_rows_cuda``).

    Returns:
        ``[M, N]``, fp32 accumulation.

    Raises:
        RuntimeError: no Triton. ValueError: shapes that do not fit, M > MAX_M, an FMA config with M > FMA_MAX_M,
            a DP4A config with M > FMA_MAX_M.
    """
    N, K = _check(x, w, gated)
    layout, qs = w.layout, w.qs
    M = x.shape[0]
    if M > MAX_M:
        raise ValueError(f"gemv takes M <= {MAX_M} rows")
    y = _out(x, N, out_dtype, out)
    if M == 0 or N == 0:
        return y
    block_n, block_k, splits, warps, stages, dot = config or gemv_config(N, K, M, layout, device=x.device)
    if not dot and M > FMA_MAX_M:
        raise ValueError(f"FMA configs take M <= {FMA_MAX_M} rows")
    if dot == DP4A and M > FMA_MAX_M:
        raise ValueError(f"DP4A configs take M <= {FMA_MAX_M} rows")
    per_byte = 2 if layout.q4 else 1
    bw = block_k // per_byte
    if block_k % 32 or bw & (bw - 1) or block_n & (block_n - 1):
        raise ValueError("BLOCK_K must be a power of two times 32, BLOCK_N a power of two")
    x = x if x.stride(1) == 1 else x.contiguous()
    k_per, splits = _slices(K, block_k, splits)
    tiles = -(-N // block_n)
    ws = torch.empty((splits, M, N) if splits > 1 else (1,), dtype=torch.float32, device=x.device)
    cnt = counters(x.device, tiles) if splits > 1 else COUNTERS.get(x.device)
    cnt = ws.new_empty(1, dtype=torch.int32) if cnt is None else cnt  # unused without split-K
    b = y if bias is None else bias.contiguous()
    scale, minimum, sup, stride_sn, stride_dn = _scale_args(w)
    if dot == DP4A:
        _gemv_dp4a_kernel[(tiles, splits)](
            X=x, M=M, K=K, NG_ROW=K // 32, stride_xm=x.stride(0), stride_ym=y.stride(0), ROWS=M, M_PAD=_pow2(M),
            GATED=gated, ASM=_DP4A_ASM, **_dp4a_part(w, y, bias, ws, cnt, K, block_n, block_k, k_per, splits, stages),
            num_warps=warps, num_stages=stages, **pdl.launch(x.device))
        return y
    if not dot:
        gw = 4 if layout.q4 else layout.group // 4  # int32 words a group
        ng = max(1, bw // (4 * gw))  # groups a K step
        even = N % block_n == 0 and K % block_k == 0
        _gemv_fma_kernel[(tiles, splits)](
            x, qs.view(torch.int32), scale, minimum, sup, b, y, ws, cnt, M, N, K, K // per_byte // (4 * gw),
            k_per // per_byte // (4 * gw), splits, x.stride(0), qs.stride(0) // 4, stride_sn, stride_dn, y.stride(0),
            HAS_BIAS=bias is not None, ROWS=M, M_PAD=_pow2(M), BLOCK_N=block_n, NG=ng, GW=gw, STAGES=stages,
            Q4=layout.q4, GATED=gated, EVEN=even, SCALES=layout.scales, MINS=layout.mins, SUB=256 // layout.group,
            num_warps=warps, num_stages=stages, **pdl.launch(x.device))
        return y
    _gemv_kernel[(tiles, splits)](
        x, qs, scale, minimum, sup, b, y, ws, cnt, M, N, K, K // per_byte, k_per // per_byte, splits,
        x.stride(0), qs.stride(0), stride_sn, stride_dn, y.stride(0), HAS_BIAS=bias is not None,
        M_PAD=16, BLOCK_N=block_n, BW=bw, STAGES=stages, IEEE=x.dtype == torch.float32, **_codes(w), GATED=gated,
        num_warps=warps, num_stages=stages, **pdl.launch(x.device))
    return y


def _dp4a_part(w, y: torch.Tensor, bias: torch.Tensor | None, ws: torch.Tensor, cnt: torch.Tensor, K: int,
               block_n: int, block_k: int, k_per: int, splits: int, stages: int) -> dict:
    """One packed part's arguments of :func:`_dp4a_program` by name (those not shared by the parts
    of one launch: :func:`gemv`, :func:`gemv_pair`): its words, scales, bias, output ``y``
    (``[M, N]``, a column slice is fine), split-K workspace and counters, split and strides, and
    its constexprs."""
    layout, qs = w.layout, w.qs
    scale, minimum, sup, stride_sn, stride_dn = _scale_args(w)
    N = y.shape[1]
    return dict(QW=qs.view(torch.int32), S=scale, MN=minimum, SUP=sup, B=y if bias is None else bias.contiguous(), Y=y,
                WS=ws, CNT=cnt, N=N, g_per=k_per // 32, splits=splits, stride_wn=qs.stride(0) // 4,
                stride_sn=stride_sn, stride_dn=stride_dn, HAS_BIAS=bias is not None, BLOCK_N=block_n,
                NG=block_k // 32, STAGES=stages, Q4=layout.q4, GROUP=layout.group,
                EVEN=N % block_n == 0 and K % block_k == 0, SCALES=layout.scales, MINS=layout.mins,
                SUB=256 // layout.group)


#: ``MONOBATCH_PACKED_GEMV_PAIR=1``: a weight of two packed parts (a Q4_K_M file's qkv: q and k in
#: Q4_K, v in Q6_K) takes one DP4A launch for both (:func:`gemv_pair`) instead of one a part. Off
#: by default until timed on a GPU (the A/B switch).
PAIR = env.flag("MONOBATCH_PACKED_GEMV_PAIR", False)
#: Most rows :func:`gemv_pair` takes: at 4 rows its kernel at llama-8b's qkv (two bodies of 128
#: weight bytes a thread a step) spills 8 bytes on sm_90 (ptxas, 2026-12-06); 1-3 rows none.
PAIR_MAX_M = 3


def gemv_pair(x: torch.Tensor, parts: list, y: torch.Tensor, bias: torch.Tensor | None = None,
              gated: bool = False) -> bool:
    """Two packed parts of one weight by the DP4A GEMV in one launch: part 0 into ``y``'s first
    ``N0`` columns, part 1 into the rest, each with the config, split and warps its own launch would
    have (:func:`gemv_config`), so each part's columns have its own launch's bits.

    Args:
        x: ``[M, K]`` (``[M, 2K]`` with ``gated``), M <= :data:`PAIR_MAX_M`.
        parts: the weight's parts, ``N0 + N1`` rows together.
        y: ``[M, N0 + N1]``, unit stride along N, written.
        bias: ``[N0 + N1]`` or None.

    Returns:
        True when launched; False where it does not apply (:data:`PAIR` off, not two parts, more
        than PAIR_MAX_M rows, the batch-invariant mode, a part whose config is not DP4A, or configs
        of other warps or stages): the caller then launches each part itself.

    Raises:
        RuntimeError: no Triton. ValueError: x, a part, y or bias that do not fit.
    """
    M = x.shape[0]
    if not PAIR or len(parts) != 2 or M == 0 or M > PAIR_MAX_M or invariant_gemm.active():
        return False
    (n0, K), (n1, _) = (_check(x, p, gated) for p in parts)
    if y.shape != (M, n0 + n1) or y.stride(1) != 1 or (bias is not None and bias.shape != (n0 + n1,)):
        raise ValueError(f"y must be [{M}, {n0 + n1}] with unit stride along N (bias [{n0 + n1}])")
    cfgs = [gemv_config(n, K, M, p.layout, device=x.device) for n, p in zip((n0, n1), parts)]
    if any(c[5] != DP4A for c in cfgs) or cfgs[0][3:5] != cfgs[1][3:5]:  # (one launch: one warps, one stages)
        return False
    for p, (block_n, block_k, *_) in zip(parts, cfgs):  # (gemv's check of a config)
        bw = block_k // (2 if p.layout.q4 else 1)
        if block_k % 32 or bw & (bw - 1) or block_n & (block_n - 1):
            raise ValueError("BLOCK_K must be a power of two times 32, BLOCK_N a power of two")
    x = x if x.stride(1) == 1 else x.contiguous()
    tiles = [-(-n // c[0]) for n, c in zip((n0, n1), cfgs)]
    slices = [_slices(K, c[1], c[2]) for c in cfgs]  # (k_per, splits) a part
    split = any(sp > 1 for _, sp in slices)
    cnt = counters(x.device, sum(tiles)) if split else COUNTERS.get(x.device)
    cnt = y.new_empty(1, dtype=torch.int32) if cnt is None else cnt  # unused without split-K
    args = {}
    for i, (p, (block_n, block_k, _, _, stages, _), (k_per, splits), lo, hi) in enumerate(
            zip(parts, cfgs, slices, (0, n0), (n0, n0 + n1))):
        ws = torch.empty((splits, M, hi - lo) if splits > 1 else (1,), dtype=torch.float32, device=x.device)
        part = _dp4a_part(p, y[:, lo:hi], None if bias is None else bias[lo:hi], ws,
                          cnt[tiles[0] * i:] if split else cnt, K, block_n, block_k, k_per, splits, stages)
        args.update({f"{k}_{'AB'[i] if k[0].isupper() else 'ab'[i]}": v for k, v in part.items()})
    programs = tiles[0] * slices[0][1] + tiles[1] * slices[1][1]
    _gemv_dp4a_pair_kernel[(programs,)](
        X=x, M=M, K=K, NG_ROW=K // 32, stride_xm=x.stride(0), stride_ym=y.stride(0), tiles_a=tiles[0],
        tiles_b=tiles[1], ROWS=M, M_PAD=_pow2(M), GATED=gated, ASM=_DP4A_ASM, **args, num_warps=cfgs[0][3],
        num_stages=cfgs[0][4], **pdl.launch(x.device))
    return True


def gemm(x: torch.Tensor, w, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
         out: torch.Tensor | None = None, config: tuple | None = None) -> torch.Tensor:
    """``x @ W^T (+ bias)`` by the tiled dequantizing GEMM, any M (arguments as :func:`gemv`).

    Args:
        config: ``(BM, BN, BK, num_warps, num_stages)``, BK a multiple of 32 (64 at least for Q4:
            each ``tl.dot`` takes BK/2 >= 16 columns); None: :func:`gemm_config`, or
            :data:`INVARIANT_TILE` inside :func:`monobatch.kernels.invariant_gemm.mode` (True).

    Returns:
        ``[M, N]``; its rows' bits do not depend on M for a given config (one K order, no split-K).

    Raises:
        RuntimeError: no Triton. ValueError: shapes that do not fit.
    """
    N, K = _check(x, w)
    layout, qs = w.layout, w.qs
    M = x.shape[0]
    y = _out(x, N, out_dtype, out)
    if M == 0 or N == 0:
        return y
    if config is None:
        config = INVARIANT_TILE if invariant_gemm.active() else gemm_config(M, N)
    bm, bn, bk, warps, stages = config
    bw = bk // 2 if layout.q4 else bk
    if bk % 32 or bw < 16:
        raise ValueError(f"BK {bk}: a multiple of 32, and at least 64 for a Q4 layout")
    x = x if x.stride(1) == 1 else x.contiguous()
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn),)
    scale, minimum, sup, stride_sn, stride_dn = _scale_args(w)
    _gemm_kernel[grid](x, qs, scale, minimum, sup, y if bias is None else bias.contiguous(), y, M, N,
                       K // (2 if layout.q4 else 1), x.stride(0), qs.stride(0), stride_sn, stride_dn, y.stride(0),
                       HAS_BIAS=bias is not None, BM=bm, BN=bn, BW=bw, GROUP_M=8, IEEE=x.dtype == torch.float32,
                       **_codes(w), num_warps=warps, num_stages=stages)
    return y


def _dequant_min_m() -> int:
    """``MONOBATCH_PACKED_DEQUANT_M`` (default and least :data:`MAX_M` + 1: below it the tiled
    GEMM or the GEMV runs anyway); not an integer: one warning, the default."""
    return max(MAX_M + 1, env.number("MONOBATCH_PACKED_DEQUANT_M", MAX_M + 1, parse=int, check=lambda v: True,
                                     what="an integer"))


#: Rows from which a packed product (outside batch-invariant mode, 16-bit activations) dequantizes
#: the whole weight into a temporary in x's dtype and multiplies it with cuBLAS
#: (:func:`dequant_matmul`: the ``--weights dequant`` path's product, so its bits) instead of the
#: tiled packed GEMM, which dequantizes every weight tile once per row tile and fills few programs
#: at a batch-decode M (llama-1b Q4_0 on the H200, 2026-12-03: TTFT at 256 tokens 8.3 ms packed
#: against 2.8 dequantized, batched 64 x (128 + 128) 19.8k against 54.3k tok/s after). Inside a
#: captured CUDA graph the temporary stays reserved in the graph's memory pool (up to the widest
#: weight: the LM head, 192 MiB for llama-1b). ``MONOBATCH_PACKED_DEQUANT_M`` sets it (A/B runs; at
#: least MAX_M + 1, the GEMV takes fewer rows; a value above any batch keeps the tiled GEMM).
DEQUANT_MIN_M = _dequant_min_m()
_ROWS: dict[tuple[torch.device, int], torch.Tensor] = {}


def dequant_rows(x: torch.Tensor) -> bool:
    """Whether a packed product of ``x`` (``[M, K]``) takes :func:`dequant_matmul`: M >=
    :data:`DEQUANT_MIN_M`, bf16/fp16 activations, outside batch-invariant mode (whose products all
    take the tiled GEMM's fixed order)."""
    return x.shape[0] >= DEQUANT_MIN_M and x.dtype in (torch.bfloat16, torch.float16) and not invariant_gemm.active()


def dequant_matmul(x: torch.Tensor, parts: list, bias: torch.Tensor | None = None,
                   out_dtype: torch.dtype | None = None, gated: bool = False) -> torch.Tensor:
    """``x @ W^T (+ bias)`` with W ``[N, K]`` the row blocks ``parts`` (packed parts as
    :func:`take`'s, in row order) dequantized into one temporary in x's dtype (one :func:`take`
    launch a part, each into its rows: the weights ``--weights dequant`` loads, bit for bit) and
    multiplied by :func:`monobatch.kernels.gemv.linear` in one call: the dequant path's product of
    the fused weight. x ``[M, K]`` (``[M, 2K]`` with ``gated``: ``silu_mul``'s product first).
    CUDA-graph capturable (the row ids are made once per device and row count).

    Returns:
        ``[M, N]`` in ``out_dtype`` (None: x's).

    Raises:
        RuntimeError: no Triton.
    """
    from monobatch.kernels.gemv import linear
    K = parts[0].qs.shape[1] * (2 if parts[0].layout.q4 else 1)
    w = torch.empty(sum(p.qs.shape[0] for p in parts), K, dtype=x.dtype, device=x.device)
    lo = 0
    for part in parts:
        rows = part.qs.shape[0]
        key = (part.qs.device, rows)
        ids = _ROWS.get(key)
        if ids is None:
            ids = _ROWS[key] = torch.arange(rows, device=part.qs.device)
        take(ids, part, x.dtype, out=w[lo:lo + rows])
        lo += rows
    return linear(fused.silu_mul(x) if gated else x, w, bias, out_dtype)


def matmul(x: torch.Tensor, w, bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None,
           out: torch.Tensor | None = None, gated: bool = False) -> torch.Tensor:
    """One packed part ``w``'s product on CUDA (:meth:`monobatch.quant.packed.PackedWeight.matmul`'s
    kernels): x ``[M, K]`` (``[M, 2K]`` gate/up rows with ``gated``, the product's input then
    ``silu(gate) * up``) -> ``[M, N]``. Batch-invariant mode: :func:`gemm` with
    :data:`INVARIANT_TILE` for every M; else :func:`gemv` up to :data:`MAX_M` rows,
    :func:`dequant_matmul` where :func:`dequant_rows`, :func:`gemm` otherwise (gated: after
    :func:`monobatch.kernels.fused.silu_mul`, whose bits the gated GEMV reproduces)."""
    if x.shape[0] <= MAX_M and not invariant_gemm.active():
        return gemv(x, w, bias, out_dtype, out, gated=gated)
    if dequant_rows(x):
        y = dequant_matmul(x, [w], bias, out.dtype if out is not None else out_dtype, gated)
        return y if out is None else out.copy_(y)
    if gated:
        x = fused.silu_mul(x)
    return gemm(x, w, bias, out_dtype, out)


def group_scales(w) -> tuple[torch.Tensor, torch.Tensor]:
    """A packed part's per-group scales and mins as float32 ``[R, K/G]`` each, whatever its layout's
    codes (:mod:`monobatch.quant.formats`): the values :func:`monobatch.quant.formats.repack`
    stores, bit for bit (``d * sc`` and ``-(dmin * m)`` are exact in float32; a ZERO min is -0.0,
    NEG8 ``-8 * scale``). Torch ops, any device."""
    layout = w.layout
    scale = w.scale.to(torch.float32)
    if FACTORED in (layout.scales, layout.mins):
        sup = w.sup.to(torch.float32).repeat_interleave(256 // layout.group, dim=1)  # [R, K/G, 2]
    if layout.scales == FACTORED:
        scale = sup[..., 0] * scale
    if layout.mins == DIRECT:
        minimum = w.minimum.to(torch.float32)
    elif layout.mins == FACTORED:
        minimum = -(sup[..., 1] * w.minimum.to(torch.float32))
    elif layout.mins == NEG8:
        minimum = -8 * scale
    else:
        minimum = torch.full_like(scale, -0.0)
    return scale, minimum


def dequantize(w, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A packed part's rows -> ``[R, K]`` in ``dtype`` with torch ops on any device (CUDA's
    embedding lookups, ``PackedWeight.dequantize`` there). ``q * scale`` is exact in float32 (an
    fp16 times an integer of at most 8 bits), so the float32 result is bitwise
    ``gguf.quants.dequantize``'s (Q4_0's signed zeros aside, formats.py). Capturable in a CUDA graph.

    Args:
        w: a packed part (as :func:`take`'s): ``qs`` uint8 ``[R, K/2]`` (Q4) or int8 ``[R, K]``
            (Q8), its scales as its layout holds them (:func:`group_scales`).
    """
    qs, layout = w.qs, w.layout
    R, G = qs.shape[0], layout.group
    if layout.q4:
        b = qs.reshape(R, -1, 16)
        q = torch.cat([b & 15, b >> 4], dim=-1)  # [R, K/32, 32] in column order
    else:
        q = qs.reshape(R, -1, G)
    scale, minimum = group_scales(w)
    out = q.to(torch.float32) * scale.unsqueeze(-1) + minimum.unsqueeze(-1)
    return out.reshape(R, -1).to(dtype)
