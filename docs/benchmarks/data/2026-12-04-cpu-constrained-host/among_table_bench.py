"""RowSampler._argmax_among's host table of 30 forced rows (1-4 candidate ids each): the loop of two
    slice writes a row (old, before 410fe00), a whole-numpy build (new, tried), lists written at once
    (py, kept). Prints us per call, the minimum of 5 repeats of 2,000. .venv/bin/python among_table_bench.py"""
import numpy as np, timeit
rng = np.random.default_rng(0)
allowed = [np.sort(rng.choice(49152, size=int(rng.integers(1, 5)), replace=False)).astype(np.int64) for _ in range(30)]
local = list(range(30)); V = 49152
def old():
    k, width = len(local), max(len(ids) for ids in allowed)
    table = np.empty((2, k, width), dtype=np.int64)
    for j, ids in enumerate(allowed):
        table[0, j, :len(ids)] = ids
        table[0, j, len(ids):] = ids[0]
    np.add(table[0], np.array(local, np.int64)[:, None] * V, out=table[1])
    return table
def new():
    k = len(local)
    lens = np.fromiter(map(len, allowed), np.int64, k)
    width = int(lens.max())
    table = np.empty((2, k, width), dtype=np.int64)
    col = np.arange(width)
    np.take(np.concatenate(allowed), (np.cumsum(lens) - lens)[:, None] + np.where(col < lens[:, None], col, 0), out=table[0])
    np.add(table[0], np.array(local, np.int64)[:, None] * V, out=table[1])
    return table
assert (old() == new()).all()
for f in (old, new, old, new):
    print(f.__name__, min(timeit.repeat(f, number=2000, repeat=5)) / 2000 * 1e6)
def py():
    k = len(local)
    lists = [a.tolist() for a in allowed]
    width = max(map(len, lists))
    table = np.empty((2, k, width), dtype=np.int64)
    table[0] = [l + l[:1] * (width - len(l)) for l in lists]
    np.add(table[0], np.array(local, np.int64)[:, None] * V, out=table[1])
    return table
assert (old() == py()).all()
for f in (old, new, py, old, new, py):
    print(f.__name__, min(timeit.repeat(f, number=2000, repeat=5)) / 2000 * 1e6)
