import time, torch
from monobatch.kernels import cpu_ops
from monobatch.kv.attention import attend_chunk
torch.set_num_threads(1)
H, KV, HD, BS = 9, 3, 64, 16
for S in (150, 1000):
    nb = S // BS + 2
    kc, vc = torch.randn(nb * BS + BS, KV, HD), torch.randn(nb * BS + BS, KV, HD)
    tables = torch.arange(nb, dtype=torch.int32)
    q, k, v = torch.randn(1, H, HD), torch.randn(1, KV, HD), torch.randn(1, KV, HD)
    p = S - 1
    write = torch.tensor([p]); rows = torch.tensor([[0, p, 0]]); out = torch.empty(1, H, HD)
    gather = torch.arange(S)
    def kern(): cpu_ops.attention(q, k, v, kc, vc, write, rows, tables, BS, 0, out)
    def old():
        kc.index_copy_(0, write, k); vc.index_copy_(0, write, v)
        attend_chunk(q, kc[gather], vc[gather], p)
    for name, f in (("kernel", kern), ("gather+sdpa", old)):
        for _ in range(20): f()
        t = time.process_time(); n = 300
        for _ in range(n): f()
        print(S, name, round((time.process_time() - t) / n * 1e6, 1), "us CPU")
