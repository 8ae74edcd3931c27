"""Which FMA GEMV configs give Q4_0's compact (NEG8) part other bits than its DIRECT twin (test_compact_is_direct_cuda)."""
import itertools, sys, torch
sys.path.insert(0, "tests")
from test_quant_cuda import _parts, T
from monobatch.kernels import quant_gemm as Q
from monobatch.quant.packed import PackedPart
g = torch.Generator().manual_seed(3)
for qt in (T.Q4_0, T.Q4_K, T.Q8_0):
    rep, ref = _parts(qt, 40, 512, seed=50, device="cuda")
    part = PackedPart(rep.layout, rep.qs, rep.scale, rep.minimum, rep.sup)
    direct = PackedPart(rep.layout.base, rep.qs, *Q.group_scales(part))
    x = torch.randn(1, 512, generator=g).to("cuda", torch.bfloat16)
    bias = torch.randn(40, generator=g).to("cuda", torch.bfloat16)
    r64 = x.double() @ ref.T
    print(qt.name, "rule", Q.gemv_config(40, 512, 1, part.layout, device=x.device), flush=True)
    for bn, bk, sp, st, b in itertools.product((64, 32), (512, 256), (1, 2), (1, 2), (None, bias)):
        cfg = (bn, bk, sp, 4, st, False)
        a = Q.gemv(x, part, b, config=cfg, out_dtype=torch.float32)
        a2 = Q.gemv(x, part, b, config=cfg, out_dtype=torch.float32)
        d = Q.gemv(x, direct, b, config=cfg, out_dtype=torch.float32)
        rr = r64 if b is None else r64 + b.double()
        print(f"  {cfg} bias={b is not None}: equal={torch.equal(a, d)} rerun_equal={torch.equal(a, a2)} "
              f"maxdiff={(a - d).abs().max().item():.3e} err_compact={(a.double() - rr).abs().max().item():.3e} "
              f"err_direct={(d.double() - rr).abs().max().item():.3e}", flush=True)
