"""The engine against an independent implementation: HF transformers loading the same GGUF.

Prompts are fixed here (chosen before the first run). Both sides get the same prompt ids;
greedy ids must be identical, or the first divergence must sit where HF's top-2 logit margin is
under ``helpers.PACKED_NEAR_TIE`` (the engine's runs use the packed weights, whose int16-activation
GEMV moves a logit by up to ``helpers.PACKED_LOGIT_TOL``, so a flip needs a margin below twice
that; with the float GEMV the bound was 1e-4, where float32 rounding alone can flip a near-tie); prefill logits must agree within 1e-3 with the
weights dequantized at load (``--weights dequant``), and within ``helpers.PACKED_LOGIT_TOL`` with
the packed weights (their GEMV rounds the activations to int16 per group: ADR 0006, "int16
activations"; measured 2.1e-2 at most on these prompts).
"""

from __future__ import annotations

import json
import logging

import pytest
import torch

from helpers import PACKED_LOGIT_TOL, PACKED_NEAR_TIE, first_divergence, near_tie, new_scheduler, run_requests, top2_margin
from monobatch.engine.params import SamplingParams

log = logging.getLogger(__name__)
pytestmark = pytest.mark.usefixtures("one_cpu_thread")  # see conftest: oversubscription on a shared box

RAW_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 5, 8, 13, 21,",
    "Photosynthesis is the process by which",
]
CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain in two sentences why the sky is blue.",
]
N_TOKENS = 48


def prompt_ids(tokenizer, text: str, chat: bool) -> list[int]:
    return tokenizer.encode_chat([{"role": "user", "content": text}]) if chat else tokenizer.encode(text)


ALL = [(p, False) for p in RAW_PROMPTS] + [(p, True) for p in CHAT_PROMPTS]


def hf_greedy(hf_model, ids: list[int], n: int) -> list[int]:
    """HF greedy decode of n tokens, never stopping early (a manual loop with HF's KV cache). Only
    the last position's logits are computed (``logits_to_keep=1``): a long prompt's prefill would
    otherwise project every position onto the vocabulary (Gemma 3's 262K rows: most of the work)."""
    out, past, inp = [], None, torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            res = hf_model(inp, past_key_values=past, use_cache=True, logits_to_keep=1)
            past = res.past_key_values
            tok = int(res.logits[0, -1].argmax())
            out.append(tok)
            inp = torch.tensor([[tok]])
    return out


def check_against_hf(hf_model, eog_ids, ids: list[int], ours: list[int], hf: list[int], label: str,
                     tol: float = PACKED_NEAR_TIE) -> None:
    """ours must equal hf, up to our early stop at an end-of-generation id or a divergence where
    HF's top-2 margin is below ``tol`` (default: the packed weights', which every caller here runs)."""
    if len(ours) < len(hf):  # we stopped: the last token must be an end-of-generation id HF drew too
        assert ours[-1] in eog_ids, f"{label}: stopped early at a non-EOG token"
        hf = hf[:len(ours)]
    i = first_divergence(ours, hf)
    if i is None:
        return
    margin = top2_margin(hf_model, ids + hf[:i])
    log.warning("%s: first divergence at token %d (ours %d, HF %d), HF top-2 margin %.2e", label, i, ours[i], hf[i], margin)
    assert margin < tol, f"{label}: diverged at {i} with margin {margin:.3e} >= {tol}"


@pytest.fixture(scope="module")
def hf_outputs(loaded, hf_model):
    tok = loaded.tokenizer
    out = {}
    for text, chat in ALL:
        ids = prompt_ids(tok, text, chat)
        out[(text, chat)] = (ids, hf_greedy(hf_model, ids, N_TOKENS))
    return out


#: Prefill logits' largest difference from HF's, by weight mode (see the module docstring: the
#: packed GEMV's int16 activations have their own bound, helpers.PACKED_LOGIT_TOL).
LOGIT_TOL = {"dequant": 1e-3, "packed": PACKED_LOGIT_TOL}


@pytest.mark.parametrize("weights", ["packed", "dequant"])
@pytest.mark.parametrize("text,chat", ALL)
def test_prefill_logits_match_hf(request, hf_model, text, chat, weights):
    from monobatch.engine.engine import Engine

    model = request.getfixturevalue("loaded" if weights == "packed" else "dequantized")
    assert model.weights == weights
    ids = prompt_ids(model.tokenizer, text, chat)
    ours = Engine(model).prompt_logits(ids, all_positions=True)  # (T, V)
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    diff = (ours - ref).abs().max().item()
    assert diff < LOGIT_TOL[weights]


@pytest.mark.parametrize("weights", ["packed", "dequant"])
def test_engine_greedy_matches_hf(request, hf_model, hf_outputs, weights):
    """All prompts, each alone (B=1) through the scheduler, on either weight mode, at its near-tie
    margin (``helpers.near_tie``; on the dequantized weights 1e-3: their prefill logits are within
    6.8e-5 of HF's on these prompts, measured 2026-12-05)."""
    model = request.getfixturevalue("loaded" if weights == "packed" else "dequantized")
    for (text, chat), (ids, hf) in hf_outputs.items():
        [ours] = run_requests(new_scheduler(model), [ids], SamplingParams(max_tokens=N_TOKENS, temperature=0.0))
        check_against_hf(hf_model, model.tokenizer.eog_ids, ids, ours, hf, f"{weights} {text!r} chat={chat}",
                         tol=near_tie(model))


@pytest.mark.parametrize("text,chat", [ALL[0], ALL[1], ALL[len(RAW_PROMPTS)]])
def test_cli_generate_matches_hf(capsys, loaded, hf_model, hf_outputs, text, chat):
    """`monobatch generate --temperature 0 -n 48 --output-format json` gives HF's greedy ids."""
    from monobatch.cli.main import main

    argv = ["generate", "-p", text, "--temperature", "0", "-n", str(N_TOKENS), "--output-format", "json",
            "--device", "cpu", "--no-progress"] + (["--chat"] if chat else [])
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out)
    ids, hf = hf_outputs[(text, chat)]
    assert result["usage"]["prompt_tokens"] == len(ids)
    check_against_hf(hf_model, loaded.tokenizer.eog_ids, ids, result["token_ids"], hf, f"cli {text!r}")
    assert result["text"] == loaded.tokenizer.decode(result["token_ids"])
