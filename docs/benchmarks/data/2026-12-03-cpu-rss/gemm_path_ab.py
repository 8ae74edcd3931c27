"""The GEMM path (prefill) of one layer's four packed products: DEQUANT_CHUNK_BYTES 1/2/4 MiB, then
the old chunk loop (F.linear product + copy into the output) vs torch.mm(out=) into the output
columns; -t 2, min/median ms of repeated calls, interleaved rounds (2026-12-03)."""
import time, torch, statistics, sys
torch.set_num_threads(2)
from monobatch.loader import load_model
from monobatch.quant import packed as PK
from monobatch.quant.packed import packed_weights
l = load_model(None, "cpu", None, progress=False)
m = l.model
layer = m.layers[3]
ws = {"qkv": layer.self_attn.qkv_proj.weight if hasattr(layer.self_attn.qkv_proj, "weight") else None}
pw = [w for w in packed_weights(layer)]
names = [f"{w.shape[0]}x{w.shape[1]}" for w in pw]
def run(M, reps=15):
    xs = {w.k: torch.randn(M, w.k) for w in pw}
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for w in pw: w.matmul(xs[w.k])
        t.append(time.perf_counter() - t0)
    return min(t) * 1e3, statistics.median(t) * 1e3
res = {}
for rnd in range(3):
    for chunk in (4 << 20, 2 << 20, 1 << 20):
        PK.DEQUANT_CHUNK_BYTES = chunk
        PK._scratch.buf = None
        for M in (128, 512):
            res.setdefault((chunk, M), []).append(run(M))
for k, v in sorted(res.items()):
    print(f"chunk {k[0]>>20} MiB M={k[1]}: min {min(a for a,b in v):.2f} ms, medians {[round(b,2) for a,b in v]}")
print(names)
import torch.nn.functional as F
def old_dequant_gemm(self, x, part):
    step = max(1, PK.DEQUANT_CHUNK_BYTES // (4 * self.k))
    def product(lo, hi):
        return F.linear(x, part.dequantize(lo, hi, self.k, PK._dequant_buffer(hi - lo, self.k)))
    if part.rows <= step:
        return product(0, part.rows)
    out = torch.empty(x.shape[0], part.rows, dtype=torch.float32)
    for lo in range(0, part.rows, step):
        out[:, lo:min(lo + step, part.rows)] = product(lo, min(lo + step, part.rows))
    return out
new = PK.PackedWeight.dequant_gemm
PK.DEQUANT_CHUNK_BYTES = 4 << 20
res = {}
for rnd in range(4):
    for name, f in (("old", old_dequant_gemm), ("new", new)):
        PK.PackedWeight.dequant_gemm = f
        for M in (128, 512, 2048):
            res.setdefault((name, M), []).append(run(M, 9))
for k, v in sorted(res.items(), key=lambda kv: (kv[0][1], kv[0][0])):
    print(f"{k[0]} M={k[1]}: min {min(a for a,b in v):.2f} ms, medians {[round(b,2) for a,b in v]}")
