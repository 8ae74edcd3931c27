"""Per-request sampling and stopping parameters, checked once at construction.

Field names and sentinels follow llama.cpp's sampler knobs and the OpenAI API; see
docs/adr/0001-one-engine.md for the defaults and their precedence.
"""

from __future__ import annotations

import functools
import inspect
import math
import numbers
import os
import re
from dataclasses import dataclass, field, fields
from typing import Any, Mapping

from monobatch import defaults
from monobatch.engine.constraint import StructuredOutput
from monobatch.errors import InvalidRequestError


def _token_id_key(key: Any) -> int:
    """A logit_bias key: an int, or a string of ASCII digits (OpenAI's JSON keys).

    Raises:
        ValueError: anything else (``"5_0"``, ``" 5"``, ``"٥"``, ``True``).
    """
    if isinstance(key, bool):
        raise ValueError(key)
    if isinstance(key, numbers.Integral):
        return int(key)
    if isinstance(key, str) and re.fullmatch(r"-?[0-9]+", key):
        return int(key)
    raise ValueError(key)


def _check(ok: bool, param: str, message: str) -> None:
    if not ok:
        raise InvalidRequestError(f"{param}: {message}", param=param)


_INT_FIELDS = ("max_tokens", "top_k", "repeat_last_n", "dry_allowed_length", "dry_penalty_last_n", "seed",
               "min_tokens", "loop_window", "logprobs")
_FLOAT_FIELDS = ("temperature", "top_p", "min_p", "typical_p", "repeat_penalty", "presence_penalty",
                 "frequency_penalty", "dry_multiplier", "dry_base")
_KINDS: dict[str, type] = {**dict.fromkeys(_INT_FIELDS, int), **dict.fromkeys(_FLOAT_FIELDS, float),
                           "include_stop_str_in_output": bool, "ignore_eos": bool, "skip_special_tokens": bool,
                           "stop": list, "stop_token_ids": list, "dry_sequence_breakers": list, "logit_bias": dict}
_KIND_NAMES = {int: "an integer", float: "a number", bool: "a boolean", list: "a list", dict: "an object"}
#: Temperatures below this are greedy (temperature 0): ``logits / T`` in float64 overflows to
#: ``inf`` near 1e-307, and long before that the draw is the argmax anyway.
MIN_TEMPERATURE = 1e-30
_OPTIONAL = frozenset(["max_tokens", "seed", "logprobs", "structured"])
#: Other engines' names for our fields, taken wherever a field name is (``SamplingParams(...)``,
#: :func:`resolve_sampling`) as the HTTP API takes them (server/protocol.py): vLLM's and
#: transformers' ``repetition_penalty`` is llama.cpp's multiplicative ``repeat_penalty``.
ALIASES: dict[str, str] = {"repetition_penalty": "repeat_penalty"}


@dataclass(slots=True)
class SamplingParams:
    """How one request samples and when it stops.

    Sampling (applied in llama.cpp's order by :class:`monobatch.engine.sampler.RowSampler`):
    logit_bias -> repeat_penalty -> presence/frequency penalties -> DRY -> top_k -> typical_p ->
    top_p -> min_p -> temperature -> draw. ``temperature == 0`` is greedy (argmax); so is any temperature below
    :data:`MIN_TEMPERATURE` (1e-30), which is set to 0.

    Sentinels: ``top_k <= 0`` off (0 llama.cpp, -1 vLLM); ``top_p == 1``, ``typical_p == 1``,
    ``min_p == 0``, ``repeat_penalty == 1`` off; ``repeat_last_n`` / ``dry_penalty_last_n``: 0 off,
    -1 the whole context; ``max_tokens=None`` runs to EOS or the context end (llama.cpp ``-n -1``).
    ``seed=None`` draws a fresh per-request seed, so an unseeded request never disturbs the
    random stream of a seeded one; ``seed=-1`` is the same (llama.cpp's ``--seed -1`` and
    llama-server's request ``seed: -1``: random), and as a request field it overrides a
    server-wide ``--seed``.

    ``repetition_penalty`` (vLLM's name) is an alias of ``repeat_penalty``: the same multiplicative
    penalty; giving both with different values is an error, as in the HTTP API.

    Raises:
        InvalidRequestError: any field outside its documented range (the message names it), or
            a keyword that is not a field (the message lists the fields).
    """

    max_tokens: int | None = None
    temperature: float = defaults.SAMPLER_DEFAULTS["temperature"]
    top_k: int = defaults.SAMPLER_DEFAULTS["top_k"]
    top_p: float = defaults.SAMPLER_DEFAULTS["top_p"]
    min_p: float = defaults.SAMPLER_DEFAULTS["min_p"]
    typical_p: float = defaults.SAMPLER_DEFAULTS["typical_p"]
    repeat_penalty: float = defaults.SAMPLER_DEFAULTS["repeat_penalty"]
    repeat_last_n: int = defaults.SAMPLER_DEFAULTS["repeat_last_n"]
    presence_penalty: float = defaults.SAMPLER_DEFAULTS["presence_penalty"]
    frequency_penalty: float = defaults.SAMPLER_DEFAULTS["frequency_penalty"]
    dry_multiplier: float = defaults.SAMPLER_DEFAULTS["dry_multiplier"]
    dry_base: float = defaults.SAMPLER_DEFAULTS["dry_base"]
    dry_allowed_length: int = defaults.SAMPLER_DEFAULTS["dry_allowed_length"]
    dry_penalty_last_n: int = defaults.SAMPLER_DEFAULTS["dry_penalty_last_n"]
    dry_sequence_breakers: tuple[str, ...] = defaults.SAMPLER_DEFAULTS["dry_sequence_breakers"]
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    # -- stopping (applied by FinishStep) --
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    loop_window: int = 0  # 0 = off; see FinishStep.is_looping
    # -- structured output (a grammar mask, the sampler's first stage) --
    structured: StructuredOutput | None = None
    # -- output --
    logprobs: int | None = None  # top-N alternatives per generated token; None = none
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field and put it in its normal form (a stop string as a tuple, ``-1``
        sentinels as None, a temperature under :data:`MIN_TEMPERATURE` as greedy). Run at
        construction, and again by :class:`monobatch.LLM` when a request is submitted: fields
        may be assigned after construction, as vLLM's SamplingParams allows. Idempotent.

        Raises:
            InvalidRequestError: a field of the wrong type or out of its range, naming it."""
        self._check_types()
        self.stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)  # OpenAI: a string or a list
        self.stop_token_ids = tuple(self.stop_token_ids)
        _check(not isinstance(self.dry_sequence_breakers, str)
               and all(isinstance(b, str) and b for b in self.dry_sequence_breakers),
               "dry_sequence_breakers", "must be a list of non-empty strings")
        self.dry_sequence_breakers = tuple(self.dry_sequence_breakers)
        try:  # OpenAI sends string keys ("50256": -100); int() alone would read "5_0" or " 5" too
            self.logit_bias = {_token_id_key(k): float(v) for k, v in dict(self.logit_bias).items()}
        except (TypeError, ValueError):
            raise InvalidRequestError("logit_bias: keys must be integer token ids and values "
                                      "numbers", param="logit_bias") from None
        if self.max_tokens == -1:  # llama.cpp's -n -1
            self.max_tokens = None
        _check(self.max_tokens is None or self.max_tokens >= 0, "max_tokens", "must be >= 0 (or None/-1 for no limit)")
        for name in ("temperature", "top_p", "min_p", "typical_p", "repeat_penalty",
                     "presence_penalty", "frequency_penalty", "dry_multiplier", "dry_base"):
            _check(math.isfinite(getattr(self, name)), name, "must be a finite number")
        _check(self.temperature >= 0, "temperature", f"must be >= 0, got {self.temperature}")
        if self.temperature < MIN_TEMPERATURE:  # logits / T would overflow: greedy is what it means
            self.temperature = 0.0
        _check(self.top_k >= -1, "top_k", f"must be >= -1 (0 or -1 disables), got {self.top_k}")
        _check(0 <= self.top_p <= 1, "top_p", f"must be in [0, 1], got {self.top_p}")  # 0: the top token only
        _check(0 <= self.min_p <= 1, "min_p", f"must be in [0, 1], got {self.min_p}")
        _check(0 < self.typical_p <= 1, "typical_p", f"must be in (0, 1], got {self.typical_p}")
        _check(self.repeat_penalty > 0, "repeat_penalty", f"must be > 0, got {self.repeat_penalty}")
        _check(self.repeat_last_n >= -1, "repeat_last_n", f"must be >= -1, got {self.repeat_last_n}")
        _check(-2 <= self.presence_penalty <= 2, "presence_penalty",
               f"must be in [-2, 2] (OpenAI API), got {self.presence_penalty}")
        _check(-2 <= self.frequency_penalty <= 2, "frequency_penalty",
               f"must be in [-2, 2] (OpenAI API), got {self.frequency_penalty}")
        _check(self.dry_multiplier >= 0, "dry_multiplier", f"must be >= 0, got {self.dry_multiplier}")
        _check(self.dry_base >= 1, "dry_base", f"must be >= 1, got {self.dry_base}")
        _check(self.dry_allowed_length >= 0, "dry_allowed_length", f"must be >= 0, got {self.dry_allowed_length}")
        _check(self.dry_penalty_last_n >= -1, "dry_penalty_last_n", f"must be >= -1, got {self.dry_penalty_last_n}")
        for tok, bias in self.logit_bias.items():
            _check(tok >= 0, "logit_bias", f"token id {tok} is negative")
            _check(math.isfinite(bias) and -100 <= bias <= 100, "logit_bias",
                   f"bias {bias} for token {tok} must be in [-100, 100] (OpenAI API)")
        if self.seed == -1:  # llama.cpp's "random" (llama-cli --seed -1, llama-server's seed -1)
            self.seed = None
        _check(self.seed is None or 0 <= self.seed < 2**63, "seed",
               f"must be in [0, 2**63), or -1 for a random seed; got {self.seed}")
        _check(self.min_tokens >= 0, "min_tokens", f"must be >= 0, got {self.min_tokens}")
        _check(self.loop_window >= 0, "loop_window", "must be >= 0 (0 = off)")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", "stop strings must be non-empty strings")
        _check(self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs", f"must be in [0, 20], got {self.logprobs}")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               f"must not exceed max_tokens ({self.min_tokens} > {self.max_tokens})")

    def _check_types(self) -> None:
        """Refuse values of the wrong JSON type (``"10"``, ``true``, ``2.5`` for an integer) with
        the field's name, so a bad request is a 400 rather than a TypeError deep inside."""
        for f in fields(self):
            value, kind = getattr(self, f.name), _KINDS.get(f.name)
            if value is None and f.name in _OPTIONAL:
                continue
            if kind is int:
                ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
                if ok:
                    setattr(self, f.name, int(value))  # numpy ints too
            elif kind is float:
                ok = isinstance(value, numbers.Real) and not isinstance(value, bool)
                if ok:
                    setattr(self, f.name, float(value) if not isinstance(value, int) else value)
            elif kind is bool:
                ok = isinstance(value, bool)
            elif kind is list:
                ok = isinstance(value, (str, list, tuple)) if f.name == "stop" else isinstance(value, (list, tuple))
                if ok and f.name == "stop_token_ids":
                    _check(all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in value),
                           f.name, "list items must be integer token ids")
                    setattr(self, f.name, [int(t) for t in value])
            elif kind is dict:
                ok = isinstance(value, dict)
            elif f.name == "structured":
                _check(isinstance(value, StructuredOutput), f.name,
                       f"expected a StructuredOutput (monobatch.engine.constraint), got {type(value).__name__}")
                continue
            else:
                continue
            _check(ok, f.name, f"expected {_KIND_NAMES[kind]}, got {type(value).__name__} {value!r}")

    @property
    def greedy(self) -> bool:
        """True when the draw is an argmax (temperature 0)."""
        return self.temperature == 0.0

    def check_vocab(self, vocab_size: int) -> None:
        """Refuse token ids outside ``[0, vocab_size)`` in logit_bias and stop_token_ids.

        Raises:
            InvalidRequestError: naming the first offending id.
        """
        for tok in self.logit_bias:
            _check(tok < vocab_size, "logit_bias", f"token id {tok} is outside the vocabulary (size {vocab_size})")
        for tok in self.stop_token_ids:
            _check(0 <= tok < vocab_size, "stop_token_ids", f"token id {tok} is outside the vocabulary (size {vocab_size})")

    def effective_seed(self) -> int:
        """The seed the draw uses: ``seed`` or a fresh random one (never shared with a neighbour)."""
        return self.seed if self.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1


SAMPLING_FIELDS = frozenset(f.name for f in fields(SamplingParams))
_FIELD_ORDER = tuple(f.name for f in fields(SamplingParams))


def _unknown_field(name: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"{name}: unknown sampling parameter; SamplingParams takes {', '.join(_FIELD_ORDER)} "
        f"(and {', '.join(f'{a} for {c}' for a, c in ALIASES.items())})", param=name)


def _canonical(level: Mapping[str, Any], positional: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``level`` with each alias renamed to its field (a None alias is left out).

    ``positional``: fields already given positionally, which an alias may not contradict either.

    Raises:
        InvalidRequestError: an unknown name, or an alias and its field with different values.
    """
    out: dict[str, Any] = {}
    for key, value in level.items():
        if key not in SAMPLING_FIELDS and key not in ALIASES:
            raise _unknown_field(key)
        if key in ALIASES:
            continue
        out[key] = value
    for alias, name in ALIASES.items():
        value = level.get(alias)
        if value is None:
            continue
        given = {**(positional or {}), **out}.get(name)
        if given is not None and given != value:
            raise InvalidRequestError(f"{name}: conflicts with {alias} (give one)", param=name)
        if name not in (positional or {}):
            out[name] = value
    return out


_dataclass_init = SamplingParams.__init__


@functools.wraps(_dataclass_init)
def _init(self: SamplingParams, *args: Any, **kwargs: Any) -> None:
    """The dataclass's ``__init__`` behind the aliases, and an unknown keyword as an
    :class:`InvalidRequestError` listing the fields rather than Python's bare TypeError."""
    aliased = {a: ALIASES[a] for a in ALIASES if kwargs.get(a) is not None}
    kwargs = _canonical(kwargs, dict(zip(_FIELD_ORDER, args)))
    try:
        _dataclass_init(self, *args, **kwargs)
    except InvalidRequestError as err:  # name the field as the caller spelt it
        alias = next((a for a, name in aliased.items() if err.param == name), None)
        if alias is None:
            raise
        raise InvalidRequestError(f"{alias} (alias of {err.param}){str(err)[len(err.param):]}",
                                  param=alias) from None


_init.__signature__ = inspect.signature(_dataclass_init).replace(parameters=[
    *inspect.signature(_dataclass_init).parameters.values(),
    *(inspect.Parameter(a, inspect.Parameter.KEYWORD_ONLY, default=None, annotation="float | None")
      for a in ALIASES)])
SamplingParams.__init__ = _init  # type: ignore[method-assign]


def resolve_sampling(
    request: Mapping[str, Any] | None = None,
    flags: Mapping[str, Any] | None = None,
    generation_config: Mapping[str, Any] | None = None,
    *,
    entry_point: str = "generate",
) -> SamplingParams:
    """Build :class:`SamplingParams` with the documented precedence.

    request > flags (server or CLI) > the model's generation config > :mod:`monobatch.defaults`.
    Keys whose value is None at a level fall through to the next. ``max_tokens`` left unset at
    every level takes ``defaults.MAX_TOKENS_DEFAULT[entry_point]``; -1 means no limit.

    A level may use an alias of :data:`ALIASES` (``repetition_penalty``), as ``SamplingParams`` does.

    Raises:
        InvalidRequestError: an unknown field, an alias and its field with different values at
            one level, or a value out of range.
    """
    merged: dict[str, Any] = {}
    for level in (generation_config, flags, request):
        for key, value in _canonical(level or {}).items():
            if value is not None:
                merged[key] = value
    if "max_tokens" not in merged:
        merged["max_tokens"] = defaults.MAX_TOKENS_DEFAULT[entry_point]
    elif merged["max_tokens"] == -1:
        merged["max_tokens"] = None
    return SamplingParams(**merged)
