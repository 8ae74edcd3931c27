"""fp16 vs float32 scales in the packed GEMV, one build, one process: the bundled model's layer-5 packed
weights and the Q8_0 head, each part also held with float32 scales (the same values); 1 thread,
thread CPU time per call, the two interleaved call by call; 10th percentile (2026-12-03)."""
import time, torch
torch.set_num_threads(1)
from monobatch.loader import load_model
from monobatch.quant.packed import packed_weights, PackedPart
l = load_model(None, "cpu", None, progress=False)
ws = packed_weights(l.model.layers[5]) + [l.model.embed_tokens]
pairs = []
for w in ws:
    p = w.parts[0]
    pairs.append((f"{p.rows}x{w.k}", p, PackedPart(p.layout, p.qs, p.scale.float(), p.minimum.float())))
for name, p16, p32 in pairs:
    for M in (1, 4):
        x = torch.randn(M, p16.qs.shape[1] * (2 if p16.layout.q4 else 1))
        t = {"f16": [], "f32": []}
        reps = 3 if p16.rows > 10000 else 30
        for _ in range(reps * 4):
            for tag, p in (("f16", p16), ("f32", p32)):
                t0 = time.thread_time_ns(); p.gemm(x); t[tag].append(time.thread_time_ns() - t0)
        a, b = sorted(t["f16"])[len(t["f16"]) // 10] / 1e3, sorted(t["f32"])[len(t["f32"]) // 10] / 1e3
        print(f"{name:10s} M={M}: fp16 {a:8.1f} us  fp32 {b:8.1f} us  ratio {a/b:.3f}  (10th percentile of CPU time)")
