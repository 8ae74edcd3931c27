# MONOBATCH_TRITON=1 PYTHONPATH=<triton 3.6>:src:tests python3 THIS LABEL [CASES...]: sm_90 SASS facts of the FMA GEMV (no GPU needed); run from the repo root
"""SASS facts of the FMA GEMV per scale case and rows: instructions, shfl, bar, in the whole kernel."""
import sys, subprocess, tempfile, re, os
sys.path.insert(0, "tests")
from test_quant_cuda import _sm90, _scale_case, _PTRS, _ptxas_usage
from monobatch.kernels import quant_gemm as Q
from triton.backends.nvidia.compiler import get_ptxas
def sass(ptx):
    d = tempfile.mkdtemp(); open(d+"/k.ptx","w").write(ptx)
    subprocess.run([get_ptxas(90).path, "-arch=sm_90a", d+"/k.ptx", "-o", d+"/k.cubin"], check=True)
    nvd = os.path.join(os.path.dirname(get_ptxas(90).path), "nvdisasm")
    return subprocess.run([nvd, "-c", d+"/k.cubin"], capture_output=True, text=True, check=True).stdout
out = {}
for case in sys.argv[2:] or ("Q4_0", "f32", "Q4_K", "Q8_0", "Q6_K"):
  for rows, (N, K) in ((1, (2048, 8192)), (1, (40, 512)), (2, (16384, 2048))):
    layout, scale_sig, codes = _scale_case(case)
    bn, bk, sp, warps, stages, _ = Q.gemv_config(N, K, rows, layout, "fma", table=False)
    q4, group = layout.q4, layout.group
    gw = 4 if q4 else group // 4
    c = dict(HAS_BIAS=False, ROWS=rows, M_PAD=Q._pow2(rows), BLOCK_N=bn, NG=bk // (2 if q4 else 1) // (4 * gw), GW=gw,
             STAGES=stages, Q4=q4, GATED=False, EVEN=N % bn == 0, PDL=True, SUB=256 // group, **codes)
    sig = {**_PTRS, **scale_sig, "QW": "*i32", "Y": "*fp32"}
    ptx = _sm90(Q._gemv_fma_kernel, c, sig, num_warps=warps, num_stages=stages, launch_pdl=True)
    s = sass(ptx)
    ins = [l for l in s.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+\S", l)]
    regs, spills = _ptxas_usage(ptx)
    key = f"{sys.argv[1]} {case} rows{rows} {N}x{K} cfg{(bn,bk,warps,stages)}"
    print(key, "sass", len(ins), "shfl", sum("SHFL" in l for l in ins), "bar", sum("BAR" in l for l in ins),
          "ffma", sum("FFMA" in l for l in ins), "fadd", sum("FADD" in l for l in ins), "regs", regs, "spills", spills, flush=True)
