import timeit, torch
from monobatch.batch import StepBatch
from monobatch.kv.paged import PagedKv
from monobatch.engine.cuda_graphs import DecodeInputs
for B in (32, 128):
    kv = PagedKv(2, 2, 8, 512, torch.float32, torch.device("cpu"), num_blocks=2048, block_size=16)
    for s in range(B):
        kv.reserve(s, 20 + s % 7); kv.commit(StepBatch.build([(s, list(range(20 + s % 7)), 0, True)]))
    host = DecodeInputs(B, kv.max_blocks_per_seq, "cpu")
    dev = DecodeInputs(B, kv.max_blocks_per_seq, "cpu")
    batch = StepBatch.build([(s, (1,), 20 + s % 7, True) for s in range(B)])
    f = lambda: kv.prepare_decode(batch, host.step.rows(B), dev.step.rows(B))
    N = 300
    print(B, f"{min(timeit.repeat(f, number=N, repeat=7)) / N / B * 1e6:.3f} us/row")
