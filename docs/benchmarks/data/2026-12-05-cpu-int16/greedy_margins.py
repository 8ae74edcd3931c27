"""The packed (int16-activation) GEMV's logit noise on the oracle prompts, and how close the greedy
paths come to a tie (ADR 0006, "int16 activations", 2026-12-05).

For each of tests/test_oracle.py's prompts: 48 greedy tokens on the packed and on the dequantized
model (equal?), then the logits of every position of prompt + the dequantized model's tokens on the
dequantized model (fast mode) and on the packed one in deterministic mode (row tiles of 8: every
row through the int16 GEMV, the decode path's numerics); prints the largest |difference| and the
smallest top-2 margin of the dequantized logits over the generated positions.

    PYTHONPATH=src .venv/bin/python docs/benchmarks/data/2026-12-05-cpu-int16/greedy_margins.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "tests"))
from helpers import first_divergence, run_requests  # noqa: E402
from test_oracle import ALL, N_TOKENS, prompt_ids  # noqa: E402

from monobatch.engine.engine import Engine, EngineConfig  # noqa: E402
from monobatch.engine.params import SamplingParams  # noqa: E402
from monobatch.engine.scheduler import BatchScheduler  # noqa: E402
from monobatch.loader import load_model  # noqa: E402

torch.set_num_threads(1)
packed = load_model(None, device="cpu", dtype="float32", progress=False)
dequant = load_model(None, device="cpu", dtype="float32", progress=False, weights="dequant")
sp = SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)
worst_diff, worst_margin = 0.0, float("inf")
for text, chat in ALL:
    ids = prompt_ids(packed.tokenizer, text, chat)
    [a] = run_requests(BatchScheduler(Engine(packed)), [ids], sp)
    [b] = run_requests(BatchScheduler(Engine(dequant)), [ids], sp)
    seq = ids + b
    ref = Engine(dequant).prompt_logits(seq, all_positions=True)
    got = Engine(packed, EngineConfig(deterministic=True)).prompt_logits(seq, all_positions=True)
    gen = slice(len(ids) - 1, len(seq) - 1)  # the positions that drew the generated tokens
    diff = (got - ref).abs().max().item()
    top = ref[gen].topk(2, dim=-1).values
    margin = (top[:, 0] - top[:, 1]).min().item()
    worst_diff, worst_margin = max(worst_diff, diff), min(worst_margin, margin)
    print(f"{text[:40]!r:44} chat={chat!s:5} tokens equal: {first_divergence(a, b) is None}  "
          f"max|packed - dequant| {diff:.2e}  min top-2 margin (generated) {margin:.2e}")
print(f"all: max|diff| {worst_diff:.2e}, smallest margin {worst_margin:.2e}")
