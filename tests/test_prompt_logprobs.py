"""Prompt logprobs (vLLM's ``prompt_logprobs``, OpenAI completions' echo + logprobs) computed
inside the normal chunked prefill: equal to a one-shot log_softmax over the whole prompt, whatever
the chunking, a preemption or the prefix cache; delivered once, on the first output.

The logprob values are compared on ``--weights dequant``: what is tested is the path (chunks,
preemption, the cache), and on packed weights a 7-token chunk runs the int16-activation GEMV where
the whole prompt runs the float GEMM (ADR 0006, "int16 activations": ~1e-2 apart, measured)."""

from __future__ import annotations

import pytest
import torch

from helpers import new_scheduler
from monobatch.engine.params import SamplingParams
from monobatch.engine.sequence import Request
from monobatch.errors import InvalidRequestError

pytestmark = pytest.mark.usefixtures("one_cpu_thread")
PARAMS = SamplingParams(max_tokens=3, temperature=0.0)


@pytest.fixture(scope="module")
def prompt(loaded):
    return loaded.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)


@pytest.fixture(scope="module")
def reference(dequantized, prompt):
    """log_softmax of one B=1 forward over the whole prompt (dequantized weights): row i predicts
    token i+1."""
    from monobatch.engine.engine import Engine

    lp = torch.log_softmax(Engine(dequantized).prompt_logits(prompt, all_positions=True), dim=-1)
    chosen = lp[:-1].gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
    return chosen, lp[:-1].topk(3, dim=-1)


def run(sched, req):
    outs = list(sched.run([req]))
    assert sum(o.prompt_logprobs is not None for o in outs) == 1 and outs[0].prompt_logprobs is not None
    return outs[0].prompt_logprobs, [t for o in outs for t in o.token_ids]


@pytest.mark.parametrize("chunk", [2048, 7])
def test_prompt_logprobs_match_a_whole_prompt_forward(dequantized, prompt, reference, chunk):
    got, _ = run(new_scheduler(dequantized, prefill_chunk=chunk), Request("p", prompt, PARAMS, prompt_logprobs=3))
    chosen, top = reference
    assert len(got) == len(prompt) and got[0] == (prompt[0], None, None)
    assert [t for t, _, _ in got] == prompt
    torch.testing.assert_close(torch.tensor([lp for _, lp, _ in got[1:]]), chosen, atol=1e-4, rtol=0)
    assert [[a for a, _ in alts] for _, _, alts in got[1:]] == top.indices.tolist()


def test_prompt_logprobs_bypass_the_cache_and_survive_preemption(dequantized, prompt, reference):
    sched = new_scheduler(dequantized, prefill_chunk=8)
    list(sched.run([Request("warm", prompt, PARAMS)]))  # the prompt's blocks are now cached
    req = Request("p", prompt, PARAMS, prompt_logprobs=0)
    sched.add_request(req)
    sched.step()
    sched.step()
    assert sched.preempt("p")  # mid-prefill: positions already recorded must not repeat
    outs = []
    while sched.has_unfinished():
        outs += sched.step()
    got = outs[0].prompt_logprobs
    assert outs[-1].num_cached_tokens == 0  # bypassed the warm cache
    assert len(got) == len(prompt) and all(alts == [] for _, _, alts in got[1:])
    torch.testing.assert_close(torch.tensor([lp for _, lp, _ in got[1:]]), reference[0], atol=1e-4, rtol=0)


def test_tokens_are_the_same_with_or_without_prompt_logprobs(loaded, prompt):
    _, with_lp = run(new_scheduler(loaded, deterministic=True, prefill_chunk=5),
                     Request("a", prompt, PARAMS, prompt_logprobs=2))
    plain = [t for o in new_scheduler(loaded, deterministic=True).run([Request("b", prompt, PARAMS)]) for t in o.token_ids]
    assert with_lp == plain


def test_bad_prompt_logprobs_are_refused(loaded, prompt):
    sched = new_scheduler(loaded)
    with pytest.raises(InvalidRequestError):
        sched.add_request(Request("x", prompt, PARAMS, prompt_logprobs=21))
    with pytest.raises(InvalidRequestError):
        sched.add_request(Request("y", prompt, SamplingParams(max_tokens=0), prompt_logprobs=1))
    assert not sched.has_unfinished()
