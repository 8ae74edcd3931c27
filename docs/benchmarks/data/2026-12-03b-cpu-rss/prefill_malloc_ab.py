"""Prefill cost A/B (2026-12-03b): process CPU time (user+sys), wall and minor faults of a 112- and a
512-token prefill (max_tokens=1), min/median of N after a warm-up, -t 1. The malloc setting comes from
the environment (MALLOC_MMAP_THRESHOLD_). usage: .venv/bin/python prefill_malloc_ab.py N"""
import sys, os, time, random, statistics, resource, torch
torch.set_num_threads(1)
from monobatch.loader import load_model
from monobatch.engine.engine import Engine, EngineConfig
from monobatch.engine.scheduler import BatchScheduler
from monobatch.engine.sequence import Request
from monobatch.engine.params import resolve_sampling
from monobatch.synth import synth_text
loaded = load_model(None, 'cpu', None, progress=False)
sch = BatchScheduler(Engine(loaded, EngineConfig()))
tok = loaded.tokenizer
text = synth_text(random.Random(1), 2000)
out = []
for n in (112, 512):
    ids_all = tok.encode(text)
    res = []
    for i in range(int(sys.argv[1]) + 1):
        ids = ids_all[i * 7: i * 7 + n]  # a different prompt each time: no prefix-cache hit
        params = resolve_sampling(None, {"temperature": 0, "max_tokens": 1}, loaded.generation_defaults, entry_point="generate")
        sch.add_request(Request(f"r{n}-{i}", ids, params))
        r0 = resource.getrusage(resource.RUSAGE_SELF); c0, w0 = time.process_time(), time.perf_counter()
        for _ in sch.run(): pass
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        if i: res.append((time.process_time() - c0, time.perf_counter() - w0, r1.ru_minflt - r0.ru_minflt))
    cpu = [r[0] * 1000 for r in res]; wall = [r[1] * 1000 for r in res]; flt = [r[2] for r in res]
    out.append(f"p{n} cpu min {min(cpu):.1f} med {statistics.median(cpu):.1f} ms  wall min {min(wall):.1f} med {statistics.median(wall):.1f}  faults med {statistics.median(flt):.0f}")
print(os.environ.get("MALLOC_MMAP_THRESHOLD_", "default"), " | ".join(out))
