import timeit, torch
from monobatch.batch import StepBatch
from monobatch.kv.paged import PagedKv
B = 128
kv = PagedKv(2, 2, 8, 100000, torch.float32, torch.device("cpu"), num_blocks=20000, block_size=16)
for s in range(B):
    kv.reserve(s, 20); kv.commit(StepBatch.build([(s, list(range(20)), 0, True)]))
pos = [20] * B
def one():
    b = StepBatch.build([(s, (7,), pos[s], True) for s in range(B)])
    for s in range(B):
        kv.reserve(s, pos[s] + 1)
    t = timeit.default_timer()
    kv.commit(b)
    dt = timeit.default_timer() - t
    for s in range(B):
        pos[s] += 1
    return dt
ts = [one() for _ in range(2000)]
ts.sort()
print(f"commit min {ts[0] / B * 1e6:.3f} p10 {ts[len(ts)//10] / B * 1e6:.3f} us/row")
