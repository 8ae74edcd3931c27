"""The fused CPU ops of a decode step (kernels/cpu_ops.py) against the torch code they replace and
float64 references; attention rows independent of the rows beside them (ADR 0002)."""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

from monobatch.kernels import cpu_ops
from monobatch.kv.attention import attend_chunk
from monobatch.models.rope import apply_rope

pytestmark = pytest.mark.skipif(not cpu_ops.enabled(torch.empty(0)), reason="CPU kernels did not build")

H, KV, HD = 9, 3, 64


def test_norms_match_the_formula():
    g = torch.Generator().manual_seed(0)
    x, d, w = torch.randn(5, 576, generator=g), torch.randn(5, 576, generator=g), torch.randn(576, generator=g)
    s64 = x.double() + d.double()
    want = w.double() * s64 / torch.sqrt(s64.pow(2).mean(-1, keepdim=True) + 1e-5)
    s, y = cpu_ops.add_rms_norm(x, d, w, 1e-5)
    assert torch.equal(s, x + d)
    torch.testing.assert_close(y.double(), want, rtol=1e-5, atol=1e-5)
    want = w.double() * x.double() / torch.sqrt(x.double().pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(cpu_ops.rms_norm(x, w, 1e-5).double(), want, rtol=1e-5, atol=1e-5)
    # [T, heads, hd] (q/k norm) is normed per head row
    q = torch.randn(3, 4, 8, generator=g)
    torch.testing.assert_close(cpu_ops.rms_norm(q, w[:8], 1e-6)[1, 2], cpu_ops.rms_norm(q[1, 2:3], w[:8], 1e-6)[0])


def test_rope_in_place_matches_apply_rope():
    g = torch.Generator().manual_seed(1)
    T = 4
    qkv = torch.randn(T, (H + 2 * KV) * HD, generator=g)
    table = torch.randn(T, 2, HD, generator=g)  # cos/sin as views of one table: row stride 2 * HD
    cos, sin = table[:, 0], table[:, 1]
    q_ref = apply_rope(qkv[:, :H * HD].view(T, H, HD), cos, sin)
    k_ref = apply_rope(qkv[:, H * HD:(H + KV) * HD].view(T, KV, HD), cos, sin)
    v_ref = qkv[:, (H + KV) * HD:].clone()
    cpu_ops.rope_qk_(qkv, cos, sin, H + KV, HD)
    torch.testing.assert_close(qkv[:, :H * HD].view(T, H, HD), q_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(qkv[:, H * HD:(H + KV) * HD].view(T, KV, HD), k_ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(qkv[:, (H + KV) * HD:], v_ref)  # v untouched


def test_silu_mul_matches_torch():
    gu = torch.randn(3, 2 * 1536, generator=torch.Generator().manual_seed(2)) * 8  # e^-g far into both tails
    want = F.silu(gu[:, :1536].double()) * gu[:, 1536:].double()
    torch.testing.assert_close(cpu_ops.silu_mul(gu).double(), want, rtol=1e-6, atol=1e-6)


def test_gelu_tanh_mul_matches_float64_and_is_row_independent():
    """GeGLU's C++ op: within 2e-6 of the float64 gelu_tanh(g) * u (measured 7.6e-7 relative; torch's
    float32 F.gelu is ~1.4e-5 off), both tails included; each element by the same operations
    wherever it lies: a row's bits alone equal its bits among others, for widths off the SIMD width."""
    g = torch.Generator().manual_seed(4)
    for F_ in (1, 7, 8, 13, 640):
        gu = torch.randn(5, 2 * F_, generator=g) * 6  # e^(-2u) far into both tails
        gate, up = gu[:, :F_].double(), gu[:, F_:].double()
        want = 0.5 * gate * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (gate + 0.044715 * gate ** 3))) * up
        got = cpu_ops.gelu_tanh_mul(gu)
        assert got.dtype == torch.float32 and got.shape == (5, F_)
        torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=2e-6 * want.abs().max().item())
        for r in range(5):
            assert torch.equal(cpu_ops.gelu_tanh_mul(gu[r:r + 1].clone()), got[r:r + 1]), (F_, r)


BS, NBLOCKS = 16, 24
#: two sequences' block tables (flat); A's positions 0..63 live in blocks 3, 7, 1, 9, B's in 4, 0, 2, 5
TABLES = torch.tensor([3, 7, 1, 9, 4, 0, 2, 5], dtype=torch.int32)


def slot(table: torch.Tensor, p: int) -> int:
    return int(table[p // BS]) * BS + p % BS


def run_step(q, k, v, kc, vc, rows_pos_off, window):
    """One kernel call: rows ``(row, position, table offset)``; k/v row t is written at its row's slot."""
    rows = torch.tensor(rows_pos_off, dtype=torch.int64)
    write = torch.tensor([slot(TABLES[off:], p) for _, p, off in rows_pos_off])
    out = torch.zeros(q.shape)
    return cpu_ops.attention(q, k, v, kc, vc, write, rows, TABLES, BS, window, out)


@pytest.mark.parametrize("window", [0, 7])
def test_attention_matches_a_float64_reference_and_attend_chunk(window):
    g = torch.Generator().manual_seed(3)
    kc, vc = torch.randn(NBLOCKS * BS, KV, HD, generator=g), torch.randn(NBLOCKS * BS, KV, HD, generator=g)
    T = 4  # A decodes at 50, B's chunk is positions 20..22
    qkv = torch.randn(T, (H + 2 * KV) * HD, generator=g)  # q, k, v as views of the packed projection
    q, k, v = (qkv[:, :H * HD].view(T, H, HD), qkv[:, H * HD:(H + KV) * HD].view(T, KV, HD),
               qkv[:, (H + KV) * HD:].view(T, KV, HD))
    rows = [(0, 50, 0), (1, 20, 4), (2, 21, 4), (3, 22, 4)]
    kc2, vc2 = kc.clone(), vc.clone()
    out = run_step(q, k, v, kc2, vc2, rows, window)
    for t, (_, p, off) in enumerate(rows):  # the new rows were stored first
        assert torch.equal(kc2[slot(TABLES[off:], p)], k[t]) and torch.equal(vc2[slot(TABLES[off:], p)], v[t])
    for t, (_, p, off) in enumerate(rows):
        lo = max(0, p - window + 1) if window else 0
        idx = torch.tensor([slot(TABLES[off:], j) for j in range(lo, p + 1)])
        keys, values = kc2[idx], vc2[idx]  # (S, KV, HD)
        qg = q[t].double().view(KV, H // KV, HD)
        att = (torch.einsum("kgd,skd->kgs", qg, keys.double()) / math.sqrt(HD)).softmax(-1)
        want = torch.einsum("kgs,skd->kgd", att, values.double()).reshape(H, HD)
        torch.testing.assert_close(out[t].double(), want, rtol=1e-5, atol=1e-6)
        ref = attend_chunk(q[t:t + 1], keys, values, p, False, window, lo)[0]  # torch's SDPA on the gathered keys
        torch.testing.assert_close(out[t], ref, rtol=1e-5, atol=1e-5)


def test_attention_rows_do_not_depend_on_their_neighbours():
    """A row's bits are the same alone (a decode step), inside a chunk, or beside other sequences."""
    g = torch.Generator().manual_seed(4)
    kc, vc = torch.randn(NBLOCKS * BS, KV, HD, generator=g), torch.randn(NBLOCKS * BS, KV, HD, generator=g)
    T = 5
    q, k, v = (torch.randn(T, H, HD, generator=g), torch.randn(T, KV, HD, generator=g),
               torch.randn(T, KV, HD, generator=g))
    rows = [(0, 33, 0), (1, 40, 4), (2, 41, 4), (3, 42, 4), (4, 43, 4)]
    together = run_step(q, k, v, kc.clone(), vc.clone(), rows, 0)
    written_k, written_v = kc.clone(), vc.clone()
    run_step(q, k, v, written_k, written_v, rows, 0)  # the cache as the batch left it
    for t, (_, p, off) in enumerate(rows):
        alone = run_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], written_k.clone(), written_v.clone(), [(0, p, off)], 0)
        assert torch.equal(alone[0], together[t])


def test_attention_refuses_indices_out_of_range():
    kc, vc = torch.zeros(NBLOCKS * BS, KV, HD), torch.zeros(NBLOCKS * BS, KV, HD)
    q, k, v = torch.zeros(1, H, HD), torch.zeros(1, KV, HD), torch.zeros(1, KV, HD)
    bad_tables = torch.tensor([NBLOCKS], dtype=torch.int32)  # a block past the pool
    with pytest.raises(RuntimeError, match="block id"):
        cpu_ops.attention(q, k, v, kc, vc, torch.tensor([0]), torch.tensor([[0, 3, 0]]), bad_tables, BS, 0,
                          torch.zeros(1, H, HD))
    with pytest.raises(RuntimeError, match="write slot"):
        cpu_ops.attention(q, k, v, kc, vc, torch.tensor([NBLOCKS * BS]), torch.tensor([[0, 3, 0]]), TABLES, BS, 0,
                          torch.zeros(1, H, HD))
    assert not kc.any()  # nothing written


def _packed(qtype: str, n: int, k: int, seed: int):
    """A random packed weight [n, k] of GGUF type ``qtype`` (one part)."""
    from gguf import GGMLQuantizationType

    from monobatch.quant.random_packed import random_weight

    return random_weight(GGMLQuantizationType[qtype], n, k, torch.device("cpu"), torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("T", [1, 3, 8])
def test_fused_layer_halves_are_the_separate_calls_bitwise(T):
    """add_norm_qkv_rope and o_add_norm_mlp (one call each a decode layer half) give the bits of
    add_rms_norm, the packed GEMV, rope_qk_ and silu_mul called one by one (issue 17's host work)."""
    from monobatch.kernels import quant_cpu

    g = torch.Generator().manual_seed(5)
    D, F_ = 576, 1536
    qkv_w, o_w = _packed("Q4_1", (H + 2 * KV) * HD, D, 1), _packed("Q4_1", D, H * HD, 2)
    gu_w, down_w = _packed("Q4_1", 2 * F_, D, 3), _packed("Q8_0", D, F_, 4)
    x, d, w = torch.randn(T, D, generator=g), torch.randn(T, D, generator=g), torch.rand(D, generator=g) + 0.5
    table = torch.randn(T, 2, HD, generator=g)
    cos, sin = table[:, 0], table[:, 1]

    def gemm(x, wt):
        p = wt.parts[0]
        return quant_cpu.gemm(x, p.qs, p.scale, p.minimum, p.layout.group, p.layout.q4)

    for delta in (d, None):
        s_ref, h = cpu_ops.add_rms_norm(x, delta, w, 1e-5) if delta is not None else (x, cpu_ops.rms_norm(x, w, 1e-5))
        qkv = gemm(h, qkv_w)
        cpu_ops.rope_qk_(qkv, cos, sin, H + KV, HD)
        s, q, k, v = cpu_ops.add_norm_qkv_rope(x, delta, w, 1e-5, qkv_w.parts[0].mat(), cos, sin, H, KV, HD)
        assert torch.equal(s, s_ref)
        assert q.shape == (T, H, HD) and k.shape == v.shape == (T, KV, HD)
        assert torch.equal(q, qkv[:, :H * HD].view(T, H, HD))
        assert torch.equal(k, qkv[:, H * HD:(H + KV) * HD].view(T, KV, HD))
        assert torch.equal(v, qkv[:, (H + KV) * HD:].view(T, KV, HD))
    a = torch.randn(T, H, HD, generator=g)
    s_ref, h = cpu_ops.add_rms_norm(x, gemm(a.flatten(1), o_w), w, 1e-5)
    y_ref = gemm(cpu_ops.silu_mul(gemm(h, gu_w)), down_w)
    for attn_out in (a, a.flatten(1)):
        s, y = cpu_ops.o_add_norm_mlp(x, attn_out, o_w.parts[0].mat(), w, 1e-5, gu_w.parts[0].mat(),
                                      down_w.parts[0].mat())
        assert torch.equal(s, s_ref) and torch.equal(y, y_ref)


@pytest.mark.parametrize("T", [1, 5, 16])
def test_combined_packed_mats_are_the_python_products_bitwise(T):
    """``PackedMat.concat`` (a projection of parts of several types, e.g. a Q4_K_M file's q/k and
    v) gives PackedWeight.matmul's concatenation; ``PackedMat.pieces`` (the deterministic mode's
    row-parallel pieces) gives RowParallelLinear's ((p0 + p1) + p2) of the pieces' products."""
    from monobatch.models.layers import combined_mat
    from monobatch.quant.packed import PackedWeight

    g = torch.Generator().manual_seed(8)
    parts = [_packed("Q4_K", 64, 256, 20), _packed("Q6_K", 32, 256, 21), _packed("Q8_0", 16, 256, 22)]
    whole = PackedWeight([w.parts[0] for w in parts], 256, [t for w in parts for t in w.types])
    x = torch.randn(T, 256, generator=g)
    mat = combined_mat([w.parts[0].mat() for w in parts])
    assert torch.equal(cpu_ops.quant_cpu.module().gemm_mat(x, mat), whole.matmul(x))
    pieces, widths = [_packed("Q4_1", 48, 64, 30 + i) for i in range(3)], [64, 64, 64]
    x = torch.randn(T, 192, generator=g)
    want = pieces[0].matmul(x[:, :64].contiguous())
    for i in (1, 2):
        want = want + pieces[i].matmul(x[:, 64 * i:64 * (i + 1)].contiguous())
    got = cpu_ops.quant_cpu.module().gemm_mat(x, combined_mat([w.parts[0].mat() for w in pieces], widths))
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="pieces"):
        cpu_ops.quant_cpu.module().gemm_mat(x[:, :128], combined_mat([w.parts[0].mat() for w in pieces], widths))
    assert combined_mat([parts[0].parts[0].mat(), None]) is None


def test_cpu_route_is_decided_once_and_not_copied():
    """The fused route of the shared layers: decided at the first call (float32 CPU, packed), the
    same bits as the unfused layer; a deepcopy (tensor-parallel shards) starts undecided."""
    import copy

    from monobatch.models.args import ModelArgs
    from monobatch.models.layers import Attention, CpuRoute, GatedMLP, RMSNorm, hold_packed

    args = ModelArgs(hidden_size=576, intermediate_size=1536, num_attention_heads=H, num_key_value_heads=KV,
                     head_dim=HD, num_hidden_layers=1, vocab_size=64)
    g = torch.Generator().manual_seed(6)
    attn, mlp, norm = Attention(args, 0), GatedMLP(args), RMSNorm(576, 1e-5)
    norm.weight.data = torch.rand(576, generator=g) + 0.5
    for i, (m, name, n, k) in enumerate([(attn.qkv_proj, "weight", (H + 2 * KV) * HD, 576), (attn.o_proj, "weight", 576, H * HD),
                                         (mlp.gate_up_proj, "weight", 2 * 1536, 576), (mlp.down_proj, "weight", 576, 1536)]):
        hold_packed(m, name, _packed("Q4_1", n, k, 10 + i))
    r, d = torch.randn(2, 576, generator=g), torch.randn(2, 576, generator=g)
    table = torch.randn(2, 2, HD, generator=g)
    cos, sin = table[:, 0], table[:, 1]
    got = attn.add_norm_project(norm, r, d, cos, sin)
    assert attn.cpu_route.call and attn.cpu_route.call[0] is not None
    s, h = norm.add_forward(r, d)
    want = (s, *attn.project(h, cos, sin))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    a = torch.randn(2, H, HD, generator=g)
    got = mlp.attn_add_forward(attn.o_proj, norm, r, a)
    s, h = norm.add_forward(r, attn.o_proj(a.flatten(1)))
    assert mlp.cpu_route.call and torch.equal(got[0], s) and torch.equal(got[1], mlp(h))
    assert copy.deepcopy(attn).cpu_route.call is None and isinstance(copy.deepcopy(mlp).cpu_route, CpuRoute)


def test_layer_chain_is_the_layers_loop_bitwise(loaded):
    """A CPU decode step of the bundled model through its C++ layer chain (every layer's fused
    calls in one call: DecoderModel.chained) gives the per-layer loop's logits bit for bit, for one
    row and for several, and counts one attention call a layer, in the default mode and in the
    deterministic mode (its row-parallel pieces summed in C++; its rows not padded: the model's
    rows are independent); a deterministic step with padded row tiles keeps the loop. Which path
    ran is seen from the store: the chain never calls ``attend``."""
    from monobatch.batch import StepBatch
    from monobatch.engine.engine import Engine, EngineConfig

    n_layers = len(loaded.model.layers)
    prompts = [loaded.tokenizer.encode(t) for t in ("The capital of France is", "One, two, three,", "def add(a, b):")]
    for mode in ("fast", "deterministic", "padded"):
        engine = Engine(loaded, EngineConfig(kv_storage="paged", deterministic=mode != "fast"))
        assert engine.row_pad is (mode == "fast")  # the fast mode has no tiles to pad
        pad = mode == "padded"
        kv, model = engine.kv, engine.model  # deterministic mode's model: the layers in tensor-parallel pieces
        for s, ids in enumerate(prompts):
            engine.forward(StepBatch.build([(s, ids, 0, True)], engine.device, engine.row_tile, engine.row_pad))
        attend, attended = kv.attend, []

        def counted(*args, **kw):
            attended.append(1)
            return attend(*args, **kw)

        kv.attend = counted
        for rows in ([0], [0, 1, 2]):
            batch = StepBatch.build([(s, [17 + s], len(prompts[s]), True) for s in rows], engine.device,
                                    engine.row_tile, pad or engine.row_pad)
            kv.prepare(batch)
            before, attended[:] = kv.paged_attention_calls, []
            chained = model(batch, kv)
            assert kv.paged_attention_calls - before == n_layers
            assert len(attended) == (n_layers if pad else 0)  # the chain attends in C++
            held, kv.layer_chain = kv.layer_chain, (model, model._placement, None)  # no chain: the loop
            attended[:] = []
            looped = model(batch, kv)
            assert len(attended) == n_layers
            kv.layer_chain = held
            assert torch.equal(chained, looped)
            kv.commit(batch)
            prompts = [p + [17 + s] if s in rows else p for s, p in enumerate(prompts)]


@pytest.mark.usefixtures("one_cpu_thread_in_test")
def test_deterministic_cpu_steps_without_padding_are_the_padded_unfused_steps_bitwise(loaded):
    """The deterministic mode on the bundled model (packed CPU weights: every row-wise op computes
    each row alone) runs unpadded tiles of up to 16 rows through the fused routes and the layer
    chain; every logits tensor of a prompt step (tiles of 16 and a remainder), of batched decode
    steps and of a scratch prompt (prompt_logits) is bitwise what the padded row tiles of 8
    through the unfused layers give (the mode before the fused routes took its pieces)."""
    from helpers import padded_deterministic_matches

    padded_deterministic_matches(loaded, [loaded.tokenizer.encode(t) for t in (
        "Once upon a time, in a small village by the sea, there lived an old fisherman who " * 2, "Hi")])


def test_rowwise_joins_a_list_of_outputs_as_a_tuple():
    """A row tile's function may return a list (a C++ route's outputs): its parts are joined as a
    tuple's are, padding rows cut (deterministic CPU steps through a fused route)."""
    from monobatch.models.layers import rowwise

    x = torch.arange(10.0).view(5, 2)
    out = rowwise(2, lambda a: [a * 2, a + 1], x)
    assert isinstance(out, tuple) and torch.equal(out[0], x * 2) and torch.equal(out[1], x + 1)


def test_bad_cpu_kernel_variables_warn_and_keep_the_kernels():
    """A malformed MONOBATCH_CPU_MIN_THREAD_WORK or MONOBATCH_CPU_KERNELS is named in one warning
    and ignored: the packed kernels stay available (a bad value once turned them off silently)."""
    import subprocess
    import sys

    code = ("from monobatch.kernels import cpu_ops, quant_cpu; "
            "print(quant_cpu.available(), cpu_ops.enabled.__module__)")
    for env in ({"MONOBATCH_CPU_MIN_THREAD_WORK": "abc"}, {"MONOBATCH_CPU_MIN_THREAD_WORK": "-5"},
                {"MONOBATCH_CPU_KERNELS": "banana"}):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                              env={**os.environ, **env})
        assert done.returncode == 0 and done.stdout.startswith("True"), (env, done.stderr[-500:])
        name, value = next(iter(env.items()))
        assert f"{name}={value!r}" in done.stderr and "warning" in done.stderr, (env, done.stderr)
