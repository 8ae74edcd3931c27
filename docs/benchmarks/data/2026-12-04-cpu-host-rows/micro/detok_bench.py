import timeit
from monobatch.loader.dummy import dummy_model
from monobatch.tokenizer import IncrementalDetokenizer
loaded = dummy_model("tiny", "cpu", "float32")
tok = loaded.tokenizer
d = IncrementalDetokenizer(tok, [1])
ids = list(range(100, 356))
print("ascii share", sum(tok.token_bytes(i).isascii() for i in ids) / len(ids))
def run():
    for i in ids:
        d.push(i)
N = 2000
print("push us", min(timeit.repeat(run, number=N, repeat=5)) / N / len(ids) * 1e6)
