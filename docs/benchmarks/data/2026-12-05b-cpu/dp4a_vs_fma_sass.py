# MONOBATCH_TRITON=1 PYTHONPATH=<triton 3.6>:src:tests python3 THIS Q4_0 Q8_0 Q6_K (ROWS=1,4): the K loop SASS of the DP4A and FMA GEMVs (sm_90, no GPU), repo root
import re, sys, json
sys.path.insert(0, "scripts"); sys.path.insert(0, "tests")
import probe_dp4a_gemv as P
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from test_quant_cuda import _scale_case, _PTRS, _ptxas_usage
from monobatch.kernels import quant_gemm as Q

def compile_(fn, consts, sig, warps, stages):
    s, attrs = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            s[name] = "constexpr"
        else:
            s[name] = sig.get(name, "i32")
            if name not in ("M", "N", "K", "splits"):
                attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=fn, signature=s, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages, launch_pdl=True))

N, K = 4096, 14336
import os; ROWS = [int(r) for r in os.environ.get("ROWS", "1").split(",")]
for case in sys.argv[1:]:
    layout, scale_sig, codes = _scale_case(case)
    q4, group = layout.q4, layout.group
    sig = {**_PTRS, **scale_sig, "QW": "*i32"}
    for variant in ("dp4a", "fma"):
        for rows in ROWS:
            if variant == "dp4a":
                bn, bk, _, warps, stages, _ = Q.dp4a_config(N, K, layout)
                c = dict(HAS_BIAS=False, ROWS=rows, M_PAD=Q._pow2(rows), BLOCK_N=bn, NG=bk // 32, STAGES=stages, Q4=q4, GROUP=group,
                         GATED=False, EVEN=True, SUB=256 // group, ASM=True, PDL=True, **codes)
                k = compile_(Q._gemv_dp4a_kernel, c, sig, warps, stages)
            else:
                bn, bk, _, warps, stages, _ = Q.gemv_config(N, K, rows, layout, "fma", table=False)
                gw = 4 if q4 else group // 4
                c = dict(HAS_BIAS=False, ROWS=rows, M_PAD=Q._pow2(rows), BLOCK_N=bn, NG=bk // (2 if q4 else 1) // (4 * gw), GW=gw,
                         STAGES=stages, Q4=q4, GATED=False, EVEN=True, PDL=True, SUB=256 // group, **codes)
                k = compile_(Q._gemv_fma_kernel, c, sig, warps, stages)
            regs, spills = _ptxas_usage(k.asm["ptx"])
            sass = P._sass(k.asm.get("cubin"))
            body = P._loop_body(sass, r"^\.L_x_\d+:", r"BRA\s+(`\()?(\.L_x_\d+)")
            sins = [ln for ln in body if re.search(r"/\*[0-9a-f]{4}\*/", ln)]
            per_w = bn * bk / (warps * 32)  # weights a thread a step
            ops = P._ops([re.sub(r"^.*?\*/\s*", "", ln) for ln in sins])
            print(json.dumps(dict(case=case, variant=variant, rows=rows, cfg=[bn, bk, warps, stages], regs=regs,
                                  spills=spills, sass_loop=len(sins), idp4a=sum("IDP.4A" in l for l in sins),
                                  per_weight_row=round(len(sins) / per_w / rows, 3),
                                  top=dict(list(ops.items())[:10]))), flush=True)
