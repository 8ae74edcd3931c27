"""RowSampler / SamplerState: each stage by hand, the chain order, seeded draws, logprobs.

Expected values are worked out by hand on small vocabularies, or by direct ports of llama.cpp's
loops (src/llama-sampling.cpp) written here independently of the vectorised implementation.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as hs

from monobatch.engine import sampler_stages as stages
from monobatch.engine.params import SamplingParams
from monobatch.engine.sampler import RowSampler, SampleOutput, SamplerState
from monobatch.errors import InvalidRequestError

INF = float("inf")


pytestmark = pytest.mark.usefixtures("one_cpu_thread")


def make(prompt=(), seed=0, token_bytes=None, **kw) -> SamplerState:
    return SamplerState(SamplingParams(**kw), list(prompt), seed, token_bytes)


def transform(logits, *states, vocab=None) -> torch.Tensor:
    x = torch.as_tensor(logits, dtype=torch.float32)
    if x.dim() == 1:
        x = x[None].repeat(len(states), 1)
    return RowSampler(vocab or x.shape[1]).transform(x, list(states))


def kept(row: torch.Tensor) -> set[int]:
    return set(torch.nonzero(torch.isfinite(row)).flatten().tolist())


def log_probs(*p) -> list[float]:
    return [math.log(v) for v in p]


# -- 1. logit_bias ------------------------------------------------------------------------------

def test_logit_bias_adds_to_the_logit():
    x = [0.5, 1.0, -2.0, 0.0, 3.0, 0.0]
    out = transform(x, make(logit_bias={1: 2.5, 4: -3.0}))[0]
    assert out.tolist() == pytest.approx([0.5, 3.5, -2.0, 0.0, 0.0, 0.0])


def test_logit_bias_minus_100_removes_and_plus_100_forces_the_token():
    """E4: a -100 bias removes the argmax; +100 forces a token in greedy and sampled rows."""
    x = torch.tensor([[5.0, 1.0, 0.0, 0.0]] * 3)
    states = [make(temperature=0, logit_bias={0: -100}), make(temperature=0, logit_bias={2: 100}),
              make(seed=3, logit_bias={3: 100})]
    assert RowSampler(4).sample(x, states).token_ids == [1, 2, 3]


# -- 2. repetition penalty (prompt + output, window repeat_last_n) ----------------------------

def test_repeat_penalty_divides_positive_and_multiplies_negative_logits():
    x = [2.0, -1.0, 0.5, 3.0, -2.0, 1.0]
    out = transform(x, make(prompt=[0, 1, 1, 5], repeat_penalty=2.0))[0]
    # once per token whatever its count: 2/2, -1*2, 1/2
    assert out.tolist() == pytest.approx([1.0, -2.0, 0.5, 3.0, -2.0, 0.5])


@pytest.mark.parametrize("last_n, expected_hit", [(2, {1, 5}), (0, set()), (-1, {0, 1, 5}),
                                                  (64, {0, 1, 5})])
def test_repeat_penalty_window(last_n, expected_hit):
    x = [2.0, 2.0, 2.0, 2.0, 2.0, 2.0]
    out = transform(x, make(prompt=[0, 1, 1, 5], repeat_penalty=2.0, repeat_last_n=last_n))[0]
    assert {i for i, v in enumerate(out.tolist()) if v == 1.0} == expected_hit


def test_repeat_window_minus_one_sees_past_64_tokens_and_slides_on_accept():
    prompt = [0] + [1] * 70
    x = [2.0] * 4
    assert transform(x, make(prompt=prompt, repeat_penalty=2.0, repeat_last_n=-1))[0][0] == 1.0
    assert transform(x, make(prompt=prompt, repeat_penalty=2.0, repeat_last_n=64))[0][0] == 2.0
    s = make(prompt=[2, 3], repeat_penalty=2.0, repeat_last_n=3)
    s.accept(1)  # window [2, 3, 1]
    assert transform(x, s)[0].tolist() == [2.0, 1.0, 1.0, 1.0]
    s.accept(1)  # window [3, 1, 1]: 2 dropped out
    assert transform(x, s)[0].tolist() == [2.0, 1.0, 2.0, 1.0]
    assert s.repeat_counts == {3: 1, 1: 2}


# -- 3. presence / frequency over generated tokens only (case P1) -----------------------------

def test_p1_presence_and_frequency_ignore_the_prompt_but_repeat_penalty_counts_it():
    """P1: prompt of one token repeated. First-step logits are unchanged by presence/frequency,
    changed by repeat_penalty (prompt + output within repeat_last_n)."""
    x = [1.0, 2.0, 3.0, 4.0, 0.5, -1.0]
    prompt = [3] * 8
    pf = transform(x, make(prompt=prompt, presence_penalty=1.5, frequency_penalty=0.5))[0]
    assert pf.tolist() == x
    rep = transform(x, make(prompt=prompt, repeat_penalty=2.0))[0]
    assert rep.tolist() == [1.0, 2.0, 3.0, 2.0, 0.5, -1.0]


def test_presence_frequency_openai_formula_on_generated_counts():
    x = [1.0, 2.0, 3.0, 4.0, 0.5, -1.0]
    s = make(prompt=[3] * 8 + [1], presence_penalty=1.5, frequency_penalty=0.5)
    for t in (3, 3, 4):
        s.accept(t)
    out = transform(x, s)[0]
    # token 3: 4 - (0.5*2 + 1.5); token 4: 0.5 - (0.5*1 + 1.5); prompt-only token 1 untouched
    assert out.tolist() == pytest.approx([1.0, 2.0, 3.0, 1.5, -1.5, -1.0])
    assert s.generated == [3, 3, 4] and s.num_prompt_tokens == 9


def test_negative_presence_penalty_raises_the_logit():
    s = make(prompt=[], presence_penalty=-1.0)
    s.accept(2)
    assert transform([0.0] * 4, s)[0].tolist() == [0.0, 0.0, 1.0, 0.0]


# -- 4. DRY ------------------------------------------------------------------------------------

NL = 0  # token 0 is "\n", a default sequence breaker, in these tests


def tb(token: int) -> bytes:
    return b"\n" if token == NL else bytes([ord("A") + token])


DRY = dict(dry_multiplier=0.8, dry_base=1.75, dry_allowed_length=2, temperature=0)


def dry_penalties(history, token_bytes=None, vocab=10, **kw) -> list[float]:
    s = make(prompt=history, token_bytes=token_bytes, **{**DRY, **kw})
    return (-transform([0.0] * vocab, s)[0]).tolist()


def test_dry_penalises_the_token_that_extends_the_repeat():
    # a b c d \n a b c -> "d" would make "a b c d" repeat: match 3, 0.8 * 1.75**(3-2)
    pen = dry_penalties([1, 2, 3, 4, NL, 1, 2, 3], tb)
    assert pen == pytest.approx([0, 0, 0, 0, 0.8 * 1.75, 0, 0, 0, 0, 0])


def test_dry_exponent_grows_with_match_length():
    pen = dry_penalties([5, 1, 2, 3, 4, 7, 5, 1, 2, 3], tb)  # match "5 1 2 3" = 4
    assert pen[4] == pytest.approx(0.8 * 1.75 ** 2) and sum(pen) == pytest.approx(pen[4])


def test_dry_breaker_inside_the_repeat_limits_the_match():
    h = [1, NL, 2, 3, 4, 7, 1, NL, 2, 3]  # the match "1 \n 2 3" is cut at the breaker
    assert dry_penalties(h, tb)[4] == pytest.approx(0.8)  # match 2 -> 1.75**0
    assert dry_penalties(h, None)[4] == pytest.approx(0.8 * 1.75 ** 2)  # breakers ignored


def test_dry_breaker_right_before_the_end_stops_all_penalties():
    assert sum(dry_penalties([1, 2, NL, 3, 4, 7, 1, 2, NL, 3], tb)) == 0.0


def test_dry_never_penalises_a_breaker_token():
    h = [1, 2, 3, NL, 5, 1, 2, 3]  # "\n" would extend "1 2 3"
    assert sum(dry_penalties(h, tb)) == 0.0
    assert dry_penalties(h, None)[NL] == pytest.approx(0.8 * 1.75)


def test_dry_breaker_spanning_two_tokens():
    """A multi-character breaker split over two tokens still bounds the match (byte matching)."""
    pieces = {8: b"x:", 9: b":y"}
    bytes_of = lambda t: pieces.get(t, bytes([ord("A") + t]))
    h = [1, 8, 9, 2, 3, 4, 6, 1, 8, 9, 2, 3]  # text ... "x::y" holds "::" ending in token 9
    assert dry_penalties(h, bytes_of, dry_sequence_breakers=("::",))[4] == pytest.approx(0.8)
    no_bytes = dry_penalties(h, None, dry_sequence_breakers=("::",))
    assert no_bytes[4] == pytest.approx(0.8 * 1.75 ** 3)


def test_dry_window_and_allowed_length():
    h = [1, 2, 3, 4, 7, 1, 2, 3]
    assert sum(dry_penalties(h, tb, dry_penalty_last_n=5)) == 0.0  # window 4 7 1 2 3
    assert dry_penalties(h, tb, dry_allowed_length=3)[4] == pytest.approx(0.8)
    assert sum(dry_penalties(h, tb, dry_allowed_length=4)) == 0.0


def test_dry_exponent_is_clamped_like_llama_cpp():
    delta = stages.dry_delta(np.array([1000.0, 3.0]), 1.0, 2.0, 0)
    assert delta.tolist() == [-(2.0 ** int(88.7228391 / math.log(2.0))), -8.0]
    assert stages.dry_delta(np.array([1000.0]), 0.5, 1.0, 2).tolist() == [-0.5]  # base 1


def llama_cpp_dry(tokens, window, mult, base, allowed, breaker_ids) -> dict[int, float]:
    """Direct port of llama_sampler_dry_apply with single-token breakers (naive repeat counts)."""
    last = tokens[-window:] if window > 0 else list(tokens)
    n = len(last)
    rat = lambda i: last[n - 1 - i]
    if n <= allowed:
        return {}
    rep_limit = n
    for i in range(n):
        if rat(i) in breaker_ids:
            rep_limit = i
            break
    if rep_limit < allowed:
        return {}
    counts = [0] * n
    for k in range(1, n):
        m = 0
        while m + k < n and rat(m) == rat(m + k):
            m += 1
        counts[n - 1 - k] = min(m, rep_limit)
    longest: dict[int, int] = {}
    for i in range(n - 1):
        if counts[i] >= allowed:
            tok = rat(n - 2 - i)
            longest[tok] = max(longest.get(tok, 0), counts[i])
    max_exp = int(88.7228391 / math.log(base)) if base > 1.000001 else 0
    out = {}
    for tok, m in longest.items():
        if tok not in breaker_ids:
            e = m - allowed
            out[tok] = mult * base ** (min(e, max_exp) if max_exp > 0 else e)
    return out


@settings(max_examples=150, deadline=None)
@given(tokens=hs.lists(hs.integers(0, 4), min_size=1, max_size=40),
       split=hs.integers(0, 40), window=hs.sampled_from([-1, 3, 8, 64]),
       allowed=hs.integers(0, 3))
def test_dry_incremental_matches_fresh_state_and_llama_cpp(tokens, split, window, allowed):
    kw = dict(DRY, dry_penalty_last_n=window, dry_allowed_length=allowed)
    split = min(split, len(tokens))
    inc = make(prompt=tokens[:split], token_bytes=tb, **kw)
    for t in tokens[split:]:
        inc.accept(t)
    fresh = make(prompt=tokens, token_bytes=tb, **kw)
    assert inc.dry.lengths == fresh.dry.lengths
    want = llama_cpp_dry(tokens, window, 0.8, 1.75, allowed, {NL})
    got = (-transform([0.0] * 5, inc)[0]).tolist()
    assert got == pytest.approx([want.get(t, 0.0) for t in range(5)], rel=1e-6)


# -- 5-9. top_k, typical_p, top_p, min_p, temperature ------------------------------------------

def test_top_k_keeps_the_k_best():
    out = transform([1.0, 3.0, 2.0, 5.0, 4.0, 0.0], make(top_k=3))[0]
    assert kept(out) == {1, 3, 4} and out[3] == 5.0
    assert kept(transform([1.0, 3.0, 2.0], make(top_k=0))[0]) == {0, 1, 2}
    assert kept(transform([1.0, 3.0, 2.0], make(top_k=-1))[0]) == {0, 1, 2}


def test_typical_p_hand_example_can_drop_the_most_likely_token():
    # q = [.4, .3, .3]: H = 1.0889; |-ln q - H| = [.173, .115, .115] -> order 1, 2, 0;
    # mass .3, .6 > .5 stops after the second
    out = transform(log_probs(0.4, 0.3, 0.3), make(typical_p=0.5))[0]
    assert kept(out) == {1, 2}


def ref_typical(logits: np.ndarray, p: float) -> set[int]:
    q = np.exp(logits - logits.max())
    q /= q.sum()
    h = -(q * np.log(q)).sum()
    order = np.argsort(np.abs(-np.log(q) - h), kind="stable")
    cum, last = 0.0, len(order)
    for i, j in enumerate(order):
        cum += q[j]
        if cum > p:
            last = i + 1
            break
    return set(order[:last].tolist())


def ref_top_p(logits: np.ndarray, p: float) -> set[int]:
    order = np.argsort(-logits, kind="stable")
    q = np.exp(logits - logits.max())
    q /= q.sum()
    cum = 0.0
    for i, j in enumerate(order):
        cum += q[j]
        if cum >= p:
            return set(order[:i + 1].tolist())
    return set(order.tolist())


@pytest.mark.parametrize("case", range(40))
def test_typical_and_top_p_match_llama_cpp_loops(case):
    rng = np.random.default_rng(case)
    x = rng.normal(0, 2, size=12).astype(np.float32)
    p = float(rng.uniform(0.05, 0.95))
    assert kept(transform(x, make(typical_p=p))[0]) == ref_typical(x.astype(np.float64), p)
    assert kept(transform(x, make(top_p=p))[0]) == ref_top_p(x.astype(np.float64), p)


@pytest.mark.parametrize("top_p, expected", [(0.45, {0}), (0.7, {0, 1}), (0.85, {0, 1, 2}),
                                             (1.0, {0, 1, 2, 3}), (0.0, {0})])  # 0: the most likely token only
def test_top_p_keeps_the_token_that_crosses_the_threshold(top_p, expected):
    assert kept(transform(log_probs(0.5, 0.3, 0.15, 0.05), make(top_p=top_p))[0]) == expected


@pytest.mark.parametrize("min_p, expected", [(0.2, {0, 1, 2}), (0.7, {0}), (0.0, {0, 1, 2, 3}),
                                             (1.0, {0})])
def test_min_p_is_relative_to_the_most_likely_token(min_p, expected):
    # threshold min_p * 0.5: 0.2 -> 0.1 keeps .5 .3 .15; 0.7 -> .35 keeps .5
    assert kept(transform(log_probs(0.5, 0.3, 0.15, 0.05), make(min_p=min_p))[0]) == expected


def test_temperature_divides_the_logits():
    out = transform([1.0, -2.0, 0.5], make(temperature=0.5), make(temperature=2.0))
    assert out.tolist() == [[2.0, -4.0, 1.0], [0.5, -1.0, 0.25]]


# -- the chain order --------------------------------------------------------------------------

def test_bias_comes_before_the_repeat_penalty():
    out = transform([2.0, 0.0], make(prompt=[0], logit_bias={0: 2.0}, repeat_penalty=2.0))[0]
    assert out[0] == 2.0  # (2 + 2) / 2, not 2 / 2 + 2


def test_repeat_penalty_comes_before_presence():
    s = make(prompt=[0], repeat_penalty=1.5, presence_penalty=0.5)
    s.accept(0)
    assert transform([3.0, 0.0], s)[0][0].item() == pytest.approx(3.0 / 1.5 - 0.5)


def test_top_k_runs_after_the_penalties():
    # a bias pushes the best token out of the top 1
    out = transform([5.0, 4.0, 3.0], make(top_k=1, logit_bias={0: -10.0}))[0]
    assert kept(out) == {1}


def test_top_p_sees_the_distribution_left_by_top_k():
    # top_k=2 renormalises [.4, .35] to [.53, .47]; top_p .5 then keeps one token
    # (top_p on the original would have kept two)
    assert kept(transform(log_probs(0.4, 0.35, 0.25), make(top_k=2, top_p=0.5))[0]) == {0}


def test_top_p_sees_the_distribution_left_by_typical():
    # typical .5 keeps {1, 2} (equal mass); top_p .3 then keeps one of them, not token 0
    out = transform(log_probs(0.4, 0.3, 0.3), make(typical_p=0.5, top_p=0.3))[0]
    assert kept(out) == {1}


def test_top_p_0_keeps_the_most_likely_token_typical_left():
    # typical .5 drops token 0 (its -inf stays in column 0 of the sorted row): top_p 0 keeps the
    # best token left, never an all -inf row
    out = transform(log_probs(0.4, 0.3, 0.3), make(typical_p=0.5, top_p=0.0))[0]
    assert kept(out) == {1}


def seeds_batch(n, seed0=0, **kw) -> list[SamplerState]:
    params = SamplingParams(**kw)
    return [SamplerState(params, [], seed0 + i) for i in range(n)]


def test_min_p_is_computed_before_temperature():
    # min_p .1 on the T=1 distribution drops token 2 (logit -3 < ln .1); at T=100 it would pass
    states = seeds_batch(2000, min_p=0.1, temperature=100.0)
    x = torch.tensor([[0.0, -1.0, -3.0]]).repeat(2000, 1)
    toks = np.array(RowSampler(3).sample(x, states).token_ids)
    assert (toks == 2).sum() == 0 and 900 < (toks == 0).sum() < 1100


def test_greedy_applies_bias_and_penalties_but_not_filters():
    s = make(prompt=[0], temperature=0, repeat_penalty=4.0, typical_p=0.5, top_k=1, min_p=0.9)
    x = torch.tensor([[2.0, 1.0, 0.5]])
    assert RowSampler(3).sample(x, [s]).token_ids == [1]  # 2/4 < 1
    typical = make(temperature=0, typical_p=0.5)  # typical alone would drop token 0
    x = torch.tensor([log_probs(0.4, 0.3, 0.3)])
    assert RowSampler(3).sample(x, [typical]).token_ids == [0]


def test_greedy_is_argmax():
    x = torch.randn(7, 50, generator=torch.Generator().manual_seed(0))
    states = [make(temperature=0) for _ in range(7)]
    assert RowSampler(50).sample(x, states).token_ids == x.argmax(-1).tolist()


# -- seeded draws -----------------------------------------------------------------------------

def reference_uniform(seed: int, position: int, j: int) -> float:
    """SplitMix64, written out with Python ints: output j+1 of the stream at row_key."""
    key = stages.row_key(seed, position)
    z = stages.splitmix64((key + j * stages.GOLDEN) & stages.M64)
    return (((z >> 12) ^ (1 << 51)) + 0.5) * 2.0 ** -52


def test_counter_uniforms_match_the_integer_reference():
    cases = [(0, 0), (1, 5), (2**63 - 1, 123456), (987654321, 2**20)]
    keys = torch.tensor([stages.to_signed64(stages.row_key(s, p)) for s, p in cases])
    u = stages.counter_uniforms(keys, torch.arange(300))
    for r, (s, p) in enumerate(cases):
        assert u[r].tolist() == [reference_uniform(s, p, j) for j in range(300)]
    assert 0.0 < u.min().item() and u.max().item() < 1.0


@settings(max_examples=200, deadline=None)
@given(hs.lists(hs.tuples(hs.integers(-(1 << 63), (1 << 64) - 1), hs.integers(0, (1 << 40))), min_size=1, max_size=40))
def test_vectorized_row_keys_equal_row_key(cases):
    """The plan's keys for a whole group at once (numpy uint64, wrapping) are row_key's, bit for bit."""
    mixes = np.array([stages.seed_mix(s) for s, _ in cases], np.uint64)
    got = stages.row_keys(mixes, np.array([p for _, p in cases], np.uint64))
    assert got.dtype == np.int64
    assert got.tolist() == [stages.to_signed64(stages.row_key(s, p)) for s, p in cases]


def test_sampled_rows_plan_keys_and_values_per_row():
    """_Plan's sampled rows: each group's rows, keys (at position len(history) + ahead) and
    values are those of the row's own params, whatever rows sit between them."""
    from monobatch.engine.sampler import _Plan

    params = [SamplingParams(temperature=0.8, top_p=0.95, seed=7), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.2, top_k=40, min_p=0.05, seed=3),
              SamplingParams(temperature=0.7, seed=11, repeat_penalty=1.1),
              SamplingParams(temperature=0.9, typical_p=0.5, seed=5, logprobs=2)]
    states = [SamplerState(p, [1, 2, 3 + i], p.effective_seed()) for i, p in enumerate(params)]
    states[3].accept(9)
    plan = _Plan(states, 500, ahead=1)
    want = {"sort": [0, 4], "topk": [2], "plain": [3]}
    for g, rows in want.items():
        assert plan.ints[f"{g}_rows"].tolist() == rows
        assert plan.ints[f"{g}_keys"].tolist() == [states[r].draw_key(1) for r in rows]
        p = [params[r] for r in rows]
        assert plan.ints[f"{g}_top_k"].tolist() == [q.top_k for q in p]
        assert plan.flts[f"{g}_temp"].tolist() == [q.temperature for q in p]
        assert plan.flts[f"{g}_top_p"].tolist() == [q.top_p if q.top_p < 1 else math.inf for q in p]
        assert plan.flts[f"{g}_typical"].tolist() == [q.typical_p if q.typical_p < 1 else math.inf for q in p]
        assert plan.flts[f"{g}_log_min_p"].tolist() == [math.log(q.min_p) if q.min_p else -math.inf for q in p]
    assert plan.ints["rep_rows"].tolist() == [3] * len(states[3].repeat_counts)
    assert plan.ints["lp_rows"].tolist() == [4] and plan.top_n == [None, None, None, None, 2]


def test_row_keys_differ_across_seeds_and_positions():
    keys = {stages.row_key(s, p) for s in range(50) for p in range(50)}
    assert len(keys) == 2500


def neighbours(rng: np.random.Generator) -> list[SamplerState]:
    return [make(prompt=[1, 2, 1], seed=int(rng.integers(2**62)), temperature=0.7,
                 repeat_penalty=1.3, presence_penalty=0.4, logit_bias={3: 5.0}),
            make(temperature=0, logit_bias={2: 1.0}),
            make(prompt=[4, 4], seed=SamplingParams().effective_seed(), top_k=5, min_p=0.05),
            make(seed=77, dry_multiplier=0.8, prompt=[1, 2, 3, 1, 2], top_p=0.8, logprobs=3)]


def test_a_seeded_row_is_independent_of_its_batch_and_row_order():
    """Invariant 3: same (seed, position) -> same token alone, in a batch, in any row order."""
    V = 40
    gen = torch.Generator().manual_seed(1)
    rng = np.random.default_rng(2)
    sampler = RowSampler(V)
    target = make(prompt=[5, 6, 7], seed=1234, temperature=0.9, top_p=0.95, top_k=30)
    for step in range(25):
        row = torch.randn(V, generator=gen) * 3
        alone = sampler.sample(row[None], [target]).token_ids[0]
        others = neighbours(rng)
        for at in range(len(others) + 1):
            states = others[:at] + [target] + others[at:]
            x = torch.randn(len(states), V, generator=gen) * 3
            x[at] = row
            assert sampler.sample(x, states).token_ids[at] == alone
        target.accept(alone)


def test_recompute_replays_the_same_seeded_tokens():
    """Preemption with recompute: a rebuilt state (prompt + accepted tokens) draws the same."""
    V, gen = 30, torch.Generator().manual_seed(5)
    steps = [torch.randn(1, V, generator=gen) * 2 for _ in range(30)]
    kw = dict(seed=99, temperature=1.1, repeat_penalty=1.2, presence_penalty=0.3,
              dry_multiplier=0.5, min_p=0.02)
    first, second = make(prompt=[1, 2, 3], **kw), None
    out = []
    for i, x in enumerate(steps):
        if i == 12:  # preempted: rebuild from the prompt and replay the generated tokens
            second = make(prompt=[1, 2, 3], **kw)
            for t in first.generated:
                second.accept(t)
            first = second
        t = RowSampler(V).sample(x, [first]).token_ids[0]
        first.accept(t)
        out.append(t)
    replay = make(prompt=[1, 2, 3], **kw)
    again = []
    for x in steps:
        t = RowSampler(V).sample(x, [replay]).token_ids[0]
        replay.accept(t)
        again.append(t)
    assert out == again


def test_a_draw_over_candidates_equals_the_draw_over_the_vocabulary():
    """The RNG is keyed by token id, so drawing among kept candidates (any order) is exact."""
    gen = torch.Generator().manual_seed(4)
    z = torch.randn(200, 30, generator=gen, dtype=torch.float64)
    z[:, 12:] = -INF
    keys = torch.tensor([stages.to_signed64(stages.row_key(s, 3)) for s in range(200)])
    perm = torch.stack([torch.randperm(12, generator=gen) for _ in range(200)])
    full = stages.gumbel_argmax(z, keys)
    assert torch.equal(stages.gumbel_argmax(z.gather(1, perm), keys, perm), full)


def test_top_k_fast_path_matches_the_full_sort(monkeypatch):
    import monobatch.engine.sampler as sampler_module

    V, n = 300, 400
    x = (torch.randn(V, generator=torch.Generator().manual_seed(8)) * 2).repeat(n, 1)
    params = [SamplingParams(top_k=k, top_p=p, typical_p=tp, min_p=m, temperature=0.9)
              for k, p, tp, m in [(40, 0.9, 1.0, 0.0), (7, 1.0, 0.8, 0.0), (100, 0.95, 1.0, 0.02)]]
    states = [SamplerState(params[i % 3], [1, 2], seed=i) for i in range(n)]
    fast = RowSampler(V).sample(x, states).token_ids
    fast_logits = RowSampler(V).transform(x[:3], states[:3])
    monkeypatch.setattr(sampler_module, "TOPK_FAST", 0)  # every top_k row takes the sort path
    assert RowSampler(V).sample(x, states).token_ids == fast
    assert torch.equal(RowSampler(V).transform(x[:3], states[:3]), fast_logits)


def test_different_seeds_give_different_streams():
    V, n = 50, 400
    x = torch.zeros(n, V)
    a = RowSampler(V).sample(x, [make(prompt=[0] * i, seed=1) for i in range(n)]).token_ids
    b = RowSampler(V).sample(x, [make(prompt=[0] * i, seed=2) for i in range(n)]).token_ids
    same = sum(u == v for u, v in zip(a, b))
    assert same < 25  # about n / V = 8 expected by chance
    assert len(set(a)) > 40  # one seed's stream over positions covers the vocabulary


def chi_square(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# chi-square critical values at p = 0.001 for 5 and 2 degrees of freedom
CHI2_5, CHI2_2 = 20.52, 13.82


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_draws_over_seeds_follow_softmax(temperature):
    n = 20000
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.3, -2.0])
    probs = torch.softmax(logits / temperature, -1).double().numpy()
    toks = RowSampler(6).sample(logits.repeat(n, 1), seeds_batch(n, 1000, temperature=temperature))
    counts = np.bincount(toks.token_ids, minlength=6)
    assert chi_square(counts, probs) < CHI2_5


def test_draws_over_positions_follow_softmax():
    n = 20000  # one seed's stream at positions 0..n-1, drawn as RowSampler draws
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.3, -2.0])
    keys = torch.tensor([stages.to_signed64(stages.row_key(42, pos)) for pos in range(n)])
    toks = stages.gumbel_argmax(logits.double().repeat(n, 1), keys)
    counts = np.bincount(toks.numpy(), minlength=6)
    assert chi_square(counts, torch.softmax(logits, -1).double().numpy()) < CHI2_5
    s = make(prompt=[0] * 1234, seed=42)
    assert RowSampler(6).sample(logits[None], [s]).token_ids == [toks[1234].item()]


def test_filtered_draws_follow_the_renormalised_distribution():
    n = 20000
    logits = torch.tensor([1.0, 0.0, -0.5, 2.0, 0.3, -2.0])
    toks = RowSampler(6).sample(logits.repeat(n, 1), seeds_batch(n, 7, top_k=3)).token_ids
    counts = np.bincount(toks, minlength=6)
    assert counts[[1, 2, 5]].sum() == 0
    probs = torch.softmax(logits[[0, 3, 4]], -1).double().numpy()
    assert chi_square(counts[[0, 3, 4]], probs) < CHI2_2


# -- logprobs and output shape ----------------------------------------------------------------

def test_logprobs_are_the_model_distribution_not_the_processed_one():
    x = torch.tensor([[1.0, 2.0, 0.5, -1.0, 0.0], [0.0, 0.1, 0.2, 0.3, 0.4]])
    states = [make(prompt=[1], seed=3, logprobs=3, temperature=0.3, repeat_penalty=3.0,
                   logit_bias={4: 2.0}, top_k=2),
              make(temperature=0)]
    out = RowSampler(5).sample(x, states)
    lp = torch.log_softmax(x, -1)
    assert out.logprobs == pytest.approx([lp[r, t].item() for r, t in enumerate(out.token_ids)])
    best = lp[0].topk(3)
    assert out.top_logprobs[0] == [(i, pytest.approx(v)) for v, i in
                                   zip(best.values.tolist(), best.indices.tolist())]
    assert [i for i, _ in out.top_logprobs[0]] == [1, 0, 2]
    assert out.top_logprobs[1] == []


def test_logprobs_zero_gives_the_chosen_token_only_and_none_when_nobody_asks():
    x = torch.tensor([[0.0, 1.0, 2.0]])
    out = RowSampler(3).sample(x, [make(temperature=0, logprobs=0)])
    assert out.top_logprobs == [[]]
    assert out.logprobs == pytest.approx([math.log(torch.softmax(x, -1)[0, 2])])
    assert RowSampler(3).sample(x, [make(temperature=0)]) == SampleOutput([2], None, None)


def test_padded_vocab_columns_are_never_drawn():
    x = torch.tensor([[0.0, 0.3, 0.2, 0.1, 10.0, 10.0]]).repeat(500, 1)  # padded lm_head: 4 real
    out = RowSampler(4).sample(x, seeds_batch(499, 0) + [make(temperature=0, logprobs=2)])
    assert max(out.token_ids) < 4
    assert [i for i, _ in out.top_logprobs[-1]] == [1, 2]


def test_sample_does_not_change_the_states_or_the_logits():
    s = make(prompt=[1, 2, 1, 2], seed=5, repeat_penalty=1.5, presence_penalty=1.0,
             dry_multiplier=1.0, logit_bias={0: 1.0}, top_p=0.9)
    s.accept(1)
    before = (list(s.history), dict(s.repeat_counts), dict(s.generated_counts),
              dict(s.dry.lengths))
    x = torch.randn(1, 8)
    x0 = x.clone()
    first = RowSampler(8).sample(x, [s]).token_ids
    assert RowSampler(8).sample(x, [s]).token_ids == first
    assert (list(s.history), dict(s.repeat_counts), dict(s.generated_counts),
            dict(s.dry.lengths)) == before
    assert torch.equal(x, x0)


def test_half_precision_logits_and_an_empty_batch():
    x = torch.tensor([[0.0, 3.0, 1.0]], dtype=torch.bfloat16)
    assert RowSampler(3).sample(x, [make(temperature=0)]).token_ids == [1]
    assert RowSampler(3).sample(torch.zeros(0, 3), []) == SampleOutput([], None, None)


def test_bad_shapes_and_out_of_vocab_bias_raise():
    with pytest.raises(ValueError):
        RowSampler(3).sample(torch.zeros(2, 3), [make()])
    with pytest.raises(ValueError):
        RowSampler(5).sample(torch.zeros(1, 3), [make()])
    with pytest.raises(ValueError, match="logit_bias"):
        RowSampler(3).sample(torch.zeros(1, 3), [make(logit_bias={3: 1.0})])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu():
    """Same uniforms bit for bit, and the same tokens for a mixed batch, on CPU and CUDA; each
    row on CUDA draws the same alone as in the batch."""
    keys = torch.tensor([stages.to_signed64(stages.row_key(s, 7)) for s in range(64)])
    ids = torch.arange(4096)
    cpu = stages.counter_uniforms(keys, ids)
    assert torch.equal(stages.counter_uniforms(keys.cuda(), ids.cuda()).cpu(), cpu)
    rng = np.random.default_rng(0)
    states = [s for _ in range(8) for s in neighbours(rng)]
    x = torch.randn(len(states), 64, generator=torch.Generator().manual_seed(3)) * 3
    a, b = RowSampler(64).sample(x, states), RowSampler(64).sample(x.cuda(), states)
    assert a.token_ids == b.token_ids
    assert a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    for r in range(len(states)):  # batch-transparent on the GPU too (invariant 3)
        alone = RowSampler(64).sample(x[r:r + 1].cuda(), [states[r]]).token_ids[0]
        assert alone == b.token_ids[r]


@pytest.mark.parametrize("kw", [dict(logit_bias={"abc": 1.0}), dict(logit_bias={"1": "x"}),
                                dict(logit_bias=[1, 2]), dict(dry_sequence_breakers="\n"),
                                dict(dry_sequence_breakers=[1])])
def test_params_refuse_malformed_logit_bias_and_breakers(kw):
    """E3/E4: malformed sampler fields are a 400 (InvalidRequestError), never a crash."""
    with pytest.raises(InvalidRequestError):
        SamplingParams(**kw)
    assert SamplingParams(logit_bias={"5": -100}).logit_bias == {5: -100.0}


def test_repeat_penalty_results_stay_finite():
    """A penalty that is 0 or inf in float32 (a positive float64 rounded) leaves finite logits: an
    infinite one becomes float32's largest, a NaN 0; a finite result keeps its bits."""
    x = torch.tensor([[2.0, -3.0, 0.5, -1.0]])
    rows, cols = torch.tensor([0, 0, 0, 0]), torch.tensor([0, 1, 2, 3])
    big = torch.finfo(torch.float32).max
    out = stages.apply_repeat_penalty(x.clone(), rows, cols, torch.tensor([0.0, 0.0, float("inf"), 1.3]))
    assert torch.isfinite(out).all()
    assert out.tolist() == [[big, -0.0, 0.0, torch.tensor(-1.0 * 1.3).item()]]
