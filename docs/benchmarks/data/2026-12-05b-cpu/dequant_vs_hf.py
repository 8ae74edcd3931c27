import sys, torch
sys.path.insert(0, "tests")
import conftest, test_oracle as T
from monobatch.loader import load_model
from monobatch.engine.engine import Engine
from helpers import one_gguf_parse
import transformers
torch.set_num_threads(2)
D = load_model(None, device="cpu", dtype="float32", progress=False, weights="dequant")
with one_gguf_parse():
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(D.path.parent), gguf_file=D.path.name, dtype=torch.float32).eval()
w = 0
for text, chat in T.ALL:
    ids = T.prompt_ids(D.tokenizer, text, chat)
    ours = Engine(D).prompt_logits(ids, all_positions=True)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    w = max(w, (ours - ref).abs().max().item())
print("dequant vs HF prefill max", w)
