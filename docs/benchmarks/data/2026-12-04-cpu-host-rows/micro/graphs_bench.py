# DecodeGraphs' host staging + prepare_decode (capture off), B decode rows, per call
import timeit, torch
from monobatch.batch import StepBatch
from monobatch.engine.cuda_graphs import DecodeGraphs
from monobatch.loader.dummy import dummy_model
from monobatch.kv.paged import PagedKv
loaded = dummy_model("tiny", "cpu", "float32")
for B in (32, 128):
    kv = PagedKv(2, 2, 8, 512, torch.float32, torch.device("cpu"), num_blocks=2048, block_size=16)
    for s in range(B):
        kv.reserve(s, 20 + s % 7); kv.commit(StepBatch.build([(s, list(range(20 + s % 7)), 0, True)]))
    g = DecodeGraphs(loaded.model, kv, max_batch=B, capture=False)
    batch = StepBatch.build([(s, (1,), 20 + s % 7, True) for s in range(B)])
    # forward without the model: the staging and prepare_decode only
    g._run = lambda *a, **k: torch.zeros(B, 1)
    f = lambda: g.forward(batch, commit=False)
    N = 300
    print(B, f"staging+prepare {min(timeit.repeat(f, number=N, repeat=7)) / N * 1e6:.1f} us a step, "
             f"{min(timeit.repeat(f, number=N, repeat=7)) / N / B * 1e6:.3f} a row")
