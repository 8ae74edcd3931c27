import torch, sys
sys.path.insert(0, "tests")
from monobatch.loader import load_model
from monobatch.engine.engine import Engine
from test_gemma3 import RAW_PROMPTS
torch.set_num_threads(2)
P = load_model("gemma3", device="cpu", dtype="float32", progress=False)
D = load_model("gemma3", device="cpu", dtype="float32", progress=False, weights="dequant")
ep, ed = Engine(P), Engine(D)
worst = 0; mag = 0; minmargin = 9
for t in RAW_PROMPTS[1:]:
    ids = P.tokenizer.encode(t)
    for n in range(2, min(len(ids), 16) + 1):
        a, b = ep.prompt_logits(ids[:n]), ed.prompt_logits(ids[:n])
        d = (a - b).abs().max().item(); worst = max(worst, d); mag = max(mag, b.abs().max().item())
        top = b.topk(2).values; minmargin = min(minmargin, float(top[0]-top[1]))
    # also greedy continuation of 10 tokens via decode: compare prompt_logits of prefix at <=16 tokens
print(f"gemma packed(int16 GEMV, <=16 rows) vs dequant: max |dlogit| {worst:.3e}, max |logit| {mag:.1f}, min top2 margin {minmargin:.2e}")
