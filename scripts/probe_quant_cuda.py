"""Localise a wrong packed CUDA product (H200 diagnosis, 2026-12-01): per type and shape, whether
the GPU repack equals formats.repack bitwise, and the relative error of the torch dequantize, the
GEMV (M 1, 8) and the tiled GEMM (M 1, 8, 20) against gguf-py's float64 weights. Found with it: the
GEMV's FMA variant (M <= 4) was wrong at some tiles on sm_90 while the DOT variant, the GEMM and
the repack were right (quant_gemm.gemv_config now takes DOT for every M).

    PYTHONPATH=src:tests python3 scripts/probe_quant_cuda.py
"""
import sys, torch
sys.path.insert(0, "tests")
import test_quant_cuda as t
from monobatch.kernels import quant_gemm as Q
from monobatch.quant import packed
packed.CUDA_PACKED = True
from gguf import GGMLQuantizationType as T
from monobatch.quant.formats import repack
for qtype in (T.Q8_0, T.Q5_0, T.Q6_K, T.Q4_0, T.Q4_K):
    for n, k in ((40, 256), (64, 512), (3072, 2048)):
        data = t.random_blocks(qtype, n, k, 0)
        rep = t.device_repack.repack(qtype, torch.from_numpy(data).cuda(), k)
        cpu = repack(qtype, data, k)
        same = all(torch.equal(getattr(rep, f).cpu(), torch.from_numpy(getattr(cpu, f))) for f in ("qs", "scale", "minimum"))
        _, w = t._parts(qtype, n, k, 0, "cuda")
        deq = Q.dequantize(rep.qs, rep.scale, rep.minimum, rep.layout)
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = x.double() @ w.T
        out = {"deq": t._rel(deq.double(), w)}
        for M in (1, 8, 20):
            xm = torch.randn(M, k, device="cuda", dtype=torch.bfloat16); r = xm.double() @ w.T
            if M <= Q.MAX_M:
                out[f"gemv{M}"] = round(t._rel(Q.gemv(xm, rep.qs, rep.scale, rep.minimum, rep.layout), r), 4)
            out[f"gemm{M}"] = round(t._rel(Q.gemm(xm, rep.qs, rep.scale, rep.minimum, rep.layout), r), 4)
        print(qtype.name, n, k, "repack==cpu", same, "strides", rep.qs.stride(), rep.scale.stride(), rep.minimum.stride(), out, flush=True)
