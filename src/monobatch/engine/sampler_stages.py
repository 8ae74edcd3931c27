"""RowSampler's stages: small batched logits -> logits functions, DRY's per-sequence matching,
and the counter-based RNG.

Every stage takes logits ``x`` of shape (R, V) float32 (the sampler's private copy, so stages may
work in place) plus per-row or per-entry parameters for exactly those rows, and returns logits of
the same shape; a filtered-out token becomes ``-inf``. :class:`~monobatch.engine.sampler.RowSampler`
calls a stage only on the rows that use it, so a neutral setting never touches a row.

Each formula is llama.cpp's (``src/llama-sampling.cpp``, the function named in each docstring),
including its edge cases with ``min_keep`` = 0 (common/sampling.cpp's default), which always keeps
at least the most likely token. Presence/frequency follow the OpenAI API.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Callable, Sequence

import numpy as np
import torch

if TYPE_CHECKING:
    from monobatch.engine.params import SamplingParams

NEG_INF = float("-inf")
M64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # SplitMix64's increment (Steele, Lea, Flood 2014)
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_FLOAT_MAX_LOG = 88.7228391  # llama.cpp DRY: ln(FLT_MAX), bounds the exponent


# -- penalties. Entries are (row, token) pairs. The amounts that do not depend on the logits
# (presence/frequency, DRY) are computed per sequence on the host from tiny arrays; the device
# only adds them, after the repetition penalty, which does depend on the logit.

def apply_additive(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                   delta: torch.Tensor) -> torch.Tensor:
    """``x[row, col] += delta`` per entry; entries on the same (row, col) add up.

    Used for logit_bias (llama_sampler_logit_bias; OpenAI ``logit_bias``) and for the
    deltas of :func:`presence_frequency_delta` and :func:`dry_delta`.

    Args:
        x: (R, V) float32 logits, changed in place.
        rows, cols: (E,) int64 entry coordinates. delta: (E,) float32.
    Returns:
        x.
    """
    return x.index_put_((rows, cols), delta, accumulate=True)


def apply_repeat_penalty(x: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
                         penalty: torch.Tensor) -> torch.Tensor:
    """Repetition penalty on the tokens present in a row's window (llama_sampler_penalties).

    A logit ``<= 0`` is multiplied by the penalty, a positive one divided by it (the usual fix of
    CTRL's divide-only rule, which would make negative logits more likely). Applied once per
    token, whatever its count. The results are kept finite (an infinite one becomes float32's
    largest, a NaN 0): a penalty that underflows float32 (``5e-324`` is 0 there) or overflows it
    would otherwise put inf or NaN into the softmax, and a grammar's mask could no longer decide
    the draw (a fuzzed request once ended in a 500 that way). Finite results are unchanged.

    Args:
        x: (R, V) float32, changed in place. rows, cols: (E,) int64, one entry per (row, token).
        penalty: (E,) float32 >= 0 (a positive float64 penalty may round to 0 or inf).
    Returns:
        x.
    """
    v = x[rows, cols]
    x[rows, cols] = torch.where(v <= 0, v * penalty, v / penalty).nan_to_num_()
    return x


def presence_frequency_delta(counts: np.ndarray, presence: float,
                             frequency: float) -> np.ndarray:
    """OpenAI's penalties as a logit delta: ``-(frequency * count + presence * (count > 0))``.

    ``counts`` are occurrences among the GENERATED tokens only (case P1; OpenAI API reference,
    "Parameter details": mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence).
    (E,) float64 in, (E,) float64 out.
    """
    return -(frequency * counts + presence * (counts > 0))


def dry_delta(match_len: np.ndarray, multiplier: float, base: float,
              allowed_length: int) -> np.ndarray:
    """DRY's penalty as a logit delta: ``-multiplier * base ** (match_len - allowed_length)``.

    llama_sampler_dry step 4: the exponent is clamped to ``int(88.72 / ln(base))`` when
    ``base > 1.000001``, so the power stays finite in float32. (E,) float64 in and out.
    """
    exponent = match_len - allowed_length
    if base > 1.000001:
        exponent = np.minimum(exponent, int(_FLOAT_MAX_LOG / math.log(base)))
    return -multiplier * np.power(float(base), exponent)


# -- DRY's host side: repeat lengths kept per sequence ------------------------------------

def _z_function(s: Sequence[int]) -> list[int]:
    # z[k] = length of the longest common prefix of s and s[k:] (z[0] = 0), O(len(s))
    n, z, lo, hi = len(s), [0] * len(s), 0, 0
    for k in range(1, n):
        if k < hi:
            z[k] = min(hi - k, z[k - lo])
        while k + z[k] < n and s[z[k]] == s[k + z[k]]:
            z[k] += 1
        if k + z[k] > hi:
            lo, hi = k, k + z[k]
    return z


class DryState:
    """DRY bookkeeping for one sequence (llama.cpp ``llama_sampler_dry``, from koboldcpp PR 982).

    Over the last ``dry_penalty_last_n`` tokens (-1: all), ``match[p]`` is the length of the
    longest suffix of the window that also ends at window position p (llama.cpp's Z-algorithm
    repeat counts, kept up to date in O(window) numpy per token). ``lengths`` maps each token
    that would extend a repeated suffix of at least ``allowed_length`` to its longest match.

    Sequence breakers are matched on the tokens' bytes, so a breaker split over several tokens
    counts too: the latest token where a breaker string ends bounds the match length (llama.cpp's
    ``rep_limit``), and a token whose bytes contain a breaker is never penalised (llama.cpp's
    single-token breakers). Without ``token_bytes`` breakers are ignored.

    Args:
        params: dry_penalty_last_n (> 0, or -1), dry_allowed_length, dry_sequence_breakers.
        history: prompt (+ generated) token ids so far.
        token_bytes: a token id's raw bytes, or None.
    Attributes:
        lengths: token id -> match length for the next position (``>= allowed_length``); the
            penalty is :func:`dry_penalty` of it.
    """

    __slots__ = ("window", "allowed", "breakers", "token_bytes", "start", "tokens", "match",
                 "last_breaker", "lengths", "_tail", "_maxlen", "_is_breaker")

    def __init__(self, params: SamplingParams, history: list[int],
                 token_bytes: Callable[[int], bytes] | None) -> None:
        self.window = params.dry_penalty_last_n
        self.allowed = params.dry_allowed_length
        self.token_bytes = token_bytes
        self.breakers = tuple(b.encode("utf-8") for b in params.dry_sequence_breakers
                              if b) if token_bytes is not None else ()
        self._maxlen = max(map(len, self.breakers), default=0)
        self._tail, self._is_breaker, self.last_breaker = b"", {}, -1
        n = len(history) if self.window < 0 else min(self.window, len(history))
        self.start = len(history) - n
        self.tokens = np.asarray(history[self.start:], dtype=np.int64)
        for i in range(self.start, len(history)):
            self._scan(i, history[i])
        self.match = np.asarray(_z_function(self.tokens[::-1].tolist())[::-1], dtype=np.int64)
        self._update_lengths()

    def accept(self, token: int) -> None:
        """Push the next token of the history."""
        self._scan(self.start + len(self.tokens), token)
        before = np.concatenate(([0], self.match[:-1]))  # match ending one position earlier
        self.match = np.append(np.where(self.tokens == token, before + 1, 0), 0)
        self.tokens = np.append(self.tokens, token)
        if 0 < self.window < len(self.tokens):
            self.tokens, self.match, self.start = self.tokens[1:], self.match[1:], self.start + 1
        self._update_lengths()

    def _scan(self, index: int, token: int) -> None:
        # record `index` if a breaker string ends inside this token's bytes
        if not self.breakers:
            return
        text = self._tail + self.token_bytes(token)
        cut = len(self._tail)
        if any(b in text[max(0, cut - len(b) + 1):] for b in self.breakers):
            self.last_breaker = index
        self._tail = text[-(self._maxlen - 1):] if self._maxlen > 1 else b""

    def _breaker_token(self, token: int) -> bool:
        if not self.breakers:
            return False
        if token not in self._is_breaker:
            data = self.token_bytes(token)
            self._is_breaker[token] = any(b in data for b in self.breakers)
        return self._is_breaker[token]

    def _update_lengths(self) -> None:
        self.lengths = {}
        n = len(self.tokens)
        if n <= self.allowed:
            return
        end = self.start + n - 1
        rep_limit = n if self.last_breaker < self.start else end - self.last_breaker
        if rep_limit < self.allowed:
            return
        count = np.minimum(np.minimum(self.match[:-1], np.arange(1, n)), rep_limit)
        hits = np.nonzero(count >= self.allowed)[0]
        for tok, m in zip(self.tokens[hits + 1].tolist(), count[hits].tolist()):
            if m > self.lengths.get(tok, -1) and not self._breaker_token(tok):
                self.lengths[tok] = m


# -- truncation filters: top_k -> typical_p -> top_p -> min_p on rows sorted once ------------

def sort_desc(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sort rows descending, stable (ties keep the lower token id first): (vals, ids), (R, V)."""
    return torch.sort(x, dim=-1, descending=True, stable=True)


def top_candidates(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` best tokens of each row, in :func:`sort_desc`'s order: (vals, ids), (R, k).

    A fast path for rows that all have a small top_k: ``torch.topk`` then a stable re-sort of
    the k candidates (value descending, id ascending), so ties inside the candidates order as
    in the full sort. Ties AT the k-th value may keep a different token than the full sort.
    """
    vals, ids = torch.topk(x, k, dim=-1, sorted=False)
    by_id = torch.argsort(ids, dim=-1)
    vals, ids = vals.gather(1, by_id), ids.gather(1, by_id)
    order = torch.sort(vals, dim=-1, descending=True, stable=True).indices
    return vals.gather(1, order), ids.gather(1, order)


def _exclusive_cumsum(q: torch.Tensor) -> torch.Tensor:
    # mass of the tokens ranked before each one: (R, V), column 0 is exactly 0
    return torch.nn.functional.pad(torch.cumsum(q, dim=-1)[:, :-1], (1, 0))


def top_k_sorted(vals: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """Keep the ``k`` best tokens of each row (llama_sampler_top_k; ``k <= 0`` keeps all).

    Exactly ``k`` survive, ties broken by the stable sort (llama.cpp's partial sort breaks them
    arbitrarily). Args: vals (R, C) sorted descending; k (R,) int64. Returns vals with -inf.
    """
    V = vals.shape[-1]
    k = torch.where(k > 0, k, V)
    pos = torch.arange(V, device=vals.device)
    return vals.masked_fill(pos >= k[:, None], NEG_INF)


def typical_sorted(vals: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Locally typical sampling (Meister et al. 2022; llama_sampler_typical).

    With ``q = softmax(vals)`` and entropy ``H = -sum q log q``, tokens are ranked by
    ``|-log q - H|`` ascending and kept until the running mass first exceeds ``p`` (that token
    included). The most likely token can be dropped.

    Args: vals (R, C) sorted descending; p (R,) float, ``inf`` for rows that do not use it.
    Returns vals (still sorted) with -inf.
    """
    logq = torch.log_softmax(vals, dim=-1)
    q = logq.exp()
    entropy = -torch.special.xlogy(q, q).sum(dim=-1, keepdim=True)
    shifted = (-logq - entropy).abs()  # -inf logits -> +inf, ranked last
    order = torch.sort(shifted, dim=-1, stable=True).indices
    mass_before = _exclusive_cumsum(q.gather(1, order))
    keep_ord = mass_before <= p[:, None]
    keep = torch.zeros_like(keep_ord).scatter_(1, order, keep_ord)
    return vals.masked_fill(~keep, NEG_INF)


def top_p_sorted(vals: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Nucleus sampling (Holtzman et al. 2020; llama_sampler_top_p).

    Keeps the most likely tokens until their mass first reaches ``>= p``, including the token
    that crosses the threshold, and always the most likely one left (llama.cpp's ``min_keep`` of
    1: ``p == 0`` keeps only it, as OpenAI's ``top_p: 0`` means). An earlier filter may have
    removed the first columns (typical_p can drop the most likely token, leaving its -inf in
    place): the one always kept is the first finite column, the only one with no mass before it
    besides the removed ones.

    Args: vals (R, C) sorted descending; p (R,) float, ``inf`` for rows that do not use it.
    Returns vals with -inf.
    """
    mass_before = _exclusive_cumsum(torch.softmax(vals, dim=-1))
    keep = (mass_before < p[:, None]) | (mass_before == 0)
    return vals.masked_fill(~keep, NEG_INF)


def apply_min_p(x: torch.Tensor, log_p: torch.Tensor) -> torch.Tensor:
    """Min-p (llama_sampler_min_p): keep tokens with ``prob >= p * max prob``.

    In logits: ``logit >= max_logit + ln p``, on the distribution the earlier filters left and
    before temperature. Args: x (R, C) any column order; log_p (R,) float, ``ln p``, ``-inf``
    for rows that do not use it. Returns x with -inf (a new tensor).
    """
    floor = x.amax(dim=-1, keepdim=True) + log_p.to(x.dtype)[:, None]
    return x.masked_fill(x < floor, NEG_INF)


def apply_temperature(x: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """``logits / T`` (llama_sampler_temp) in float64 for the draw. Args: x (R, C); T (R,) > 0."""
    return x.double() / temperature.double()[:, None]


# -- counter-based RNG and the draw ------------------------------------------------------------

def splitmix64(z: int) -> int:
    """SplitMix64's output function on a 64-bit state (exact Python ints; reference for tests)."""
    z = (z + GOLDEN) & M64
    z = ((z ^ (z >> 30)) * _MIX1) & M64
    z = ((z ^ (z >> 27)) * _MIX2) & M64
    return z ^ (z >> 31)


def row_key(seed: int, position: int) -> int:
    """The 64-bit key of one draw: a function of (seed, position) only, never of the batch."""
    return splitmix64((splitmix64(seed & M64) + position * GOLDEN) & M64)


def seed_mix(seed: int) -> int:
    """The seed's part of :func:`row_key` (``splitmix64(seed)``), fixed for a sequence."""
    return splitmix64(seed & M64)


def row_keys(mixes: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """:func:`row_key` of many draws at once, as signed int64 (:func:`to_signed64`'s view).

    Args:
        mixes: ``[n]`` uint64 :func:`seed_mix` of each draw's seed.
        positions: ``[n]`` uint64 positions.
    Returns:
        ``[n]`` int64, equal to ``to_signed64(row_key(seed, position))`` for each pair.
    """
    with np.errstate(over="ignore"):  # uint64 arithmetic wraps mod 2**64, as the & M64 above
        z = mixes + positions * np.uint64(GOLDEN) + np.uint64(GOLDEN)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(_MIX1)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(_MIX2)
        return (z ^ (z >> np.uint64(31))).view(np.int64)


def to_signed64(z: int) -> int:
    """Two's-complement view of an unsigned 64-bit int, for an int64 tensor."""
    return z - (1 << 64) if z >= (1 << 63) else z


def _srl(z: torch.Tensor, s: int) -> torch.Tensor:
    # logical right shift of int64 (torch's >> is arithmetic)
    return (z >> s) & ((1 << (64 - s)) - 1)


def counter_uniforms(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """Uniforms in (0, 1) per (row, token id), from the SplitMix64 stream seeded with each key.

    For token id j, ``z`` is the (j+1)-th SplitMix64 output from ``keys[r]`` (Steele et al.
    2014); its top 52 bits with the highest one flipped, m, give ``u = (m + 0.5) / 2**52``: exact
    in float64, never 0 or 1. The value depends on the token id, not on where the token sits in
    the tensor, so a draw over a candidate subset equals the draw over the whole vocabulary.
    Only integer ops (wrapping int64 multiply, shifts) precede the float conversion, so CPU and
    CUDA give bit-identical uniforms.

    Args:
        keys: (R,) int64, the signed view of :func:`row_key`.
        token_ids: (C,) or (R, C) int64 token ids.
    Returns:
        (R, C) float64.
    """
    z = keys[:, None] + (token_ids + 1) * to_signed64(GOLDEN)
    z ^= _srl(z, 30)
    z *= to_signed64(_MIX1)
    z ^= _srl(z, 27)
    z *= to_signed64(_MIX2)
    z ^= _srl(z, 31)
    # arithmetic >> 12, + 2**51: the top 52 bits with their top bit flipped, in [0, 2**52)
    return (z >> 12).double().add_(2.0 ** 51 + 0.5).mul_(2.0 ** -52)


def gumbel_noise(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """``log(-log u)`` per (row, token id), u from :func:`counter_uniforms`: a draw is the argmax
    of ``z - gumbel_noise`` (:func:`gumbel_argmax`; the parity report's draw scores).

    Args: keys (R,) int64; token_ids (C,) or (R, C) int64. Returns (R, C) float64.
    """
    return counter_uniforms(keys, token_ids).log_().neg_().log_()


def gumbel_argmax(z: torch.Tensor, keys: torch.Tensor,
                  token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Draw one token per row from ``softmax(z)`` by the Gumbel-max trick.

    ``argmax_j(z_j - log(-log u_j))`` is distributed as ``softmax(z)`` (Gumbel 1954; the
    exponential race ``argmax p_j / E_j``). Each row's draw depends only on its own logits and
    key, so batching and row order never change it.

    Args:
        z: (R, C) float64 final logits (``-inf`` never wins). keys: (R,) int64.
        token_ids: (R, C) int64 ids of z's columns (a candidate subset, any order); None when
            the columns are the vocabulary itself.
    Returns:
        (R,) int64 token ids.
    """
    ids = torch.arange(z.shape[-1], device=z.device) if token_ids is None else token_ids
    best = torch.argmax(z - gumbel_noise(keys, ids), dim=-1)
    return best if token_ids is None else token_ids.gather(1, best[:, None]).squeeze(1)
