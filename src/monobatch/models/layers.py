"""The layers every model family is built from (mlx-lm's layout: each family file states only
what differs, see :mod:`monobatch.models.registry`).

Everything here is batch-native over a flat :class:`~monobatch.batch.StepBatch`: ``[T, ...]``
rows of any number of sequences. Attention's projections live here; the attention itself runs in
the KV store (:meth:`monobatch.kv.store.KvStore.attend`), the only way a model touches its cache.

Shape letters: T tokens in the step, R rows that want logits, D hidden size, H query heads,
K KV heads, hd head dim, F FFN size, V vocab.

Weights are held packed (nano-vllm style): ``qkv_proj`` = cat(q, k, v) rows and
``gate_up_proj`` = cat(gate, up) rows. The loaders fill them from HF names (:data:`PACKED`),
whatever the file format.

The residual stream is carried as (residual, pending delta), as in vLLM's Llama: a sublayer's
output is not added where it is made but by the norm that follows it,
:meth:`RMSNorm.add_forward`, which is one fused kernel on CUDA
(:func:`monobatch.kernels.fused.add_rms_norm`). The torch path runs the same ops in the same
order as the plain pre-norm block (an add in the model dtype, then the norm), so its results are
bitwise those of ``x = x + sublayer(norm(x))``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch
import torch.nn.functional as F
from torch import nn

from monobatch.batch import StepBatch
from monobatch.kernels import cpu_ops, fused, gemv, invariant_gemm, quant_cpu
from monobatch.models.args import ModelArgs
from monobatch.models.rope import RotaryEmbedding, apply_rope, rope_inv_freq
from monobatch.quant.packed import GEMV_ROWS, PackedWeight

if TYPE_CHECKING:
    from monobatch.kv.store import KvStore

#: HF tensor suffix -> (packed parameter, index of its slice). Read by the loaders.
PACKED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def rowwise(tile: int, fn, *xs: torch.Tensor, pad: bool = True, **kw):
    """Apply a row-wise ``fn`` to ``xs`` (each ``[T, ...]``; ``kw`` passed as they are), in fixed
    tiles when ``tile`` > 0.

    Deterministic mode (``tile`` = N): the rows are zero-padded to a multiple of N and ``fn`` runs
    on ``[N, ...]`` tiles only, so every GEMM, reduction and vectorised activation has the same
    shape whatever the batch holds, and a row's result depends on that row alone (a 1-row GEMM
    differs bitwise from the same row inside a larger one; see the ADR). ``tile`` 0 is one call.
    ``pad`` False (a model whose row-wise ops compute each row alone by construction,
    :meth:`DecoderModel.rows_independent`): tiles of at most N rows, the last one not padded.

    Returns:
        ``fn``'s output (a tensor or a tuple of tensors), ``T`` rows each.
    """
    T = xs[0].shape[0]
    if tile <= 0 or T == 0 or (not pad and T <= tile):
        return fn(*xs, **kw)
    extra = -T % tile if pad else 0
    if extra:
        xs = tuple(torch.cat([x, x.new_zeros(extra, *x.shape[1:])]) for x in xs)
    tiles = [fn(*(x[i:i + tile] for x in xs), **kw) for i in range(0, T + extra, tile)]
    if isinstance(tiles[0], (tuple, list)):  # a list: a C++ route's outputs
        return tuple(torch.cat(parts)[:T] for parts in zip(*tiles))
    return torch.cat(tiles)[:T]


def param(*shape: int) -> nn.Parameter:
    """An uninitialised parameter (torch.empty: no random init; the loader fills every one)."""
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def matmul(x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None = None,
           out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``: x ``[..., K]``, weight ``[N, K]`` dense or packed -> ``[..., N]``
    in ``out_dtype`` (None: x's dtype). The one product every layer and the LM head call: a dense
    weight goes to :func:`monobatch.kernels.gemv.linear`, a :class:`PackedWeight` to its
    dequantizing kernel (:meth:`PackedWeight.matmul`)."""
    if isinstance(weight, PackedWeight):
        return weight.matmul(x, bias, out_dtype)
    return gemv.linear(x, weight, bias, out_dtype=out_dtype)


def hold_packed(module: nn.Module, name: str, weight: PackedWeight) -> None:
    """Replace ``module``'s parameter ``name`` (an unfilled ``[N, K]``) by a packed weight of that shape.

    Raises:
        ValueError: the shapes differ.
    """
    dense = getattr(module, name)
    if tuple(dense.shape) != weight.shape:
        raise ValueError(f"packed weight {weight.shape} for a parameter of shape {tuple(dense.shape)}")
    delattr(module, name)  # the parameter's (never touched) storage goes with it
    setattr(module, name, weight)


class CpuRoute:
    """The fused CPU route of a block's half (:meth:`Attention.add_norm_project`,
    :meth:`GatedMLP.attn_add_forward`): its C++ entry point and the arguments that do not change
    between steps (weight handles, norm weights, shapes), decided at the first call after load.

    The route is a kernel choice, not a second forward: it runs where the unfused layers would run
    the CPU ops of :mod:`monobatch.kernels.cpu_ops` and the packed GEMV back to back (float32 on
    CPU, single-part packed weights without bias, at most :data:`GEMV_ROWS` rows), and its C++
    calls those same functions in the same order, so the bits are the same. A copy of the module
    (``deepcopy``, pickling: tensor-parallel shards) gets an undecided route;
    :meth:`DecoderModel.to_device` forgets it (weights moved).

    Attributes:
        call: None until decided; False: this module takes the unfused path; else
            ``(function, *fixed arguments)``.
    """

    __slots__ = ("call",)

    def __init__(self) -> None:
        self.call = None

    def __deepcopy__(self, memo: dict) -> "CpuRoute":
        return CpuRoute()

    def __reduce__(self):
        return CpuRoute, ()

    @staticmethod
    def usable(x: torch.Tensor) -> bool:
        """Whether rows ``x`` ``[T, ...]`` can take a decided route: float32, on CPU, few rows."""
        return x.dtype is torch.float32 and x.is_cpu and x.shape[0] <= GEMV_ROWS

    def decide(self, build, *args) -> tuple | bool:
        """Set and return ``self.call``: ``build(*args)`` (a tuple, or False) where the fused CPU
        ops are available, else False."""
        self.call = build(*args) if cpu_ops.available() else False
        return self.call

    def resolve(self, build, *args) -> tuple | bool:
        """``self.call``, decided first (:meth:`decide`) where it is not yet."""
        call = self.call
        return self.decide(build, *args) if call is None else call


def row_independent(w: torch.Tensor | PackedWeight) -> bool:
    """Whether an output row of ``x @ w.T`` has the same bits whatever other rows ``x`` and ``w``
    hold, by construction: the packed CPU kernel computes each output element alone
    (``parallel_for`` over the weight's rows, one dot product each; :mod:`monobatch.kernels.quant_cpu`),
    so a column-parallel layer's pieces can share one call in deterministic mode and that mode
    needs no padded row tiles around it (:meth:`DecoderModel.rows_independent`). Up to
    :data:`~monobatch.quant.packed.GEMV_ROWS` rows a call: above, :meth:`PackedWeight.matmul`
    dequantizes and calls a library GEMM, so the deterministic mode's unpadded tiles are at most
    that many rows (``Engine.row_tile``). A library GEMM (MKL, cuBLAS, Triton tiles) promises
    nothing across M or N."""
    return isinstance(w, PackedWeight) and w.device.type == "cpu"


def combined_mat(mats: list, widths: list[int] | None = None):
    """One ``PackedMat`` handle for several (None where any is None): the one itself; parts over
    consecutive output rows (``widths`` None: their products concatenated, as
    :meth:`PackedWeight.matmul` does); pieces over consecutive input columns of ``widths`` (their
    products summed in piece order, as :class:`~monobatch.distributed.sharding.RowParallelLinear`
    does in deterministic mode). The same calls in the same order: the same bits, for up to
    :data:`~monobatch.quant.packed.GEMV_ROWS` rows of x (the C++ handle always takes the GEMV; the
    Python products dequantize above that; :func:`row_independent`)."""
    if not mats or any(m is None for m in mats):
        return None
    if len(mats) == 1:
        return mats[0]
    handle = quant_cpu.module().PackedMat
    return handle.concat(mats) if widths is None else handle.pieces(mats, list(widths))


def packed_mat(lin: nn.Module):
    """The C++ handle (``PackedMat``) of a linear layer whose product the fused CPU ops make with
    the bits of the layer's own forward, or None: a plain :class:`Linear` whose weight is packed on
    the CPU, without bias (one part, or several over its output rows); a sharded layer's own
    (its ``fused_mat``: :mod:`monobatch.distributed.sharding`)."""
    if type(lin) is not Linear:
        fused = getattr(lin, "fused_mat", None)
        return fused() if fused is not None else None
    if lin.bias is not None or not row_independent(lin.weight):
        return None
    return combined_mat([p.mat() for p in lin.weight.parts])


def fused_cpu_linears(*lins: nn.Module) -> bool:
    """Whether every one of ``lins`` has a ``PackedMat`` handle (:func:`packed_mat`: packed CPU
    weights without bias, this process's whole product): products whose every output element is
    computed alone (:func:`row_independent`)."""
    return cpu_ops.available() and all(packed_mat(lin) is not None for lin in lins)


def plain_norm(norm: nn.Module) -> bool:
    """Whether ``norm`` is a plain :class:`RMSNorm` (the fused routes' norm) on a float32 CPU weight."""
    return type(norm) is RMSNorm and norm.weight.dtype is torch.float32 and norm.weight.is_cpu


class Linear(nn.Module):
    """y = x W^T (+ b), weight ``[out, in]``: a dense parameter (no init; the loader fills it) or,
    once the loader calls :func:`hold_packed`, a :class:`PackedWeight`; either way through
    :func:`matmul`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight: torch.Tensor | PackedWeight = param(out_features, in_features)
        self.bias = param(out_features) if bias else None

    @property
    def packed(self) -> bool:
        """Whether the weight is held packed."""
        return isinstance(self.weight, PackedWeight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, in]`` -> ``[T, out]`` (few-row inputs on CUDA: :func:`monobatch.kernels.gemv.linear`)."""
        return matmul(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    """RMSNorm (Zhang & Sennrich 2019), computed in float32 like HF's LlamaRMSNorm: ``weight *
    (x / rms(x))``. Gemma's ``(1 + weight)`` form is this norm with ``1 + weight`` stored (GGUF
    files hold it so; the HF loader adds the 1, :func:`monobatch.models.gemma3.hf_tensor`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = param(dim)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[..., dim]`` -> same shape and dtype (one fused kernel on CUDA: :mod:`monobatch.kernels.fused`)."""
        if fused.enabled(x):
            return fused.rms_norm(x, self.weight, self.eps)
        if cpu_ops.enabled(x):  # one call on CPU (float32)
            return cpu_ops.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)

    def add_forward(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Residual add then norm: x and delta ``[..., dim]`` (one dtype) -> ``(s, norm(s))`` with
        ``s = x + delta`` in that dtype; one fused kernel on CUDA (:func:`fused.add_rms_norm`,
        new tensors, ``x`` is not written)."""
        if fused.enabled(x):
            return fused.add_rms_norm(x, delta, self.weight, self.eps)
        if cpu_ops.enabled(x):
            return cpu_ops.add_rms_norm(x, delta, self.weight, self.eps)
        x = x + delta
        return x, self.forward(x)


class Attention(nn.Module):
    """Grouped-query attention's projections: packed QKV, optional qkv bias (Qwen2) and q/k norm
    (Qwen3, Gemma 3). The attention itself runs in the KV store (:meth:`KvStore.attend`).

    Args:
        args: the model's shapes (``attention_bias``, ``qk_norm``).
        layer: this layer's index (the KV store's layer).
        q_scale: multiplies q after RoPE when not 1.0, so the store's softmax scale
            ``1/sqrt(hd)`` becomes the family's (Gemma's ``query_pre_attn_scalar ** -0.5``).
    """

    def __init__(self, args: ModelArgs, layer: int, q_scale: float = 1.0) -> None:
        super().__init__()
        self.layer = layer
        self.n_heads, self.n_kv, self.hd = args.num_attention_heads, args.num_key_value_heads, args.head_dim
        self.q_size, self.kv_size = self.n_heads * self.hd, self.n_kv * self.hd
        self.q_scale = q_scale
        self.qkv_proj = Linear(args.hidden_size, self.q_size + 2 * self.kv_size, bias=args.attention_bias)
        self.o_proj = Linear(self.q_size, args.hidden_size)
        self.q_norm = RMSNorm(self.hd, args.rms_norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(self.hd, args.rms_norm_eps) if args.qk_norm else None
        self.cpu_route = CpuRoute()  # add_norm_project's fused CPU call

    def add_norm_project(self, norm: RMSNorm, residual: torch.Tensor, delta: torch.Tensor | None,
                         cos: torch.Tensor, sin: torch.Tensor, store: tuple | None = None) -> tuple[torch.Tensor, ...]:
        """The residual add, the block's input ``norm`` and :meth:`project`: residual and delta
        ``[T, D]`` (delta None: nothing to add) -> (residual + delta ``[T, D]``, q ``[T, H, hd]``,
        k, v ``[T, K, hd]``, or None for both where :meth:`project` stored them at ``store``). On
        CPU (float32, packed qkv, no q/k norm or scale) one C++ call (:class:`CpuRoute`)."""
        call = self.cpu_route.resolve(self._cpu_project, norm)
        if not call or not CpuRoute.usable(residual):
            if delta is None:
                return (residual, *self.project(norm(residual), cos, sin, store))
            residual, h = norm.add_forward(residual, delta)
            return (residual, *self.project(h, cos, sin, store))
        fn, w, eps, mat, n_heads, n_kv, hd = call
        return fn(residual, delta, w, eps, mat, cos, sin, n_heads, n_kv, hd)  # (residual, q, k, v)

    def _cpu_project(self, norm: RMSNorm) -> tuple | bool:
        """:attr:`cpu_route`'s call: (:func:`cpu_ops.add_norm_qkv_rope`'s C++ function, its fixed arguments), or False."""
        mat = packed_mat(self.qkv_proj)
        if mat is None or not plain_norm(norm) or self.q_norm is not None or self.q_scale != 1.0:
            return False
        return cpu_ops.op("add_norm_qkv_rope"), norm.weight, norm.eps, mat, self.n_heads, self.n_kv, self.hd

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                store: tuple | None = None) -> tuple[torch.Tensor, ...]:
        """x ``[T, D]`` (normed), cos/sin ``[T, hd]`` -> q ``[T, H, hd]``, k and v ``[T, K, hd]``
        (norms and RoPE applied). On CUDA without q/k norm, q and k are rotated in one launch
        straight from the packed projection (:func:`fused.rope_qk`); on CPU (float32) in place in
        it (:func:`cpu_ops.rope_qk_`); v is a view of it.

        ``store``: the KV store's ``(k_cache, v_cache, slot_mapping)`` for this layer and step
        (:meth:`monobatch.kv.store.KvStore.store_slots`): where the fused RoPE runs it writes k and v
        there itself and returns None for both (pass them to ``attend`` as they are); elsewhere
        ignored."""
        T = x.shape[0]
        qkv = self.qkv_proj(x)  # (T, (H + 2K) hd)
        if self.q_norm is None and self.q_scale == 1.0 and fused.enabled(qkv):
            q, k = fused.rope_qk(qkv, self.n_heads, self.n_kv, self.hd, cos, sin, store)
            if k is None:
                return q, None, None
            return q, k, qkv[:, self.q_size + self.kv_size:].view(T, self.n_kv, self.hd)
        if self.q_norm is None and self.q_scale == 1.0 and cpu_ops.enabled(qkv):  # q and k rotated in place
            cpu_ops.rope_qk_(qkv, cos, sin, self.n_heads + self.n_kv, self.hd)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            return q.view(T, self.n_heads, self.hd), k.view(T, self.n_kv, self.hd), v.view(T, self.n_kv, self.hd)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.n_heads, self.hd)  # (T, H, hd)
        k = k.view(T, self.n_kv, self.hd)  # (T, K, hd)
        v = v.reshape(T, self.n_kv, self.hd)  # (T, K, hd)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, cos, sin)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        return q, apply_rope(k, cos, sin), v


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation (HF's ``gelu_pytorch_tanh``): ``[...]`` -> same shape and dtype."""
    return F.gelu(x, approximate="tanh")


class GatedMLP(nn.Module):
    """Gated feed-forward (Shazeer 2020): ``down(act(gate(x)) * up(x))``, gate and up packed.
    ``act`` SiLU is SwiGLU (Llama; the CUDA path fuses it into the down GEMV); GELU-tanh is
    GeGLU (Gemma)."""

    def __init__(self, args: ModelArgs, act: Callable[[torch.Tensor], torch.Tensor] = F.silu) -> None:
        super().__init__()
        self.ffn = args.intermediate_size
        self.act = act
        self.gate_up_proj = Linear(args.hidden_size, 2 * self.ffn)
        self.down_proj = Linear(self.ffn, args.hidden_size)
        self.cpu_route = CpuRoute()  # attn_add_forward's fused CPU call

    def attn_add_forward(self, o_proj: nn.Module, norm: RMSNorm, residual: torch.Tensor,
                         attn_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention line's end and this MLP: ``(s, mlp(norm(s)))`` with ``s = residual +
        o_proj(attn_out)``; residual ``[T, D]``, attn_out ``[T, H, hd]`` (or ``[T, H*hd]``) ->
        ``[T, D]`` each. On CPU (float32, packed weights, SwiGLU) one C++ call (:class:`CpuRoute`)."""
        call = self.cpu_route.resolve(self._cpu_forward, o_proj, norm)
        if not call or not CpuRoute.usable(attn_out):
            residual, h = norm.add_forward(residual, o_proj(attn_out.flatten(1)))
            return residual, self(h)
        fn, o, w, eps, gate_up, down = call
        return fn(residual, attn_out, o, w, eps, gate_up, down)  # (s, y); flattens a 3-D attn_out

    def _cpu_forward(self, o_proj: nn.Module, norm: RMSNorm) -> tuple | bool:
        """:attr:`cpu_route`'s call: (C++ function, o handle, norm weight, eps, gate_up and down handles), or False."""
        mats = [packed_mat(lin) for lin in (o_proj, self.gate_up_proj, self.down_proj)]
        if None in mats or not plain_norm(norm) or self.act is not F.silu:
            return False
        return cpu_ops.op("o_add_norm_mlp"), mats[0], norm.weight, norm.eps, mats[1], mats[2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, D]`` -> ``[T, D]``."""
        if self.act is F.silu and type(self.gate_up_proj) is Linear and not self.gate_up_proj.packed:
            # deterministic mode's decode rows: the gate/up GEMM and SiLU in one launch, the same bits
            h = invariant_gemm.glu_linear(x, self.gate_up_proj.weight, self.gate_up_proj.bias)
            if h is not None:
                return self.down_proj(h)
        gate_up = self.gate_up_proj(x)  # (T, 2F)
        # SiLU inside the down GEMV (a plain dense Linear: a tensor-parallel down projection all-reduces)
        if self.act is F.silu and fused.enabled(gate_up) and type(self.down_proj) is Linear and not self.down_proj.packed:
            return gemv.gated_linear(gate_up, self.down_proj.weight, self.down_proj.bias)
        if self.act is F.silu and fused.enabled(gate_up) and type(self.down_proj) is Linear:  # packed: SiLU in its GEMV
            return self.down_proj.weight.cuda_matmul(gate_up, self.down_proj.bias, gated=True)
        if self.act is F.silu and fused.enabled(gate_up):  # a sharded down projection on CUDA: SiLU in one launch
            return self.down_proj(fused.silu_mul(gate_up))
        if self.act is F.silu and cpu_ops.enabled(gate_up):  # silu(gate) * up in one call on CPU
            return self.down_proj(cpu_ops.silu_mul(gate_up))
        if self.act is gelu_tanh and cpu_ops.enabled(gate_up):  # GeGLU likewise
            return self.down_proj(cpu_ops.gelu_tanh_mul(gate_up))
        gate, up = gate_up.split(self.ffn, dim=-1)  # (T, F) each
        return self.down_proj(self.act(gate) * up)


def make_rope(args: ModelArgs, theta: float, scaling: dict | None,
              freq_factors: torch.Tensor | None = None) -> RotaryEmbedding:
    """A :class:`RotaryEmbedding` of the model's head dim for base ``theta`` and ``scaling``."""
    inv_freq, scale = rope_inv_freq(args.head_dim, theta, scaling, args.max_position_embeddings, freq_factors)
    return RotaryEmbedding(inv_freq, scale)


class DecoderModel(nn.Module):
    """What every family's model shares: embeddings ``[V, D]`` (dense, or a :class:`PackedWeight`
    read through :meth:`embed`), ``layers``, the final ``norm``, the LM head (tied to the
    embeddings when the checkpoint has none), the RoPE tables, and :meth:`logits`. A family sets
    ``self.layers`` and ``self.ropes`` and writes ``forward``.

    Attributes:
        ropes: every :class:`RotaryEmbedding` the layers read (one, or Gemma's local and global).
    """

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        self.embed_tokens: torch.Tensor | PackedWeight = param(args.vocab_size, args.hidden_size)  # (V, D)
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.lm_head = None if args.tie_word_embeddings else Linear(args.hidden_size, args.vocab_size)
        self.ropes: tuple[RotaryEmbedding, ...] = ()
        self._placement = 0  # counts to_device calls: a layer chain bound before a move is stale

    @property
    def device(self) -> torch.device:
        """Where the weights live."""
        return self.norm.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """Compute (and KV) dtype (the norms are always held in it, packed weights or not)."""
        return self.norm.weight.dtype

    def embed(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids int64 ``[T]`` -> their embedding rows ``[T, D]`` in the compute dtype."""
        if "vocab_parallel" in self._modules:  # a tensor-parallel shard (monobatch.distributed.sharding)
            return self._modules["vocab_parallel"].embed(token_ids, self.dtype)
        if isinstance(self.embed_tokens, PackedWeight):
            return self.embed_tokens.embedding(token_ids, self.dtype)
        return F.embedding(token_ids, self.embed_tokens)

    def to_device(self, device: torch.device, dtype: torch.dtype) -> "DecoderModel":
        """Move and cast the weights (packed ones are moved as they are); the RoPE tables stay
        float32 until :meth:`build_rope_tables`."""
        self.to(device=device, dtype=dtype)
        self._placement += 1  # the weights moved: every layer chain bound to the old ones is rebuilt
        for m in self.modules():
            if isinstance(getattr(m, "cpu_route", None), CpuRoute):
                m.cpu_route = CpuRoute()  # decided again at the next call, on the moved weights
            for v in vars(m).values():
                if isinstance(v, PackedWeight):
                    v.to(device)
        for rope in self.ropes:
            rope.to(device)
        return self

    def chained(self, batch: StepBatch, kv: KvStore, x: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every layer over the embeddings ``x`` ``[T, D]`` in one C++ call: ``(residual, delta)``
        ``[T, D]`` each, what the family's loop over its layers returns, bit for bit (the
        :meth:`layer_chain` makes the layers' own fused calls in their order). Where it applies:
        float32 on CPU, at most :data:`GEMV_ROWS` rows, no padded row tiles (deterministic mode
        keeps the loop unless :meth:`rows_independent`), every layer on its fused CPU routes and the KV store attending every row of the step
        in its C++ kernel (:meth:`KvStore.chain_inputs`: decode steps). Else None: run the loop.

        Why: a decode step of a small model on CPU spends ~3 Python calls a layer between
        kernels (~2 ms of a ~9 ms step of the bundled model at ``-t 2``; issue 17)."""
        if (batch.row_tile and batch.row_pad) or not CpuRoute.usable(x):
            return None
        chain = self.layer_chain(kv)
        inputs = None if chain is None else kv.chain_inputs(batch, len(self.layers))
        if inputs is None:
            return None
        residual, delta = chain.run(x, cos, sin, *inputs, kv.block_size)
        return residual, delta

    def layer_chain(self, kv: KvStore):
        """The C++ ``LayerChain`` (``csrc/cpu_ops.cpp``) of this model's layers on ``kv``'s caches:
        each layer's ``chain_args(kv)`` bound once, at the first call for this store (kept on it,
        :attr:`KvStore.layer_chain`). None where the fused CPU ops are off or some layer has no
        chain (a family without ``chain_args``, a route that does not apply, a store that does
        not attend through the C++ kernel)."""
        held = kv.layer_chain
        if held is not None and held[0] is self and held[1] == self._placement:
            return held[2]
        chain = None
        if cpu_ops.available() and len(self.layers):
            parts = [layer.chain_args(kv) if hasattr(layer, "chain_args") else None for layer in self.layers]
            if all(p is not None for p in parts):
                chain = cpu_ops.op("LayerChain")()
                for p in parts:
                    chain.add(*p)
        kv.layer_chain = (self, self._placement, chain)
        return chain

    def rows_independent(self) -> bool:
        """Whether every row-wise operation of this model's steps computes each row alone, with
        the same bits whatever other rows the call holds, by construction: every layer's
        (its ``rows_independent``: the C++ norms, RoPE, SwiGLU / GeGLU and the packed GEMV, each
        row alone, csrc/cpu_ops.cpp, and elementwise IEEE products and sums), the final norm a
        plain RMSNorm on the CPU and the LM head packed on the CPU (:func:`row_independent`).
        Then the deterministic mode needs no padded row tiles (:func:`rowwise`'s ``pad``; a
        family with a layer chain runs its steps through :meth:`chained`; ADR 0002). A family
        without the method, dense weights, CUDA: False."""
        if not cpu_ops.available() or not len(self.layers) or not plain_norm(self.norm):
            return False
        if "vocab_parallel" in self._modules:
            heads = [(p.weight, p.bias) for p in self._modules["vocab_parallel"].head]
        else:
            heads = [(self.embed_tokens, None)] if self.lm_head is None else [(self.lm_head.weight, self.lm_head.bias)]
        if not all(row_independent(w) and b is None for w, b in heads):
            return False
        return all(getattr(layer, "rows_independent", lambda: False)() for layer in self.layers)

    def build_rope_tables(self, length: int, dtype: torch.dtype, grow: bool = False) -> None:
        """Precompute cos/sin of positions ``0 .. length-1`` for every RoPE (:meth:`RotaryEmbedding.build_table`;
        ``grow``: the first chunk now, the rest as positions reach it)."""
        for rope in self.ropes:
            rope.build_table(length, dtype, grow)

    def logits(self, batch: StepBatch, residual: torch.Tensor, delta: torch.Tensor | None) -> torch.Tensor:
        """The last layer's carried stream -> ``[R, V]`` float32 logits of ``batch.logit_rows``.

        Args:
            residual, delta: ``[T, D]`` each (delta None: nothing pending, e.g. no layers).
        """
        head = self.embed_tokens if self.lm_head is None else self.lm_head.weight
        # (R, D) -> (R, V): only rows that want logits; the last MLP output is added to those rows only
        if batch.logit_rows.shape[0] != batch.num_tokens:  # else every row, in order (StepBatch's rows ascend)
            rows = batch.logit_rows
            residual, delta = residual[rows], None if delta is None else delta[rows]
        if delta is None:
            return rowwise(batch.row_tile, lambda x: self._logits(self.norm(x), head), residual, pad=batch.row_pad)
        return rowwise(batch.row_tile, lambda r, d: self._logits(self.norm.add_forward(r, d)[1], head),
                       residual, delta, pad=batch.row_pad)

    def _logits(self, x: torch.Tensor, head: torch.Tensor | PackedWeight) -> torch.Tensor:
        """``x @ head.T`` as float32 ``[R, V]``: with 16-bit weights on CUDA the GEMM writes float32
        directly (:func:`monobatch.kernels.gemv.linear` with ``out_dtype``), so logits are not
        rounded to bfloat16 (which ties tokens whose logits differ by less than ~0.1)."""
        if "vocab_parallel" in self._modules:  # a tensor-parallel shard: its rows, gathered on the driver
            return self._modules["vocab_parallel"].logits(x)
        return matmul(x, head, out_dtype=torch.float32)
