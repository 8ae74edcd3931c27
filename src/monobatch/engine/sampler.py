"""Per-row sampling with history: :class:`SamplerState` per sequence, :class:`RowSampler` per step.

The chain is llama.cpp's default order (common/sampling.cpp, ``common_sampler_init``), after
the structured-output grammar mask (:mod:`monobatch.engine.constraint`; llama.cpp also applies
its grammar to the raw logits): grammar -> logit_bias -> repetition penalty -> presence/frequency -> DRY -> top_k -> typical_p -> top_p ->
min_p -> temperature -> draw. The formulas live in :mod:`monobatch.engine.sampler_stages`.

Sample and accept are separate calls (llama.cpp ``common_sampler_sample`` / ``_accept``):
``RowSampler.sample`` reads the states and never changes them; the finish step calls
``SamplerState.accept`` with each chosen token, which updates the penalty counts and DRY state.

Reproducibility: a row's draw is a function of its own logits, its state and
``(state.seed, position = len(state.history))`` only, through a counter-based RNG
(:func:`~monobatch.engine.sampler_stages.counter_uniforms`). Neighbours, row order, batch size,
preemption with recompute and the device (the uniforms are integer-exact on CPU and CUDA) do
not change a seeded sequence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

from monobatch.engine import sampler_stages as st
from monobatch.engine.constraint import GrammarMatcher, apply_bitmask, fill_bitmasks
from monobatch.engine.params import SamplingParams
from monobatch.kernels.argmax import argmax


def token_logprobs(logits: torch.Tensor, token_ids: list[int], top_n: int) -> list[tuple[int, float, list[tuple[int, float]]]]:
    """Each row's logprob of a given token, with the row's top-``top_n`` alternatives — the
    MODEL's distribution (``log_softmax`` of raw logits), as for generated tokens. Used for
    prompt logprobs (row i = the logits after prompt token i, ``token_ids[i]`` = prompt token i+1).

    Args:
        logits: ``[N, V]`` float logits (V = the real vocabulary, no padded columns).
        token_ids: N token ids.
        top_n: alternatives per row (0: none).

    Returns:
        ``[(token_id, logprob, [(alt_id, alt_logprob), ...])]``, N entries.
    """
    if not token_ids:
        return []
    lp = torch.log_softmax(logits.float(), dim=-1)  # (N, V)
    chosen = lp.gather(1, torch.tensor(token_ids, device=lp.device)[:, None]).squeeze(1).tolist()
    if top_n > 0:
        top = lp.topk(top_n, dim=-1)
        alts = [list(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]
    else:
        alts = [[] for _ in chosen]
    return list(zip(token_ids, chosen, alts))


@dataclass(slots=True)
class SampleOutput:
    """What :meth:`RowSampler.sample` returns for R rows.

    Attributes:
        token_ids: [R] the drawn token ids.
        logprobs: [R] the log-probability of each drawn token under the MODEL's distribution
            (``log_softmax`` of the raw logits), or None when no row asked for logprobs. When any
            row asks, every row's entry is filled (the values are real, not placeholders).
        top_logprobs: [R][N] ``(token id, logprob)`` alternatives, best first, N = that row's
            ``params.logprobs``; ``[]`` for rows that did not ask; None when no row asked.
    """

    token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs: list[list[tuple[int, float]]] | None


class SamplerState:
    """Per-sequence sampler state: history, penalty counts, DRY state, seed.

    Args:
        params: the request's checked :class:`SamplingParams`.
        prompt_ids: the prompt's token ids (they count for the repetition penalty and DRY, as in
            llama.cpp's server, which accepts the prompt into its sampler; not for
            presence/frequency, case P1).
        seed: the draw's seed (``params.effective_seed()``); keep the state across preemption,
            or rebuild it from the prompt and ``accept`` the generated tokens again.
        token_bytes: a token id's raw bytes, for DRY's sequence breakers. None ignores breakers.
        grammar: the matcher of the request's structured-output constraint
            (``params.structured``, from :meth:`GrammarCompiler.matcher`), or None.

    Attributes:
        history: prompt + generated ids, in order. num_prompt_tokens: the prompt's length.
        repeat_counts: token -> count in the last ``repeat_last_n`` tokens of history (kept only
            while the repetition penalty is on).
        generated_counts: token -> count among generated tokens (kept only while
            presence/frequency is on).
    """

    __slots__ = ("params", "seed", "history", "num_prompt_tokens", "repeat_counts",
                 "generated_counts", "dry", "grammar", "_repeat_window", "_count_generated", "_kind",
                 "has_extras", "seed_mix", "_draw_values")

    def __init__(self, params: SamplingParams, prompt_ids: Sequence[int], seed: int,
                 token_bytes: Callable[[int], bytes] | None = None,
                 grammar: GrammarMatcher | None = None) -> None:
        self.params = params
        self.grammar = grammar
        self.seed = int(seed)
        self.seed_mix = st.seed_mix(self.seed)  # the seed's half of every draw key (st.row_keys)
        self._draw_values: tuple[int, tuple] | None = None  # (vocab size, draw_values' result)
        self.history = [int(t) for t in prompt_ids]
        self.num_prompt_tokens = len(self.history)
        on = params.repeat_penalty != 1.0 and params.repeat_last_n != 0
        self._repeat_window = params.repeat_last_n if on else None  # -1 = whole history
        self.repeat_counts: dict[int, int] = {}
        if on:
            n = params.repeat_last_n
            for t in self.history if n < 0 else self.history[-n:]:
                self.repeat_counts[t] = self.repeat_counts.get(t, 0) + 1
        self._count_generated = params.presence_penalty != 0.0 or params.frequency_penalty != 0.0
        self.generated_counts: dict[int, int] = {}
        dry_on = params.dry_multiplier > 0.0 and params.dry_penalty_last_n != 0
        self.dry = st.DryState(params, self.history, token_bytes) if dry_on else None
        # the draw's kind (the properties below), fixed by the params and the grammar's presence:
        # computed once, as the async scheduler asks every row every step
        free = self._repeat_window is None and not self._count_generated and self.dry is None \
            and params.logprobs is None
        greedy = params.temperature == 0.0 and not params.logit_bias
        history_free, grammar_only = free and grammar is None, free and grammar is not None
        self._kind = (history_free, grammar_only, grammar_only and greedy, greedy and history_free)
        #: whether a step's plan may hold entries of this row beyond its draw values (logprobs,
        #: logit_bias, penalty counts, DRY): fixed by the params, so rows without any skip them
        self.has_extras = not free or bool(params.logit_bias)

    def draw_values(self, vocab_size: int) -> tuple:
        """A sampled row's fixed draw parameters for a vocabulary of ``vocab_size`` (computed once):
        ``(group, top_k, temperature, log min_p, typical_p mass, top_p mass)``; "off" as values
        the stages need no mask for (top_k 0, ln 0 = -inf, a mass of 1 -> inf)."""
        cached = self._draw_values
        if cached is not None and cached[0] == vocab_size:
            return cached[1]
        p = self.params
        top_k = p.top_k if 0 < p.top_k < vocab_size else 0
        g = ("topk" if 0 < top_k <= TOPK_FAST else
             "sort" if top_k or p.typical_p < 1.0 or p.top_p < 1.0 else "plain")
        log_min_p = math.log(p.min_p) if p.min_p > 0.0 else -math.inf
        values = (g, top_k, p.temperature, log_min_p, _mass(p.typical_p), _mass(p.top_p))
        self._draw_values = (vocab_size, values)
        return values

    @property
    def history_free(self) -> bool:
        """True when the next draw does not depend on the generated tokens' values (no repetition,
        presence/frequency or DRY penalty, no grammar, no logprobs): it can be drawn before the
        previous token is known on the host (async scheduling)."""
        return self._kind[0]

    @property
    def grammar_only(self) -> bool:
        """True when the next draw depends on the generated tokens only through the grammar
        matcher (no penalty, DRY or logprobs): async scheduling can still launch the next
        forward first and draw once the previous token is accepted (a deferred draw,
        :meth:`monobatch.engine.engine.Engine.draw_deferred`)."""
        return self._kind[1]

    @property
    def greedy_checked(self) -> bool:
        """True for greedy draws whose only stage is the grammar mask (:attr:`grammar_only`, no
        logit_bias): the draw is the raw argmax whenever the grammar allows it, so it can be
        drawn unmasked and checked once the previous tokens are accepted
        (:meth:`RowSampler.draw` ``unchecked``, :meth:`RowSampler.correct`)."""
        return self._kind[2]

    @property
    def argmax_draw(self) -> bool:
        """True when the draw is an argmax: :attr:`plain_greedy`, or :attr:`greedy_checked` (the
        raw argmax wherever the grammar allows it). Exact whatever the batch."""
        return self._kind[2] or self._kind[3]

    @property
    def plain_greedy(self) -> bool:
        """True for greedy draws with no logit_bias, penalty or logprobs: the draw is the argmax."""
        return self._kind[3]

    def draw_key(self, ahead: int = 0) -> int:
        """The RNG key (signed int64) of the draw at position ``len(history) + ahead``: a function
        of (seed, position) only (:func:`~monobatch.engine.sampler_stages.row_key`)."""
        return st.to_signed64(st.row_key(self.seed, len(self.history) + ahead))

    @property
    def generated(self) -> list[int]:
        """The generated token ids (history after the prompt)."""
        return self.history[self.num_prompt_tokens:]

    def accept(self, token_id: int) -> None:
        """Push the token just chosen; update the penalty counts, DRY state and the grammar
        matcher incrementally."""
        t = int(token_id)
        self.history.append(t)
        if self.grammar is not None:
            self.grammar.accept(t)
        n = self._repeat_window
        if n is not None:
            self.repeat_counts[t] = self.repeat_counts.get(t, 0) + 1
            if 0 < n < len(self.history):
                old = self.history[-n - 1]
                self.repeat_counts[old] -= 1
                if self.repeat_counts[old] == 0:
                    del self.repeat_counts[old]
        if self._count_generated:
            self.generated_counts[t] = self.generated_counts.get(t, 0) + 1
        if self.dry is not None:
            self.dry.accept(t)


def ids_on(values: Sequence[int] | np.ndarray, device: torch.device) -> torch.Tensor:
    """``values`` as a ``[n]`` int64 tensor on ``device``: one page-locked, non-blocking copy on
    CUDA (nothing waits for the stream; a pageable ``torch.tensor(..., device=)`` would)."""
    t = torch.from_numpy(np.asarray(values, dtype=np.int64))
    return t if device.type == "cpu" else t.pin_memory().to(device, non_blocking=True)


def _entries(row: int, counts: dict[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    # (rows, token ids, counts) of one row's sparse table
    n = len(counts)
    return (np.full(n, row, np.int64), np.fromiter(counts.keys(), np.int64, n),
            np.fromiter(counts.values(), np.float64, n))


def _cat(parts: list, dtype: type) -> np.ndarray:
    return np.concatenate(parts).astype(dtype) if parts else np.zeros(0, dtype)


def _mass(p: float) -> float:
    # a typical_p / top_p mass; 1 (off) becomes inf, which keeps every token without a mask
    return p if p < 1.0 else math.inf


#: Sampled rows go in one of three groups: "plain" (no top_k/typical_p/top_p: the draw runs over
#: the whole vocabulary), "topk" (a top_k <= TOPK_FAST: filters and draw run on the top_k
#: candidates from torch.topk), "sort" (the rest: one full descending sort).
GROUPS = ("plain", "topk", "sort")
TOPK_FAST = 1024
_PER_ROW_INTS = ("rows", "keys", "top_k")
_PER_ROW_FLTS = ("temp", "log_min_p", "typical", "top_p")
#: A refused greedy draw is redrawn from this many best tokens, checked one by one against the
#: grammar, before a full mask is computed (:meth:`RowSampler.correct`).
REDRAW_CANDIDATES = 16


class _Plan:
    """Host side of one step: which rows use which stage, with their parameters.

    Everything is collected into numpy arrays on the host and sent to the logits' device in ONE
    copy (pinned, non-blocking on CUDA), so the step has no host sync before the final
    ``.tolist()``. Stage choices (which stages run, the top-k width) are read from the host
    arrays, never from the device. ``ahead``: tokens drawn but not yet accepted (async
    scheduling draws position ``len(history) + ahead``; only for :meth:`SamplerState.history_free`
    states).
    """

    def __init__(self, states: list[SamplerState], vocab_size: int, ahead: int = 0) -> None:
        ints: dict[str, list] = {k: [] for k in (
            "mask_rows", "mask", "bias_rows", "bias_cols", "rep_rows", "rep_cols", "add_rows", "add_cols", "lp_rows",
            *(f"{g}_{k}" for g in GROUPS for k in _PER_ROW_INTS))}
        flts: dict[str, list] = {k: [] for k in (
            "bias", "rep", "add", *(f"{g}_{k}" for g in GROUPS for k in _PER_ROW_FLTS))}
        self.top_n: list[int | None] = []
        # 0. the grammar masks, computed here on the host: the step's forward is already queued,
        # so on CUDA this overlaps it
        # (a stopped matcher belongs to a sequence that just ended: its row is dropped, no mask)
        grammar_rows = [r for r, s in enumerate(states) if s.grammar is not None and not s.grammar.is_stopped]
        if grammar_rows:
            mask = fill_bitmasks([states[r].grammar for r in grammar_rows], vocab_size)  # (M, W) int32
            if mask.shape[1] % 2:
                mask = np.pad(mask, ((0, 0), (0, 1)))
            ints["mask_rows"].append(np.array(grammar_rows, np.int64))
            ints["mask"].append(mask.view(np.int64).ravel())
        self.mask_words = mask.shape[1] if grammar_rows else 0
        # sampled rows by group: row indices, seed mixes and positions (the RNG keys, computed for
        # the whole group at once) and the fixed per-row values (SamplerState.draw_values)
        sampled: dict[str, tuple[list, list, list, list]] = {g: ([], [], [], []) for g in GROUPS}
        top_n = self.top_n
        for r, s in enumerate(states):
            p = s.params
            top_n.append(p.logprobs)
            if s.has_extras:  # logprobs, logit_bias, penalties or DRY: their entries (most rows have none)
                self._extras(r, s, p, ints, flts)
            if p.temperature == 0.0:
                continue  # greedy: the argmax of the penalised logits
            values = s.draw_values(vocab_size)
            rows, mixes, positions, vals = sampled[values[0]]
            rows.append(r)
            mixes.append(s.seed_mix)
            positions.append(len(s.history) + ahead)
            vals.append(values[1:])
        for g, (rows, mixes, positions, vals) in sampled.items():
            if not rows:
                continue
            table = np.array(vals, dtype=np.float64)  # (n, 5): top_k, then _PER_ROW_FLTS
            ints[f"{g}_rows"].append(np.array(rows, np.int64))
            ints[f"{g}_keys"].append(st.row_keys(np.array(mixes, np.uint64), np.array(positions, np.uint64)))
            ints[f"{g}_top_k"].append(table[:, 0].astype(np.int64))
            for j, k in enumerate(_PER_ROW_FLTS, 1):
                flts[f"{g}_{k}"].append(table[:, j])
        self.ints = {k: _cat(v, np.int64) for k, v in ints.items()}
        self.flts = {k: _cat(v, np.float64) for k, v in flts.items()}
        self.n = {k: len(v) for k, v in {**self.ints, **self.flts}.items()}
        if self.n["bias_cols"] and int(self.ints["bias_cols"].max()) >= vocab_size:
            raise ValueError(f"logit_bias token id outside the vocabulary (size {vocab_size}); "
                             "check requests with SamplingParams.check_vocab at admission")

    @staticmethod
    def _extras(r: int, s: SamplerState, p: SamplingParams, ints: dict[str, list], flts: dict[str, list]) -> None:
        """Row ``r``'s logprob request, logit_bias, penalty and DRY entries."""
        if p.logprobs is not None and p.logprobs > 0:
            ints["lp_rows"].append([r])
        if p.logit_bias:
            rows, cols, vals = _entries(r, p.logit_bias)  # values are float biases
            ints["bias_rows"].append(rows), ints["bias_cols"].append(cols)
            flts["bias"].append(vals)
        if s.repeat_counts:
            rows, cols, _ = _entries(r, s.repeat_counts)
            ints["rep_rows"].append(rows), ints["rep_cols"].append(cols)
            flts["rep"].append(np.full(len(rows), p.repeat_penalty))
        if s.generated_counts:  # presence/frequency, added after the repetition penalty
            rows, cols, cnt = _entries(r, s.generated_counts)
            ints["add_rows"].append(rows), ints["add_cols"].append(cols)
            flts["add"].append(st.presence_frequency_delta(
                cnt, p.presence_penalty, p.frequency_penalty))
        if s.dry is not None and s.dry.lengths:  # DRY, likewise
            rows, cols, lens = _entries(r, s.dry.lengths)
            ints["add_rows"].append(rows), ints["add_cols"].append(cols)
            flts["add"].append(st.dry_delta(
                lens, p.dry_multiplier, p.dry_base, p.dry_allowed_length))

    def uses(self, name: str) -> bool:
        """True when some row has entries in array ``name`` (the stage must run)."""
        return self.n[name] > 0

    def upload(self, device: torch.device) -> dict[str, torch.Tensor]:
        """All arrays as tensors on ``device``, from one int64 buffer (floats bit-cast)."""
        names = list(self.ints) + list(self.flts)
        parts = list(self.ints.values()) + [a.view(np.int64) for a in self.flts.values()]
        buf = torch.from_numpy(np.concatenate(parts))
        if device.type != "cpu":
            buf = buf.pin_memory().to(device, non_blocking=True)
        out, at = {}, 0
        for name, part in zip(names, parts):
            t = buf[at:at + len(part)]
            out[name] = t.view(torch.float64) if name in self.flts else t
            at += len(part)
        return out


@dataclass(slots=True)
class _Drawn:
    """One group of sampled rows after the chain: the draw's input."""

    rows: torch.Tensor  # (n,) int64 row indices into the batch
    z: torch.Tensor  # (n, C) float64 logits after filters and temperature (-inf: filtered out)
    ids: torch.Tensor | None  # (n, C) int64 token id of each column; None: column = token id
    keys: torch.Tensor  # (n,) int64 RNG keys


class RowSampler:
    """Samples one token per row of a logits batch, each row with its own settings and state.

    Rows with different settings share one call; a stage runs only on the rows that use it
    (an all-neutral batch costs a temperature division and the draw; an all-greedy neutral batch
    one argmax: :func:`monobatch.kernels.argmax.argmax`, torch's bits in one short launch on
    CUDA). Rows with top_k <= 1024 are filtered and drawn on their top_k candidates only,
    which is exact because the RNG is keyed by token id. Greedy (``temperature == 0``) is the
    argmax of the logits after logit_bias and the penalties, as in llama.cpp; the truncation
    filters are skipped for greedy rows. (llama.cpp runs typical_p before its temperature-0
    argmax, and typical_p can drop the argmax token; monobatch keeps greedy the plain argmax,
    which invariants 1-3 compare.)

    Args:
        vocab_size: the tokenizer's vocabulary size. Logit columns past it (a padded lm_head)
            are never drawn.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = int(vocab_size)

    def sample(self, logits: torch.Tensor, states: list[SamplerState],
               model_logits: torch.Tensor | None = None) -> SampleOutput:
        """Draw one token per row. Does not mutate ``states`` (``accept`` is separate).

        Args:
            logits: (R, V) float (float32, bf16 or fp16; CPU or CUDA), V >= vocab_size; row r
                belongs to ``states[r]``.
            states: R sampler states.
            model_logits: the model's logits when ``logits`` carries engine-side masks
                (min_tokens/ignore_eos); logprobs are taken from these. Default: ``logits``.
        Returns:
            :class:`SampleOutput`. Logprobs, when asked, are the MODEL's distribution
            (``log_softmax`` of the raw logits, before bias, penalties, filters and temperature),
            as OpenAI's ``logprobs`` are.
        Raises:
            ValueError: shapes disagree, or a logit_bias id is outside the vocabulary.
        """
        if self._check_shapes(logits, states) == 0:
            return SampleOutput([], None, None)
        tok, plan, t = self._draw(logits, states, 0)
        if plan is None or all(n is None for n in plan.top_n):
            return SampleOutput(tok.tolist(), None, None)
        return self._with_logprobs(logits if model_logits is None else model_logits, tok, plan, t)

    def draw(self, logits: torch.Tensor, states: list[SamplerState], ahead: int = 0,
             unchecked: bool = False) -> torch.Tensor:
        """The draws of :meth:`sample` as a device tensor, with no host sync (async scheduling:
        the next step's input). For :attr:`SamplerState.history_free` states with ``ahead`` >= 0,
        and for :attr:`SamplerState.grammar_only` ones whose every token is accepted (``ahead``
        0: the deferred draw).

        Args:
            logits: (R, V) as :meth:`sample`.
            states: R sampler states.
            ahead: tokens drawn for these rows but not accepted yet; the draw is position
                ``len(history) + ahead``, as :meth:`sample` will see it once they are.
            unchecked: every state is plain greedy or :attr:`SamplerState.greedy_checked`, and
                the grammar rows' draws are the raw argmax, not yet checked against their
                grammars (their previous tokens may not be accepted yet): the caller checks
                them with :meth:`correct` once they are.

        Returns:
            ``[R]`` int64 token ids on ``logits.device``.

        Raises:
            ValueError: ``unchecked`` with a state that is neither plain greedy nor greedy-checked.
        """
        self._check_shapes(logits, states)
        if unchecked:
            if not all(s.argmax_draw for s in states):
                raise ValueError("an unchecked draw needs greedy rows whose only stage is a grammar")
            return argmax(self._raw(logits, copy=False))
        return self._draw(logits, states, ahead)[0]

    def _draw(self, logits: torch.Tensor, states: list[SamplerState], ahead: int
              ) -> tuple[torch.Tensor, _Plan | None, dict[str, torch.Tensor] | None]:
        """The chain and the draw: ``[R]`` int64 token ids on the logits' device, with the plan
        and its uploaded tensors (None for an all plain-greedy batch) for logprobs."""
        if all(s.plain_greedy for s in states):  # the common case: one argmax, no plan to upload
            return argmax(self._raw(logits, copy=False)), None, None
        if all(s.argmax_draw for s in states):  # the best token first, masks only where refused
            return self._greedy_checked(logits, states), None, None
        R = logits.shape[0]
        plan = _Plan(states, self.vocab_size, ahead)
        t = plan.upload(logits.device)
        x, groups = self._chain(logits, plan, t)
        greedy = R - sum(g.rows.shape[0] for g in groups)
        tok = argmax(x) if greedy else torch.empty(R, dtype=torch.int64, device=x.device)
        for g in groups:
            drawn = st.gumbel_argmax(g.z, g.keys, g.ids)
            tok = drawn if g.rows.shape[0] == R else tok.index_copy_(0, g.rows, drawn)
        return tok, plan, t

    def _greedy_checked(self, logits: torch.Tensor, states: list[SamplerState]) -> torch.Tensor:
        """Greedy draws of rows that need no stage but the grammar mask, checked first
        (llama.cpp's common_sampler_sample: try the sampled token against the grammar, fall back
        to the full mask only when it is refused; see :meth:`correct`). Costs one device-to-host
        read of the argmax (the draw is not left on the device alone).

        Returns:
            ``[R]`` int64 token ids on the logits' device.
        """
        x = self._raw(logits, copy=False)
        first = argmax(x)
        if not any(s.grammar is not None and not s.grammar.is_stopped for s in states):
            return first
        picks = first.tolist()  # the one sync
        fixed = self.correct(x, states, picks)
        if not fixed:
            return first
        for r, t in fixed.items():
            picks[r] = t
        return torch.tensor(picks, dtype=torch.int64, device=x.device)

    def correct(self, logits: torch.Tensor, states: list[SamplerState], picks: list[int],
                rows: list[int] | None = None, only: set[int] | None = None, advance: bool = False
                ) -> dict[int, int]:
        """Check greedy picks against their grammars; redraw the refused ones: the best token the
        grammar accepts (the argmax with every token it refuses at ``-inf``).

        That is the raw argmax whenever the grammar accepts that token (the argmax is the first
        maximum), so an accepted pick is already the draw, and a refused one is replaced by the
        best accepted token: the result equals filtering every row first. At a forced position
        (:meth:`GrammarMatcher.forced_ids`) it is the best of the few accepted tokens there;
        elsewhere it is found among the row's best tokens first (:meth:`_best_allowed`: checks,
        no mask), and from the full mask only where none of them is accepted (away from forced
        positions the mask and the check agree; ADR 0004). Most steps of a JSON answer then compute
        no mask (llguidance's masks cost ~15 µs median, with p99 spikes of 0.2-0.3 ms, and over
        1 ms inside a string; a check costs ~2 µs).

        Args:
            logits: ``(M, V)`` raw logits (float32 or the model's dtype); row i belongs to
                ``states[rows[i]]`` (to ``states[i]`` when ``rows`` is None).
            states: the sampler states, their grammars at the position the picks are drawn
                for (every earlier token accepted).
            picks: each state's draw to check, indexed like ``states``: the row's raw argmax, or
                a forced position's early redraw (:meth:`forced_draws`, checked here like a raw argmax).
            rows: which states ``logits`` holds (default: all of them, in order).
            only: check just these state indices (default: every state in ``rows``).
            advance: advance each grammar past its pick where it is allowed (the check and the
                advance in one call, :meth:`GrammarMatcher.advance_if_allowed`): the caller then
                accepts exactly those picks, and the returned redraws, next (the finish step).

        Returns:
            state index -> its redraw, for each refused pick (empty when none is). Refusals cost
            one ``topk`` (a gather at forced positions) and a device-to-host read on the current
            stream (which may be a side stream: nothing here uses a per-device workspace), plus a
            mask and a second read for rows whose candidates are all refused.
        """
        refused = self.check_picks(states, picks, rows, only, advance)
        return self.redraw(logits, states, picks, rows, refused) if refused else {}

    @staticmethod
    def check_picks(states: list[SamplerState], picks: list[int], rows: list[int] | None = None,
                    only: set[int] | None = None, advance: bool = False) -> list[int]:
        """:meth:`correct`'s host half: check each pick against its grammar (``advance``: and
        advance past it where allowed); no device work.

        Returns:
            The refused picks' positions in ``rows`` (the logits' rows), ascending.
        """
        which = range(len(states)) if rows is None else rows
        refused = []
        for i, r in enumerate(which):
            if only is not None and r not in only:
                continue
            g = states[r].grammar
            if g is None or g.is_stopped:
                continue
            if not (g.advance_if_allowed(picks[r]) if advance else g.allows(picks[r])):
                refused.append(i)
        return refused

    def redraw(self, logits: torch.Tensor, states: list[SamplerState], picks: list[int],
               rows: list[int] | None, refused: list[int]) -> dict[int, int]:
        """:meth:`correct`'s device half: the redraws of the ``refused`` positions (from
        :meth:`check_picks`), as state index -> token."""
        which = range(len(states)) if rows is None else rows
        out: dict[int, int] = {}
        forced = [(i, ids) for i in refused if (ids := states[which[i]].grammar.forced_ids()) is not None]
        if forced:  # at a forced position: the best of the few tokens the grammar accepts there
            _, drawn = self._argmax_among(logits, [i for i, _ in forced], [ids for _, ids in forced])
            out = {which[i]: t for (i, _), t in zip(forced, drawn.tolist())}
            refused = [i for i in refused if which[i] not in out]
            if not refused:
                return out
        sub = logits if len(refused) == logits.shape[0] else logits.index_select(0, ids_on(refused, logits.device))
        fixed = self._best_allowed(sub, [states[which[i]] for i in refused], [picks[which[i]] for i in refused])
        rest = [j for j, t in enumerate(fixed) if t is None]
        if rest:  # no allowed token among the candidates: the full mask
            # torch's argmax, not kernels.argmax: the redraw may run on a side stream beside a step's
            # own argmax, whose split counters are one per device; the result is the same by
            # definition (the first index of the maximum)
            part = sub if len(rest) == sub.shape[0] else sub.index_select(0, ids_on(rest, sub.device))
            for j, t in zip(rest, self._masked(part, [states[which[refused[j]]] for j in rest]).argmax(-1).tolist()):
                fixed[j] = t
        return out | {which[i]: t for i, t in zip(refused, fixed)}

    def _best_allowed(self, logits: torch.Tensor, states: list[SamplerState], refused: list[int]) -> list[int | None]:
        """Each row's masked argmax found among its :data:`REDRAW_CANDIDATES` best tokens, without a
        mask: the candidates are checked against the grammar in the argmax's order (value
        descending, then id ascending); None where none of them is allowed.

        Exact: every token whose logit is above the last candidate's is a candidate, so the first
        allowed one among those is the first maximum of the masked row; the last candidate's
        value may tie tokens outside the set, so a row whose only allowed candidates have that
        value gets None (the caller masks it). One ``topk`` and one device-to-host read for all rows;
        a grammar check costs ~2 µs where a mask costs 15 µs to over 1 ms (a string's mask).
        """
        k = min(REDRAW_CANDIDATES + 1, self.vocab_size)
        vals, ids = self._raw(logits, copy=False).topk(k, dim=-1)
        if self.vocab_size > 1 << 24:  # ids exact in float32 below 2 ** 24 (two launches fewer than float64)
            vals = vals.double()
        both = torch.stack((vals, ids.to(vals.dtype))).tolist()  # the one sync: [values, ids] x rows x k
        out: list[int | None] = []
        for s, bad, v, t in zip(states, refused, both[0], both[1]):
            floor = v[-1]
            best = None
            for _, tok in sorted((-x, int(i)) for x, i in zip(v, t) if x > floor):
                if tok != bad and s.grammar.allows(tok):
                    best = tok
                    break
            out.append(best)
        return out

    def forced_draws(self, logits: torch.Tensor, states: list[SamplerState], rows: list[int],
                     only: set[int]) -> tuple[list[int], torch.Tensor, torch.Tensor] | None:
        """The greedy draws of the rows whose grammar forces its next bytes, drawn among the few
        tokens the grammar may accept there (:meth:`GrammarMatcher.forced_candidates`: the splits of
        the forced bytes and the tokens extending them, unchecked) — for async scheduling's
        unchecked draws, whose raw argmax is refused mostly at such positions.

        Exact where the grammar accepts the pick, which the caller checks as it checks any
        unchecked draw (:meth:`correct`): the candidates hold every token the grammar accepts
        there, so an accepted first maximum over them (ascending ids) is the first maximum over
        the accepted tokens, the draw :meth:`correct` and the synchronous loop make; a refused one
        is redrawn by :meth:`correct` like a refused raw argmax. The candidates are not checked
        here (2026-12-03): one llguidance call a row (its forced bytes), where checking each
        candidate cost ~4 calls a forced row; on the bundled model's JSON no more picks were refused
        for it. Costs one host-to-device copy; a gather and an argmax on the device only where a
        row has several candidates. Nothing waits for the device.

        Args:
            logits: ``(M, V)`` float32 raw logits; row i belongs to ``states[rows[i]]``.
            states: the sampler states, their grammars at the position the logits draw (every
                earlier token accepted).
            rows: which states ``logits`` holds.
            only: the state indices to consider.

        Returns:
            ``(state indices, the same as a [k] int64 tensor on the logits' device, [k] int64
            draws there)``, or None when no row is forced.
        """
        local, picked, allowed = [], [], []
        single = True
        for i, r in enumerate(rows):
            if r not in only:
                continue
            g = states[r].grammar
            if g is None or (ids := g.forced_candidates()) is None:
                continue
            local.append(i), picked.append(r), allowed.append(ids)
            single = single and len(ids) == 1
        if not picked:
            return None
        k = len(picked)
        if single:  # each row's one candidate: known on the host, uploaded with the row indices
            buf = ids_on(picked + [int(ids[0]) for ids in allowed], logits.device)
            return picked, buf[:k], buf[k:]
        at, ids = self._argmax_among(logits, local, allowed, picked)
        return picked, at, ids

    @staticmethod
    def _argmax_among(logits: torch.Tensor, local: list[int], allowed: list[np.ndarray],
                      tags: list[int] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """Each listed row's argmax over its allowed ids (ascending: ties go to the lowest id, as
        an argmax over the whole row with the others at -inf). One host-to-device copy (the
        ``tags`` riding along, the ids padded with each row's lowest id, and their flat positions
        in ``logits``), then one ``take`` of just those logits (no row is copied whole), an argmax
        and a gather.

        Returns:
            (``tags`` as an int64 tensor, the ``[k]`` int64 draws), on the logits' device.
        """
        k, n, width = len(local), len(tags), max(len(ids) for ids in allowed)
        table = np.empty((2, k, width), dtype=np.int64)  # [0]: the ids, [1]: their flat positions
        for j, ids in enumerate(allowed):
            table[0, j, :len(ids)] = ids
            table[0, j, len(ids):] = ids[0]
        np.add(table[0], np.array(local, np.int64)[:, None] * logits.shape[1], out=table[1])
        buf = ids_on(np.concatenate([np.array(tags, np.int64), table.ravel()]), logits.device)
        cols = buf[n:n + k * width].view(k, width)
        vals = logits.take(buf[n + k * width:]).view(k, width)  # take indexes the row-major flattening
        return buf[:n], cols.gather(1, vals.argmax(dim=1, keepdim=True)).squeeze(1)

    def _masked(self, logits: torch.Tensor, states: list[SamplerState]) -> torch.Tensor:
        """The raw logits with each live grammar's mask applied (stage 0 alone, for rows that
        need nothing else): the bitmasks and their row indices go to the device in one copy."""
        x = self._raw(logits, copy=True)
        rows = [r for r, s in enumerate(states) if s.grammar is not None and not s.grammar.is_stopped]
        if not rows:
            return x
        mask = fill_bitmasks([states[r].grammar for r in rows], self.vocab_size)  # (M, W) int32
        every = len(rows) == len(states)
        buf = torch.from_numpy(mask.ravel() if every else np.concatenate([np.array(rows, np.int32), mask.ravel()]))
        if x.device.type != "cpu":
            buf = buf.pin_memory().to(x.device, non_blocking=True)
        head = 0 if every else len(rows)
        row_t = None if every else buf[:head].long()
        return apply_bitmask(x, row_t, buf[head:].view(len(rows), mask.shape[1]))

    def transform(self, logits: torch.Tensor, states: list[SamplerState]) -> torch.Tensor:
        """The logits each row's draw sees, for tests and the parity report.

        Returns:
            (R, V) float64: for greedy rows the logits after logit_bias and the penalties; for
            sampled rows after every filter and the temperature (``-inf`` = filtered out).
        """
        self._check_shapes(logits, states)
        plan = _Plan(states, self.vocab_size)
        t = plan.upload(logits.device)
        x, groups = self._chain(logits, plan, t)
        out = x.double()
        for g in groups:
            if g.ids is None:
                out[g.rows] = g.z
            else:  # candidates back to token order
                full = torch.full((g.z.shape[0], out.shape[1]), st.NEG_INF, dtype=out.dtype,
                                  device=out.device)
                out[g.rows] = full.scatter_(1, g.ids, g.z)
        return out

    def draw_scores(self, logits: torch.Tensor, states: list[SamplerState]) -> torch.Tensor:
        """The scores whose argmax each row's draw is, for the parity report's draw margin (the
        gap between a row's two best scores: how near its draw was to another token).

        A greedy row's scores are :meth:`transform`'s logits (the draw: their first maximum).
        A sampled row's are the Gumbel-perturbed logits its draw takes the argmax of,
        ``z - log(-log u)`` (:func:`~monobatch.engine.sampler_stages.gumbel_argmax`), with ``z``
        :meth:`transform`'s row and ``u`` the row's uniforms at key ``(seed, position =
        len(history))``: a seeded draw flips where two perturbed scores are near each other, which
        the raw logits' top-2 gap does not say.

        Args:
            logits: (R, V) raw logits (float32 or the model's dtype).
            states: R sampler states, each at the position its row draws.

        Returns:
            (R, V) float64 (``-inf``: a token the row cannot draw).

        Raises:
            ValueError: ``logits`` do not match ``states`` or the vocabulary.
        """
        out = self.transform(logits, states)
        sampled = [r for r, s in enumerate(states) if s.params.temperature != 0.0]
        if sampled:
            keys = torch.tensor([states[r].draw_key() for r in sampled], dtype=torch.int64, device=out.device)
            at = torch.tensor(sampled, device=out.device)
            out[at] = out[at] - st.gumbel_noise(keys, torch.arange(out.shape[1], device=out.device))
        return out

    def _check_shapes(self, logits: torch.Tensor, states: list[SamplerState]) -> int:
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(states)} states")
        if logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits have {logits.shape[1]} columns < vocab {self.vocab_size}")
        return logits.shape[0]

    def _raw(self, logits: torch.Tensor, copy: bool) -> torch.Tensor:
        # float32 logits, padded vocab columns masked out
        x = logits.to(torch.float32, copy=copy or logits.shape[1] > self.vocab_size)
        if x.shape[1] > self.vocab_size:
            x[:, self.vocab_size:] = st.NEG_INF
        return x

    def _chain(self, logits: torch.Tensor, plan: _Plan, t: dict[str, torch.Tensor]
               ) -> tuple[torch.Tensor, list[_Drawn]]:
        """Run the stages. Returns x, (R, V) float32 after bias and penalties (the greedy rows'
        argmax input), and the sampled rows' groups after filters and temperature."""
        x = self._raw(logits, copy=any(plan.uses(k) for k in ("mask_rows", "bias", "rep", "add")))
        # 0. the grammar mask on the raw logits (structured output; -inf for disallowed tokens)
        if plan.uses("mask_rows"):
            mask = t["mask"].view(torch.int32).view(plan.n["mask_rows"], plan.mask_words)
            apply_bitmask(x, t["mask_rows"], mask)
        # 1. logit_bias, 2. repetition penalty, 3+4. presence/frequency and DRY (additive, so
        # one scatter-add; their amounts were computed on the host)
        if plan.uses("bias"):
            st.apply_additive(x, t["bias_rows"], t["bias_cols"], t["bias"].float())
        if plan.uses("rep"):
            st.apply_repeat_penalty(x, t["rep_rows"], t["rep_cols"], t["rep"].float())
        if plan.uses("add"):
            st.apply_additive(x, t["add_rows"], t["add_cols"], t["add"].float())
        return x, [self._truncate(x, g, plan, t) for g in GROUPS if plan.uses(f"{g}_rows")]

    def _truncate(self, x: torch.Tensor, g: str, plan: _Plan, t: dict[str, torch.Tensor]
                  ) -> _Drawn:
        """5-8. top_k -> typical_p -> top_p -> min_p, then 9. temperature, for group ``g``."""
        rows = t[f"{g}_rows"]
        xg = x if plan.n[f"{g}_rows"] == x.shape[0] else x.index_select(0, rows)
        top_k = plan.ints[f"{g}_top_k"]
        ids = None
        if g == "topk":
            xg, ids = st.top_candidates(xg, int(top_k.max()))
        elif g == "sort":
            xg, ids = st.sort_desc(xg)
        if g != "plain":
            if (top_k > 0).any() and top_k.min() < xg.shape[1]:
                xg = st.top_k_sorted(xg, t[f"{g}_top_k"])
            if np.isfinite(plan.flts[f"{g}_typical"]).any():
                xg = st.typical_sorted(xg, t[f"{g}_typical"])
            if np.isfinite(plan.flts[f"{g}_top_p"]).any():
                xg = st.top_p_sorted(xg, t[f"{g}_top_p"])
        if np.isfinite(plan.flts[f"{g}_log_min_p"]).any():  # relative to the max left
            xg = st.apply_min_p(xg, t[f"{g}_log_min_p"])
        return _Drawn(rows, st.apply_temperature(xg, t[f"{g}_temp"]), ids, t[f"{g}_keys"])

    def _with_logprobs(self, logits: torch.Tensor, tok: torch.Tensor, plan: _Plan,
                       t: dict[str, torch.Tensor]) -> SampleOutput:
        R = tok.shape[0]
        lp = torch.log_softmax(self._raw(logits, copy=False), dim=-1)  # the model's distribution
        parts = [tok.double(), lp.gather(1, tok[:, None]).squeeze(1).double()]
        N = max((n or 0) for n in plan.top_n)
        if N > 0:
            top_v, top_i = lp.index_select(0, t["lp_rows"]).topk(N, dim=-1)
            parts += [top_i.double().flatten(), top_v.double().flatten()]
        flat = torch.cat(parts).tolist()  # the one device -> host sync
        ids, chosen = [int(v) for v in flat[:R]], flat[R:2 * R]
        L = plan.n["lp_rows"]
        top_ids, top_vals = flat[2 * R:2 * R + L * N], flat[2 * R + L * N:]
        tops: list[list[tuple[int, float]]] = [[] for _ in range(R)]
        for j, r in enumerate(plan.ints["lp_rows"].tolist()):
            n = plan.top_n[r]
            tops[r] = [(int(top_ids[j * N + i]), top_vals[j * N + i]) for i in range(n)]
        return SampleOutput(ids, chosen, tops)
