"""The decode loop with several sequences: batch-transparency, chunked prefill, limits, abort."""

from __future__ import annotations

import logging

import pytest
import torch

from helpers import first_divergence, near_tie, run_requests
from monobatch.engine.params import SamplingParams
from monobatch.engine.sequence import FinishReason, Request
from monobatch.errors import ContextLengthError, InvalidRequestError

log = logging.getLogger(__name__)
pytestmark = pytest.mark.usefixtures("one_cpu_thread")  # see conftest: oversubscription on a shared box
TEXTS = ["The quick brown fox", "In 1969, the first humans", "import numpy as np\n", "Roses are red,",
         "The three primary colours are"]
GREEDY = SamplingParams(max_tokens=24, temperature=0.0)


@pytest.fixture(scope="module")
def prompts(loaded):
    return [loaded.tokenizer.encode(t) for t in TEXTS]


def logit_margin(loaded, ids: list[int]) -> float:
    """Our top-2 margin after ``ids`` (B=1, dense): how close the tie was where outputs differ."""
    from monobatch.engine.engine import Engine

    return Engine(loaded).top2_margin(ids)


def assert_same_or_near_tie(loaded, prompt, alone, other, label):
    i = first_divergence(alone, other)
    if i is None:
        return
    margin = logit_margin(loaded, prompt + alone[:i])
    log.warning("%s: divergence at %d (alone %d, batched %d), top-2 margin %.2e", label, i, alone[i], other[i], margin)
    assert margin < near_tie(loaded), f"{label}: diverged at {i} with margin {margin}"


def test_batched_equals_alone(make_scheduler, loaded, prompts):
    alone = [run_requests(make_scheduler(), [p], GREEDY)[0] for p in prompts]
    together = run_requests(make_scheduler(), prompts, GREEDY)
    for i, p in enumerate(prompts):
        assert len(together[i]) > 0
        assert_same_or_near_tie(loaded, p, alone[i], together[i], f"prompt {i}")


SHORT = SamplingParams(max_tokens=12, temperature=0.0)


@pytest.fixture(scope="module")
def whole_prefill(loaded, prompts):
    from monobatch.engine.engine import Engine
    from monobatch.engine.scheduler import BatchScheduler

    return run_requests(BatchScheduler(Engine(loaded)), prompts[:3], SHORT)


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_chunked_prefill_equals_whole(make_scheduler, loaded, prompts, whole_prefill, chunk):
    whole = whole_prefill
    chunked = run_requests(make_scheduler(prefill_chunk=chunk), prompts[:3], SHORT)
    for i in range(3):
        assert_same_or_near_tie(loaded, prompts[i], whole[i], chunked[i], f"chunk {chunk} prompt {i}")


def test_token_budget_is_respected(make_scheduler, prompts):
    sched = make_scheduler(prefill_chunk=4, max_num_batched_tokens=6, max_num_seqs=2)
    for i, p in enumerate(prompts):
        sched.add_request(Request(f"r{i}", p, SamplingParams(max_tokens=6, temperature=0.0)))
    sizes = []
    real_step = sched.engine.step
    sched.engine.step = lambda batch, *rest: sizes.append(batch.num_tokens) or real_step(batch, *rest)
    while sched.has_unfinished():
        sched.step()
        assert len(sched.running) <= 2
    assert sizes and max(sizes) <= 6
    assert sched.engine.kv.num_sequences() == 0


def test_max_tokens_and_finish_reasons(make_scheduler, prompts):
    sched = make_scheduler()
    outs = list(sched.run([Request("a", prompts[0], SamplingParams(max_tokens=5, temperature=0.0)),
                           Request("b", prompts[1], SamplingParams(max_tokens=0, temperature=0.0))]))
    final = {o.request_id: o for o in outs if o.finished}
    assert final["a"].finish_reason is FinishReason.LENGTH and final["a"].num_output_tokens == 5
    assert final["b"].finish_reason is FinishReason.LENGTH and final["b"].num_output_tokens == 0
    assert sum(len(o.token_ids) for o in outs if o.request_id == "a") == 5


def test_context_bound_stops_with_length(make_scheduler, prompts):
    p = prompts[0]
    sched = make_scheduler(max_model_len=len(p) + 3)
    outs = list(sched.run([Request("a", p, SamplingParams(temperature=0.0, ignore_eos=True))]))
    assert outs[-1].finish_reason is FinishReason.LENGTH
    assert outs[-1].num_output_tokens == 3
    assert sched.engine.kv.num_sequences() == 0


def test_bad_requests_are_refused_and_change_nothing(make_scheduler, loaded, prompts):
    sched = make_scheduler(max_model_len=16)
    with pytest.raises(InvalidRequestError, match="empty"):
        sched.add_request(Request("e", [], GREEDY))
    with pytest.raises(ContextLengthError, match="16 tokens"):
        sched.add_request(Request("long", list(range(1, 17)), GREEDY))
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        sched.add_request(Request("v", [loaded.model.args.vocab_size], GREEDY))
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        sched.add_request(Request("b", prompts[0][:4], SamplingParams(logit_bias={10**6: 1.0})))
    assert not sched.has_unfinished()
    [out] = run_requests(sched, [prompts[0][:4]], SamplingParams(max_tokens=3, temperature=0.0))
    assert len(out) == 3


def test_abort_frees_kv_within_a_step(make_scheduler, prompts):
    sched = make_scheduler()
    sched.add_request(Request("a", prompts[0], SamplingParams(max_tokens=50, temperature=0.0)))
    sched.add_request(Request("b", prompts[1], SamplingParams(max_tokens=5, temperature=0.0)))
    sched.step()
    sched.step()
    assert sched.engine.kv.num_sequences() == 2
    assert sched.abort("a")
    assert sched.engine.kv.num_sequences() == 1
    outs = list(sched.run())
    aborted = [o for o in outs if o.request_id == "a"]
    assert len(aborted) == 1 and aborted[0].finish_reason is FinishReason.ABORT
    assert sched.engine.kv.num_sequences() == 0
    assert not sched.abort("a")


def test_eos_ends_with_stop_and_no_text(make_scheduler, loaded):
    """A chat reply ends at <|im_end|> (an end-of-generation id) with finish_reason stop."""
    ids = loaded.tokenizer.encode_chat([{"role": "user", "content": "Say hello."}])
    outs = list(make_scheduler().run([Request("a", ids, SamplingParams(max_tokens=64, temperature=0.0))]))
    assert outs[-1].finish_reason is FinishReason.STOP
    assert outs[-1].token_ids[0] in loaded.tokenizer.eog_ids
    assert "<|im_end|>" not in "".join(o.text for o in outs)


def test_failed_step_aborts_its_sequences_and_the_loop_recovers(make_scheduler, loaded, prompts):
    """An error inside a step (here: the KV cache cannot grow) ends that step's sequences with
    abort and frees their KV; the loop keeps serving the next request."""
    from monobatch.errors import InsufficientMemoryError
    from monobatch.kv.dense import DenseKv

    sched = make_scheduler()
    good_kv = sched.engine.kv
    a = loaded.model.args
    sched.engine.kv = DenseKv(a.num_hidden_layers, 2**20, 2**10, 2**20, torch.float32, torch.device("cpu"), growth=2**20)
    sched.add_request(Request("doomed", prompts[0], GREEDY))
    with pytest.raises(InsufficientMemoryError):
        sched.step()
    assert not sched.running and sched.engine.kv.num_sequences() == 0
    [final] = sched.step()
    assert final.request_id == "doomed" and final.finish_reason is FinishReason.ABORT
    sched.engine.kv = good_kv
    [out] = run_requests(sched, [prompts[1]], SamplingParams(max_tokens=3, temperature=0.0))
    assert len(out) == 3


def test_failed_step_keeps_outputs_already_due(make_scheduler, loaded, prompts):
    """Final outputs queued before a failing step (max_tokens=0 here) still reach the client."""
    from monobatch.errors import InsufficientMemoryError
    from monobatch.kv.dense import DenseKv

    sched = make_scheduler()
    a = loaded.model.args
    sched.engine.kv = DenseKv(a.num_hidden_layers, 2**20, 2**10, 2**20, torch.float32, torch.device("cpu"), growth=2**20)
    sched.add_request(Request("zero", prompts[0], SamplingParams(max_tokens=0)))
    sched.add_request(Request("doomed", prompts[1], GREEDY))
    with pytest.raises(InsufficientMemoryError):
        sched.step()
    finals = {o.request_id: o.finish_reason for o in sched.step()}
    assert finals == {"zero": FinishReason.LENGTH, "doomed": FinishReason.ABORT}


def test_a_planning_failure_ends_the_running_sequences(make_scheduler, prompts, monkeypatch):
    """If planning itself raises (a bug), the running sequences end with abort and their KV is
    freed, so a loop that keeps stepping makes progress instead of failing forever."""
    sched = make_scheduler()
    sched.add_request(Request("a", prompts[0], SHORT))
    sched.step()
    monkeypatch.setattr(sched, "_schedule", lambda: (_ for _ in ()).throw(RuntimeError("planner bug")))
    with pytest.raises(RuntimeError, match="planner bug"):
        sched.step()
    monkeypatch.undo()
    outs = [o for o in sched.step() if o.finished]
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", FinishReason.ABORT)]
    assert not sched.has_unfinished() and sched.kv.usage().used_blocks == 0


def test_warm_up_burst_leaves_nothing_behind(make_scheduler, prompts):
    """The server's start-up burst (BatchScheduler.warm_up; on CUDA it JIT-compiles the eager
    steps' kernels) runs through the loop and leaves no sequence, KV block, cached prefix or
    counter behind: the next request's tokens equal a fresh scheduler's."""
    from monobatch.engine.scheduler import warm_up_requests

    config = dict(max_num_seqs=4, max_num_batched_tokens=40, prefill_chunk=16)
    warm = make_scheduler(**config)
    calls = []
    warm.add_finish_observer(lambda done: calls.append(done.request_id))
    warm.warm_up(burst=True)
    assert len(calls) == 4 and all(c.startswith("warm-up-") for c in calls)  # the burst ran
    usage, stats = warm.kv.usage(), warm.stats()
    assert stats.paged_attention_calls == 0  # no request's step
    assert not warm.has_unfinished() and usage.used_blocks == 0 and usage.cached_blocks == 0
    assert (stats.prompt_tokens_total, stats.generation_tokens_total, stats.num_requests_finished,
            stats.prefix_cache_queries) == (0, 0, 0, 0)
    assert run_requests(warm, prompts[:2], SHORT) == run_requests(make_scheduler(**config), prompts[:2], SHORT)

    burst = warm_up_requests(49152, 64, 8192, 16384, 10**6)
    lengths = [len(r.prompt_ids) for r in burst]
    assert len(burst) == 64 and 2 * 8192 - 600 <= sum(lengths) <= 2 * 8192 + 600
    assert len({n % 16 for n in lengths}) > 8 and min(lengths) <= 16  # unlike lengths, one short prompt
    assert {r.params.temperature == 0 for r in burst} == {True, False}
    small = warm_up_requests(49152, 64, 8192, 16384, 1600)  # a small pool: the longest prompts dropped
    assert sum(len(r.prompt_ids) + 4 for r in small) <= 1600 and min(len(r.prompt_ids) for r in small) <= 7
    assert len(warm_up_requests(49152, 1, 8192, 16384, 10**6)[0].prompt_ids) > 8192  # one sequence: full-budget steps
    started = make_scheduler(**config)
    started.add_request(Request("busy", prompts[0], SHORT))
    with pytest.raises(RuntimeError):
        started.warm_up(burst=True)
