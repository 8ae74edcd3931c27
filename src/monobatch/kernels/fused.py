"""Fused element-wise kernels for CUDA (Triton): RMSNorm, residual add + RMSNorm, rotary
embedding (of one tensor, or of q and k together), SiLU-gated product.

Each replaces a chain of small torch ops (RMSNorm is eight kernels in eager torch, RoPE five per
tensor) with one kernel; at B=1 a decode step is hundreds of such launches, so on the GPU their
count, not their arithmetic, sets the time. :func:`add_rms_norm` also folds the residual add into
the norm that follows it (vLLM's ``fused_add_rms_norm``) and :func:`rope_qk` rotates q and k in one
launch, read straight from the packed qkv projection. Each kernel computes one row (one token, or one token
and head) alone, in a fixed order, so results do not depend on the batch (deterministic mode
keeps its guarantee). The torch versions in :mod:`monobatch.models` stay the reference and the
CPU path; :func:`enabled` says whether a tensor takes the fused path.

``MONOBATCH_FUSED_KERNELS=0`` turns them off (A/B measurements, or a Triton problem).
"""

from __future__ import annotations


import torch

from monobatch import env
from monobatch.kernels import pdl
from monobatch.kernels.common import tl, triton

_ON = env.flag("MONOBATCH_FUSED_KERNELS", True)


def enabled(x: torch.Tensor) -> bool:
    """True when ``x`` takes the fused path: on CUDA, Triton present, not switched off."""
    return _ON and triton is not None and x.is_cuda


if triton is not None:

    @triton.jit
    def _rms_norm_kernel(X, W, Y, stride_x, stride_y, n, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)  # a weight: before the wait (kernels/pdl.py)
        pdl.wait_prior_small(PDL)
        x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
        x32 = x.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(x32 * x32, 0) / n + eps)
        y = w * (x32 * inv).to(x.dtype).to(tl.float32)  # as the reference: normalise in fp32, cast, scale
        tl.store(Y + row * stride_y + offs, y.to(x.dtype), mask=mask)

    @triton.jit
    def _add_rms_norm_kernel(X, D, W, R, Y, stride_x, stride_d, stride_r, stride_y, n, eps, BLOCK: tl.constexpr,
                             PDL: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)  # a weight: before the wait
        pdl.wait_prior_small(PDL)
        x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0)
        d = tl.load(D + row * stride_d + offs, mask=mask, other=0.0).to(tl.float32)
        s = (x.to(tl.float32) + d).to(x.dtype)  # torch's add: fp32, rounded once to the dtype
        tl.store(R + row * stride_r + offs, s, mask=mask)
        s32 = s.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(s32 * s32, 0) / n + eps)
        y = w * (s32 * inv).to(x.dtype).to(tl.float32)  # as _rms_norm_kernel
        tl.store(Y + row * stride_y + offs, y.to(x.dtype), mask=mask)

    @triton.jit
    def _rotate(base, COS, SIN, t, stride_ct, HALF: tl.constexpr, BLOCK: tl.constexpr):
        # one head of token t at ``base``: x * cos + rotate_half(x) * sin with rotate_half(x) =
        # cat(-x2, x1), in fp32, rounded once; returns both halves in x's dtype
        offs = tl.arange(0, BLOCK)
        mask = offs < HALF
        x1 = tl.load(base + offs, mask=mask, other=0.0)
        dtype = x1.dtype
        x1 = x1.to(tl.float32)
        x2 = tl.load(base + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        c1 = tl.load(COS + t * stride_ct + offs, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(COS + t * stride_ct + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(SIN + t * stride_ct + offs, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(SIN + t * stride_ct + HALF + offs, mask=mask, other=0.0).to(tl.float32)
        return (x1 * c1 - x2 * s1).to(dtype), (x2 * c2 + x1 * s2).to(dtype)

    @triton.jit
    def _store_halves(out, y1, y2, HALF: tl.constexpr, BLOCK: tl.constexpr):
        # one rotated head at ``out``: its two halves, as _rotate returns them
        offs = tl.arange(0, BLOCK)
        mask = offs < HALF
        tl.store(out + offs, y1, mask=mask)
        tl.store(out + HALF + offs, y2, mask=mask)

    @triton.jit
    def _rope_kernel(X, COS, SIN, Y, stride_xt, stride_xh, stride_ct, stride_yt, stride_yh,
                     HALF: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        t = tl.program_id(0)
        h = tl.program_id(1)
        pdl.wait_prior_small(PDL)
        y1, y2 = _rotate(X + t * stride_xt + h * stride_xh, COS, SIN, t, stride_ct, HALF, BLOCK)
        _store_halves(Y + t * stride_yt + h * stride_yh, y1, y2, HALF, BLOCK)

    @triton.jit
    def _rope_qk_kernel(QKV, COS, SIN, Q, K, K_CACHE, V_CACHE, SLOTS, stride_t, stride_ct, stride_qt, stride_kt,
                        stride_cs, stride_ch, NQ: tl.constexpr, NKV: tl.constexpr, HD: tl.constexpr,
                        HALF: tl.constexpr, BLOCK: tl.constexpr, STORE: tl.constexpr, PDL: tl.constexpr):
        # program (t, h): head h of token t in the packed projection, h < NQ a q head, else a k
        # head; STORE: a k head's program writes the rotated k and its v head straight into the
        # KV pool at token t's slot (store_kv's copies, the same bits) instead of into K
        t = tl.program_id(0)
        h = tl.program_id(1)
        pdl.wait_prior_small(PDL)
        y1, y2 = _rotate(QKV + t * stride_t + h * HD, COS, SIN, t, stride_ct, HALF, BLOCK)
        if h < NQ:
            _store_halves(Q + t * stride_qt + h * HD, y1, y2, HALF, BLOCK)
        elif STORE:
            slot = tl.load(SLOTS + t).to(tl.int64)
            dst = slot * stride_cs + (h - NQ) * stride_ch
            _store_halves(K_CACHE + dst, y1, y2, HALF, BLOCK)
            offs = tl.arange(0, BLOCK * 2)
            mask = offs < HD
            v = tl.load(QKV + t * stride_t + (h + NKV) * HD + offs, mask=mask)
            tl.store(V_CACHE + dst + offs, v, mask=mask)
        else:
            _store_halves(K + t * stride_kt + (h - NQ) * HD, y1, y2, HALF, BLOCK)

    @triton.jit
    def silu_mul_math(g, u):
        # SwiGLU's gate of loaded values (g in the model dtype, or fp32 in the interpreter tests;
        # u any): silu in fp32, rounded like torch's, times u in fp32, rounded once to g's dtype. Shared by silu_mul and the GEMV's
        # gated input (kernels/gemv.py), so both give the same bits.
        g32 = g.to(tl.float32)
        act = (g32 / (1.0 + tl.exp(-g32))).to(g.dtype).to(tl.float32)
        return (act * u.to(tl.float32)).to(g.dtype)

    @triton.jit
    def _silu_mul_kernel(GU, Y, stride_g, stride_y, F, BLOCK: tl.constexpr, PDL: tl.constexpr):
        row = tl.program_id(0)
        col = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = col < F
        pdl.wait_prior_small(PDL)
        g = tl.load(GU + row * stride_g + col, mask=mask, other=0.0)
        u = tl.load(GU + row * stride_g + F + col, mask=mask, other=0.0)
        tl.store(Y + row * stride_y + col, silu_mul_math(g, u), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm (Zhang & Sennrich 2019) of ``x`` ``[..., D]`` with ``weight`` ``[D]``: one program
    per row; same shape and dtype as ``x``. Reference: :class:`monobatch.models.layers.RMSNorm`."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, weight, y, x2.stride(0), y.stride(0), shape[-1], eps,
                                         BLOCK=triton.next_power_of_2(shape[-1]), **pdl.launch(x.device))
    return y.view(shape)


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add then RMSNorm, one program per row (vLLM's ``fused_add_rms_norm``): for ``x``
    and ``delta`` ``[..., D]`` of one dtype and ``weight`` ``[D]``, ``s = x + delta`` (fp32,
    rounded once to the dtype, as torch's add) and ``rms_norm(s)`` as :func:`rms_norm`.

    Returns:
        ``(s, rms_norm(s))``: two new tensors of ``x``'s shape and dtype (nothing is written in
        place: ``x`` may be a view others still read, e.g. a deterministic-mode tile, and new
        buffers are always safe under CUDA-graph capture). Reference:
        :meth:`monobatch.models.layers.RMSNorm.add_forward`.
    """
    assert x.shape == delta.shape and x.dtype == delta.dtype, (x.shape, delta.shape, x.dtype, delta.dtype)
    shape = x.shape
    x2, d2 = x.reshape(-1, shape[-1]), delta.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if d2.stride(-1) != 1:
        d2 = d2.contiguous()
    r = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    y = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _add_rms_norm_kernel[(x2.shape[0],)](x2, d2, weight, r, y, x2.stride(0), d2.stride(0), r.stride(0),
                                             y.stride(0), shape[-1], eps, BLOCK=triton.next_power_of_2(shape[-1]),
                                             **pdl.launch(x.device))
    return r.view(shape), y.view(shape)


def _rows_contiguous(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin as the RoPE kernels read them: unit stride within a row, one row stride for both
    (the table's gather gives two such views; anything else is copied)."""
    if cos.stride(-1) == 1 and sin.stride(-1) == 1 and cos.stride(0) == sin.stride(0):
        return cos, sin
    return cos.contiguous(), sin.contiguous()


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding (Su et al. 2021, HF rotate_half layout) of ``x`` ``[T, heads, hd]`` by
    ``cos``/``sin`` ``[T, hd]``: a new tensor. Reference: :func:`monobatch.models.rope.apply_rope`."""
    T, H, hd = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = _rows_contiguous(cos, sin)
    y = torch.empty((T, H, hd), dtype=x.dtype, device=x.device)
    if T:
        _rope_kernel[(T, H)](x, cos, sin, y, x.stride(0), x.stride(1), cos.stride(0), y.stride(0), y.stride(1),
                             HALF=hd // 2, BLOCK=triton.next_power_of_2(hd // 2), **pdl.launch(x.device))
    return y


def rope_qk(qkv: torch.Tensor, n_q_heads: int, n_kv_heads: int, head_dim: int,
            cos: torch.Tensor, sin: torch.Tensor,
            store: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Rotary embedding of q and k in one launch, read from the packed projection ``qkv``
    ``[T, (H + 2K) * hd]`` (q heads, then k heads, then v heads; rows may be strided) with
    ``cos``/``sin`` ``[T, hd]``: one program per (token, q or k head).

    Args:
        store: ``(k_cache, v_cache, slot_mapping)`` (pools ``[slots, K, hd]`` with unit stride
            along hd, slots ``[T]`` int): the rotated k and the v heads are written straight into
            the pools at row t's slot (what :func:`monobatch.kernels.paged_decode.store_kv` of
            the returned k and v would write, the same bits, one launch fewer) and k is not returned.

    Returns:
        q ``[T, H, hd]`` and k ``[T, K, hd]`` (None with ``store``), each a new contiguous tensor
        (the layouts :func:`rope` gives). Reference: :func:`monobatch.models.rope.apply_rope` on each.

    Raises:
        ValueError: ``store``'s pools are not ``[slots, K, hd]`` of qkv's dtype with one layout
            and unit stride along hd, or its slots are not ``[T]`` contiguous.
    """
    T = qkv.shape[0]
    hd = head_dim
    assert qkv.shape[-1] == (n_q_heads + 2 * n_kv_heads) * hd and hd % 2 == 0, (qkv.shape, n_q_heads, n_kv_heads, hd)
    if qkv.stride(-1) != 1:
        qkv = qkv.contiguous()
    cos, sin = _rows_contiguous(cos, sin)
    q = torch.empty((T, n_q_heads, hd), dtype=qkv.dtype, device=qkv.device)
    if store is None:  # k heads go to a new k [T, K, hd]; the kernel's pool and slot arguments are unused
        k = torch.empty((T, n_kv_heads, hd), dtype=qkv.dtype, device=qkv.device)
        k_out, k_cache, v_cache, slots = k, k, k, q  # (placeholders of the right kind for the launch)
    else:  # k heads and v heads go to the pools at each row's slot; no k is returned
        k_cache, v_cache, slots = store
        if not (k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
                and k_cache.dtype == v_cache.dtype == qkv.dtype and tuple(k_cache.shape[1:]) == (n_kv_heads, hd)
                and tuple(slots.shape) == (T,) and slots.is_contiguous()):
            raise ValueError(f"rope_qk store: pools {tuple(k_cache.shape)} / {tuple(v_cache.shape)} "
                             f"({k_cache.dtype}, {v_cache.dtype}) and slots {tuple(slots.shape)} do not fit "
                             f"q/k of {n_kv_heads} x {hd} ({qkv.dtype}) for {T} rows")
        k, k_out = None, k_cache
    if T:
        _rope_qk_kernel[(T, n_q_heads + n_kv_heads)](qkv, cos, sin, q, k_out, k_cache, v_cache, slots,
                                                      qkv.stride(0), cos.stride(0), q.stride(0), k_out.stride(0),
                                                      k_cache.stride(0), k_cache.stride(1), NQ=n_q_heads, NKV=n_kv_heads,
                                                      HD=hd, HALF=hd // 2, BLOCK=triton.next_power_of_2(hd // 2),
                                                      STORE=k is None, **pdl.launch(qkv.device))
    return q, k


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate (Shazeer 2020): ``silu(gate) * up`` for ``gate_up`` = cat(gate, up) ``[T, 2F]``
    -> ``[T, F]``. Reference: :class:`monobatch.models.layers.GatedMLP`."""
    T, F2 = gate_up.shape
    F = F2 // 2
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    y = torch.empty((T, F), dtype=gate_up.dtype, device=gate_up.device)
    block = 1024
    if T:
        _silu_mul_kernel[(T, triton.cdiv(F, block))](gate_up, y, gate_up.stride(0), y.stride(0), F, BLOCK=block,
                                                                **pdl.launch(y.device))
    return y
