"""Fast vs deterministic mode's all-position prompt logits of tests/test_batching.py's corpus, on
packed (int16-activation GEMV) and on dequantized weights (ADR 0006, "int16 activations").

    PYTHONPATH=src .venv/bin/python docs/benchmarks/data/2026-12-05-cpu-int16/path_noise.py
"""

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[4] / "tests"))
from test_batching import TEXTS  # noqa: E402

from monobatch.engine.engine import Engine, EngineConfig  # noqa: E402
from monobatch.loader import load_model  # noqa: E402

torch.set_num_threads(1)
for weights in ("packed", "dequant"):
    model = load_model(None, device="cpu", dtype="float32", progress=False, weights=weights)
    worst = 0.0
    for storage in ("dense", "paged"):
        fast, det = (Engine(model, EngineConfig(kv_storage=storage, deterministic=d)) for d in (False, True))
        for text in TEXTS[:4]:
            ids = model.tokenizer.encode(text)
            a, b = (e.prompt_logits(ids, all_positions=True) for e in (fast, det))
            d = (a - b).abs().max().item()
            worst = max(worst, d)
    print(f"{weights}: fast vs deterministic, max |logits difference| {worst:.2e}")
