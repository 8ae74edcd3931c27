import timeit, torch
from monobatch.batch import StepBatch
from monobatch.kv.paged import PagedKv
for B in (32, 128):
    chunks = [(s, (0,), 20 + s % 7, True) for s in range(B)]
    f = lambda: StepBatch.build(chunks)
    N = 500
    b = StepBatch.build(chunks)
    kv = PagedKv(2, 2, 8, 512, torch.float32, torch.device("cpu"), num_blocks=2048, block_size=16)
    for s in range(B):
        kv.reserve(s, 20 + s % 7); kv.commit(StepBatch.build([(s, list(range(20 + s % 7)), 0, True)]))
    c = lambda: [kv.reserve(s, 21 + s % 7) for s in range(B)]
    print(B, f"build {min(timeit.repeat(f, number=N, repeat=7)) / N / B * 1e6:.3f} us/row",
          f"is_decode_only {min(timeit.repeat(lambda: b.is_decode_only, number=N, repeat=7)) / N / B * 1e6:.3f}",
          f"reserve {min(timeit.repeat(c, number=N, repeat=7)) / N / B * 1e6:.3f}")
