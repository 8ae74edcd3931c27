import sys, time, random, statistics
import torch
from monobatch.loader.dummy import dummy_model
from monobatch.engine.engine import Engine, EngineConfig
from monobatch.engine.params import SamplingParams
from monobatch.engine.sequence import Request, Sequence
from monobatch.engine.sampler import SampleOutput
from monobatch.tokenizer import IncrementalDetokenizer
loaded = dummy_model("tiny", "cpu", "float32")
eng = Engine(loaded, EngineConfig(max_num_seqs=128))
B = 128
seqs = []
for i in range(B):
    r = Request(f"r{i}", [1, 2, 3], SamplingParams(temperature=0.0, max_tokens=100000))
    seqs.append(Sequence(r, IncrementalDetokenizer(eng.tokenizer, r.prompt_ids), None))
rng = random.Random(0)
ts = []
for it in range(400):
    toks = [rng.randrange(300) for _ in range(B)]
    t0 = time.perf_counter()
    eng.finisher.apply(seqs, SampleOutput(toks, None, None))
    ts.append(time.perf_counter() - t0)
print(f"finish: min {min(ts)/B*1e6:.3f} median {statistics.median(ts)/B*1e6:.3f} us/row")
