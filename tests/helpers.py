"""Test helpers: run requests through the engine, compare token ids with margins."""

from __future__ import annotations

import torch

from monobatch.engine.params import SamplingParams
from monobatch.engine.sequence import Request


def new_scheduler(loaded, **config):
    """A fresh BatchScheduler over already-loaded weights (EngineConfig fields as keywords)."""
    from monobatch.engine.engine import Engine, EngineConfig
    from monobatch.engine.scheduler import BatchScheduler

    return BatchScheduler(Engine(loaded, EngineConfig(**config)))


def run_requests(scheduler, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
    """Submit all prompts at once, step to the end; generated ids per prompt, in order."""
    plist = params if isinstance(params, list) else [params] * len(prompts)
    reqs = [Request(f"r{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, plist))]
    got: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    for out in scheduler.run(reqs):
        got[out.request_id] += out.token_ids
    return [got[r.request_id] for r in reqs]


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or the shorter length), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def top2_margin(hf_model, ids: list[int]) -> float:
    """HF's top-2 logit margin for the token after ``ids`` (float32)."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0, -1].float()
    top = logits.topk(2).values
    return float(top[0] - top[1])
