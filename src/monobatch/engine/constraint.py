"""Structured output: a grammar that a sequence's tokens must follow, as one sampler stage.

A request may carry one :class:`StructuredOutput` (``SamplingParams.structured``): a JSON schema,
"any JSON object", a regular expression, a choice among strings, a GBNF grammar (llama.cpp's
format) or a Lark grammar (llguidance's, with ``%json`` for embedded schemas). The grammar
engine is llguidance (llama.cpp's and vLLM's ``guidance`` backend; the choice and its
measurements: docs/adr/0004-structured-outputs.md); nothing here parses a grammar itself.

The pieces, in the order a request meets them:

- :class:`GrammarCompiler` (one per tokenizer) turns a spec into a checked grammar, cached by
  ``(kind, value)``, off the engine thread and within :data:`COMPILE_TIMEOUT_S`; a bad spec is an
  ``InvalidRequestError`` naming the request field. Each sequence gets its own
  :class:`GrammarMatcher` (a copy of the cached one).
- :func:`fill_bitmasks` computes the allowed-token bitmasks of a step's constrained rows on the
  host (llguidance's thread pool, GIL released) — after the step's forward was queued, so on
  CUDA it overlaps the forward; :func:`apply_bitmask` sets every disallowed logit to ``-inf``
  on the device, before logit_bias and the rest of the llama.cpp chain
  (:class:`monobatch.engine.sampler.RowSampler`).
- ``SamplerState.accept`` advances the matcher; the finish step ends the sequence with ``stop``
  once the grammar has terminated (:attr:`GrammarMatcher.is_stopped`).

Bitmask layout (llguidance's and xgrammar's): ``[R, ceil(V / 32)]`` int32, bit ``t % 32`` of word
``t // 32`` set when token ``t`` is allowed.
"""

from __future__ import annotations

import bisect
import concurrent.futures
import json
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np

from monobatch.engine import regex_check
from monobatch.errors import InvalidRequestError, json_kind, require_utf8

if TYPE_CHECKING:  # torch is imported where a mask is applied: the CLI's parser imports this module
    import torch

    from monobatch.tokenizer import Tokenizer

#: The kinds a :class:`StructuredOutput` may have.
KINDS = ("json_schema", "json_object", "regex", "choice", "grammar", "lark")
#: Longest spec (schema JSON, regex, grammar text) accepted, in characters.
MAX_SPEC_CHARS = 64 * 1024
#: Longest tool-call grammar (``tools``: every tool's name and ``parameters`` schema) accepted, in
#: characters: an agent's tool set is larger than one schema (1,000 tools of 5 properties: ~770K
#: characters, compiled in ~0.3 s on a 2-core CPU; 2026-12-04).
MAX_TOOLS_SPEC_CHARS = 1024 * 1024
#: Longest a compile may take, seconds; past it the request is refused (the compile thread is
#: left to finish on its own; llguidance's own fuel limits bound it).
COMPILE_TIMEOUT_S = 5.0
#: Compiled grammars kept (least recently used dropped first).
CACHE_SIZE = 256
#: Characters of spec text the cache may hold in all (tool-call grammars reach 1 MiB each).
CACHE_CHARS = 16 * 1024 * 1024
#: JSON output shape: no free whitespace (a small model would pad forever), Python's separators.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """One output constraint.

    Attributes:
        kind: one of :data:`KINDS`.
        value: the spec as text: the schema's JSON (``json_schema``; ``"{}"`` for
            ``json_object``), the regex, a JSON list of strings (``choice``), the grammar text.
        param: the request field it came from, for error messages (``response_format``,
            ``structured_outputs.json``, ``--json-schema``, ...).
        max_chars: the longest ``value`` accepted (:data:`MAX_SPEC_CHARS`;
            :data:`MAX_TOOLS_SPEC_CHARS` for a tool-call grammar).
        parts: specs this one is built from, each naming its own field (a tool-call grammar's
            ``tools[i].function.parameters`` schemas): where this spec does not compile, the
            first part that does not compile alone is the error (its field named), else this
            spec's own. Not part of the cache key.
    """

    kind: str
    value: str
    param: str = "structured_outputs"
    max_chars: int = field(default=MAX_SPEC_CHARS, compare=False)
    parts: tuple["StructuredOutput", ...] = field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(f"{self.param}: unknown constraint kind {self.kind!r} (one of "
                                      f"{', '.join(KINDS)})", self.param)
        if not isinstance(self.value, str):
            raise InvalidRequestError(f"{self.param}: expected text, got {type(self.value).__name__}", self.param)
        if len(self.value) > self.max_chars:
            raise InvalidRequestError(f"{self.param}: the constraint has {len(self.value)} characters, more than "
                                      f"the limit of {self.max_chars}", self.param)
        require_utf8(self.value, self.param, f"{self.param}: the constraint")

    @classmethod
    def json_schema(cls, schema: Any, param: str = "json_schema") -> "StructuredOutput":
        """A JSON schema given as a dict, a bool or JSON text.

        Raises:
            InvalidRequestError: text that is not JSON, or a schema that is not an object/bool.
        """
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise InvalidRequestError(f"{param}: the schema is not valid JSON: {exc}", param) from None
        if isinstance(schema, bool):
            schema = {} if schema else {"not": {}}
        if not isinstance(schema, dict):
            raise InvalidRequestError(f"{param}: a JSON schema must be an object, got {json_kind(schema)}", param)
        check_exact_numbers(schema, param)
        try:
            text = json.dumps(schema, ensure_ascii=False)
        except (RecursionError, ValueError, TypeError) as exc:  # nested too deep, a cycle, a non-JSON value
            raise InvalidRequestError(f"{param}: the schema cannot be serialized as JSON ({type(exc).__name__})",
                                      param) from None
        return cls("json_schema", text, param)  # (its own checks: the size limit)

    @classmethod
    def json_object(cls, param: str = "response_format") -> "StructuredOutput":
        """Any JSON object (OpenAI's ``{"type": "json_object"}``)."""
        return cls("json_object", "{}", param)

    @classmethod
    def choice(cls, options: Sequence[str], param: str = "choice") -> "StructuredOutput":
        """Exactly one of ``options`` (vLLM's ``guided_choice``).

        Raises:
            InvalidRequestError: not a non-empty list of strings.
        """
        if isinstance(options, str) or not options or not all(isinstance(o, str) for o in options):
            raise InvalidRequestError(f"{param}: must be a non-empty list of strings", param)
        return cls("choice", json.dumps(list(options), ensure_ascii=False), param)

    @classmethod
    def regex(cls, pattern: str, param: str = "regex") -> "StructuredOutput":
        """Text matching ``pattern`` (Rust ``regex`` syntax, anchored at both ends)."""
        return cls("regex", pattern, param)

    @classmethod
    def grammar(cls, text: str, param: str = "grammar") -> "StructuredOutput":
        """Text matching a GBNF grammar (llama.cpp's grammars/README.md; a Lark grammar works too)."""
        return cls("grammar", text, param)

    def grammar_text(self) -> str:
        """The llguidance grammar for this spec (not yet checked).

        Raises:
            InvalidRequestError: a GBNF grammar that does not convert to Lark.
        """
        import llguidance

        matcher = llguidance.LLMatcher
        if self.kind in ("json_schema", "json_object"):
            schema = {"type": "object"} if self.kind == "json_object" else json.loads(self.value)
            return matcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return matcher.grammar_from_regex(self.value)
        if self.kind == "choice":
            return llguidance.grammar_from("choice", self.value)
        if self.kind == "lark":
            return matcher.grammar_from_lark(self.value)
        try:  # GBNF (llama.cpp's grammars/README.md); llguidance converts it to Lark
            return matcher.grammar_from_lark(llguidance.gbnf_to_lark.any_to_lark(_gbnf_escapes(self.value)))
        except Exception as exc:
            raise InvalidRequestError(f"{self.param}: the grammar does not parse: {exc}", self.param) from None


#: The largest integer a JSON schema's constraint may hold: llguidance reads a schema's numbers as
#: float64, exact up to 2**53 (a larger ``const`` or bound would be rounded: the output would break
#: the schema while the reply says ``stop``).
MAX_EXACT_INT = 2**53
#: Schema keywords whose values are documentation, not constraints (numbers there are never read).
_ANNOTATIONS = frozenset({"description", "title", "default", "examples", "$comment"})
#: Schema keywords whose values map names (of properties, definitions) to schemas.
_NAME_MAPS = frozenset({"properties", "patternProperties", "$defs", "definitions", "dependentSchemas"})


def check_exact_numbers(schema: Any, param: str) -> None:
    """Refuse a JSON schema holding an integer beyond ±:data:`MAX_EXACT_INT` outside annotations
    (``const``, ``enum``, ``minimum``, ...): the grammar engine would round it. An annotation is a
    keyword of a schema; a property named ``title`` is a schema like any other.

    Raises:
        InvalidRequestError: naming ``param`` and the number."""
    todo: list[tuple[Any, bool]] = [(schema, False)]  # (value, is it a map of names to schemas)
    while todo:  # a stack, not recursion: a schema may be nested past Python's recursion limit
        value, names = todo.pop()
        if isinstance(value, dict):
            for key, item in value.items():
                if names:
                    todo.append((item, False))
                elif key not in _ANNOTATIONS:
                    todo.append((item, key in _NAME_MAPS))
        elif isinstance(value, list):
            todo.extend((item, False) for item in value)
        elif isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_EXACT_INT:
            raise InvalidRequestError(f"{param}: the integer {value} cannot be constrained exactly (integers in a "
                                      f"schema's constraints must be within ±2**53 = ±{MAX_EXACT_INT})", param)


#: Forced positions whose candidate tokens (splits of the forced bytes, and tokens that extend
#: them) number more than this are left to the check alone (:meth:`GrammarMatcher.forced_ids`).
FORCED_MAX_TOKENS = 64
#: Forced byte strings whose candidate tokens :class:`TokenIndex` remembers (cleared when full).
CANDIDATE_CACHE = 4096


class TokenIndex:
    """A vocabulary's tokens by their bytes, for the tokens that spell the start of given bytes.

    Args:
        token_bytes: each token id's bytes (``Tokenizer.token_bytes``).
        vocab_size: ids ``0 .. vocab_size - 1`` are indexed.
    """

    def __init__(self, token_bytes: Any, vocab_size: int) -> None:
        pairs = sorted((token_bytes(t), t) for t in range(vocab_size))
        self._bytes = [b for b, _ in pairs]
        self._ids = [t for _, t in pairs]
        self._longest = max(map(len, self._bytes), default=0)
        self._by_bytes: dict[bytes, list[int]] = {}
        for b, t in pairs:
            if b:
                self._by_bytes.setdefault(b, []).append(t)
        # forced bytes -> (candidates(), candidate_array()): a grammar's forced bytes repeat (keys, separators)
        self._candidates: dict[bytes, tuple[tuple[list[int], list[int] | None], np.ndarray | None]] = {}
        # accepted id tuples -> one read-only array each (ids_array): the same sets recur every row and step
        self._arrays: dict[tuple[int, ...], np.ndarray] = {}

    def splits(self, forced: bytes) -> list[int]:
        """The tokens whose bytes are a proper, non-empty prefix of ``forced`` (at most the longest
        token's length of lookups, however long ``forced`` is: a schema's ``const`` may be 64 KiB)."""
        return [t for k in range(1, min(len(forced), self._longest + 1)) for t in self._by_bytes.get(forced[:k], ())]

    def extensions(self, forced: bytes, limit: int) -> list[int] | None:
        """The tokens whose bytes start with all of ``forced``, or None when more than ``limit``."""
        if limit < 0:
            return None
        out = []
        i = bisect.bisect_left(self._bytes, forced)
        while i < len(self._bytes) and self._bytes[i].startswith(forced):
            if len(out) == limit:
                return None
            out.append(self._ids[i])
            i += 1
        return out

    def candidates(self, forced: bytes) -> tuple[list[int], list[int] | None]:
        """``(splits(forced), extensions(forced, FORCED_MAX_TOKENS))``, remembered per ``forced``
        (at most :data:`CANDIDATE_CACHE` entries): both depend on the bytes alone, and a grammar's
        forced keys and separators come back every row and step (the lookups cost ~10 µs a forced
        position on this project's CPU, 2026-12-02)."""
        return self._lookup(forced)[0]

    def candidate_array(self, forced: bytes) -> np.ndarray | None:
        """Every token a grammar whose next bytes are ``forced`` may accept there, unchecked: the
        splits and extensions of :meth:`candidates`, as one ascending read-only ``[n]`` int64
        array; None where they number more than :data:`FORCED_MAX_TOKENS` (or none). Remembered
        with :meth:`candidates`' entry."""
        return self._lookup(forced)[1]

    def _lookup(self, forced: bytes) -> tuple[tuple[list[int], list[int] | None], np.ndarray | None]:
        # both look at the first longest + 1 bytes alone (no token is longer): a 64 KiB const
        # stays forced for thousands of positions, and must not make thousands of 64 KiB keys
        key = forced[:self._longest + 1]
        hit = self._candidates.get(key)
        if hit is None:
            if len(self._candidates) >= CANDIDATE_CACHE:
                self._candidates.clear()
            splits, ext = self.splits(key), self.extensions(key, FORCED_MAX_TOKENS)
            ids = None if ext is None or len(splits) + len(ext) > FORCED_MAX_TOKENS else sorted(set(splits + ext))
            arr = np.array(ids, dtype=np.int64) if ids else None
            if arr is not None:
                arr.flags.writeable = False
            hit = self._candidates[key] = ((splits, ext), arr)
        return hit

    def ids_array(self, ids: tuple[int, ...]) -> np.ndarray:
        """``ids`` as a read-only ``[n]`` int64 array, one per distinct tuple (at most
        :data:`CANDIDATE_CACHE` kept): a forced position's accepted ids recur every row and step,
        and building an array each time cost more than the lookup."""
        arr = self._arrays.get(ids)
        if arr is None:
            if len(self._arrays) >= CANDIDATE_CACHE:
                self._arrays.clear()
            arr = self._arrays[ids] = np.array(ids, dtype=np.int64)
            arr.flags.writeable = False
        return arr


class GrammarMatcher:
    """One sequence's position in its grammar (an llguidance ``LLMatcher``).

    ``accept`` a drawn token; :attr:`is_stopped` once the grammar has ended (it accepted an
    end-of-generation token, or nothing more can follow).

    The tokens a grammar accepts next are those llguidance's token check accepts
    (``validate_tokens``; :meth:`allows`). Where the grammar forces the next bytes (a key, a
    quote, a separator) the check accepts every split of them (`` {`` then ``"``, or `` {"``),
    while llguidance's mask leaves the shorter splits out (:meth:`splits`): there the accepted
    set is enumerated from the forced bytes (:meth:`forced_ids`), and :func:`fill_bitmasks` adds
    the splits to the mask; elsewhere the check and the mask agree (compared over ~300k tokens
    of 22 grammars' states; ADR 0004). So every draw — checked first, redrawn, masked, sampled —
    is over one set.
    """

    __slots__ = ("_m", "_ahead", "_index", "_forced", "_splits", "_stopped", "_cands", "_ff")

    def __init__(self, matcher: Any, index: TokenIndex) -> None:
        self._m = matcher
        self._index = index
        self._ahead: int | None = None  # a token :meth:`advance_if_allowed` consumed, not yet accepted
        self._forced: np.ndarray | bool | None = None  # forced_ids of this position (False: none; None: unknown)
        self._splits: list[int] = []  # splits() of this position, once _forced is known
        self._stopped: bool | None = None  # is_stopped of this position (None: not asked yet)
        self._cands: np.ndarray | bool | None = None  # forced_candidates of this position (False: none; None: unknown)
        self._ff: bytes | None = None  # llguidance's forced bytes of this position (None: not asked yet)

    @property
    def raw(self) -> Any:
        """The llguidance matcher (for :func:`fill_bitmasks`)."""
        return self._m

    def accept(self, token_id: int) -> bool:
        """Advance past ``token_id``; False when the grammar did not allow it (the matcher is then
        in an error state: :attr:`is_stopped` is True). After :meth:`advance_if_allowed` of the
        same token this only confirms it (another token first rolls that one back)."""
        t = int(token_id)
        if self._ahead is not None:
            ahead, self._ahead = self._ahead, None
            if ahead == t:
                return True
            self._m.rollback(1)
        self._forced = self._stopped = self._cands = self._ff = None
        # the check and the advance in one call first: llguidance's consume_token walks an unchecked
        # token the slow way (5-60 µs on this project's CPU, 2026-12-03, against ~2 µs), to the same
        # state; a refused token goes through consume_token, which leaves the error state as before
        return self._m.try_consume_tokens([t]) == 1 or bool(self._m.consume_token(t))

    def advance_if_allowed(self, token_id: int) -> bool:
        """:meth:`allows` and, when it does, the advance, in one llguidance call (~30 % less than
        the check and the advance apart): the caller must :meth:`accept` the same token next,
        which then costs nothing (async scheduling's check of an unchecked draw, right before the
        finish step accepts it). False (the matcher unchanged) when the token is refused."""
        if self._ahead is not None:
            raise RuntimeError("advance_if_allowed: the token advanced past before is not accepted yet")
        t = int(token_id)
        if self._m.try_consume_tokens([t]) != 1:
            self._stopped = None  # a refusal may be a resource limit: is_stopped (and failed) ask again
            return False
        self._ahead, self._forced, self._stopped, self._cands, self._ff = t, None, None, None, None
        return True

    def allows(self, token_id: int) -> bool:
        """Whether ``token_id`` may come next (the matcher is not advanced)."""
        self._stopped = None  # a check may hit a resource limit: is_stopped (and failed) ask again
        return self._m.validate_tokens([int(token_id)]) == 1

    def forced_ids(self) -> np.ndarray | None:
        """Where the grammar forces the next bytes (llguidance's forced bytes, ~0.2 µs to ask),
        every token it accepts there: ``[n]`` int64, ascending (the splits of the forced bytes
        and the tokens that extend them, each checked; a few µs; kept until the matcher moves;
        read-only, shared by every position with the same set: :meth:`TokenIndex.ids_array`).
        None elsewhere, or where the accepted splits and the (unchecked) extensions number more
        than :data:`FORCED_MAX_TOKENS`. Such positions are where a greedy model's raw argmax is
        refused (on the bundled model, 91 % of refusals, at a median of one allowed token)."""
        forced = self._forced
        if forced is None:
            forced = self._forced_position()
        return None if forced is False else forced

    def forced_candidates(self) -> np.ndarray | None:
        """Where the grammar forces the next bytes, the tokens it may accept there, unchecked: every
        split of the forced bytes and every token extending them (:meth:`TokenIndex.candidate_array`;
        a superset of :meth:`forced_ids`, shared and read-only; kept until the matcher moves). None
        elsewhere, or where they number more than :data:`FORCED_MAX_TOKENS`. Two or three llguidance
        calls (``is_stopped`` unless known, the forced bytes, ``is_stopped`` again), no token checks:
        for async scheduling's early redraw
        (:meth:`RowSampler.forced_draws`), whose pick the check accepts only if it is the best
        accepted token (a superset's best that the grammar accepts is the best it accepts) and
        corrects otherwise."""
        cands = self._cands
        if cands is None:
            cands = False
            m = self._m
            if not (self._stopped if self._stopped is not None else m.is_stopped()):
                forced = self._ff = m.compute_ff_bytes()
                if forced:
                    arr = self._index.candidate_array(forced)
                    cands = False if arr is None else arr
                self._stopped = bool(m.is_stopped())  # (compute_ff_bytes may hit a resource limit)
            else:
                self._stopped = True
            self._cands = cands
        return None if cands is False else cands

    def splits(self) -> list[int]:
        """At a forced position, the splits of the forced bytes the check accepts (`` {`` and
        `` {"`` of a forced `` {"name``): a superset of the accepted tokens llguidance's mask leaves
        out; elsewhere none. The mask plus these is exactly the accepted set (ADR 0004;
        :func:`fill_bitmasks`)."""
        self._forced_position()
        return self._splits

    def _forced_position(self) -> np.ndarray | bool:
        # fills _forced and _splits for this position, once; returns _forced
        if self._forced is not None:
            return self._forced
        self._forced, self._splits = False, []
        m = self._m
        if self._stopped if self._stopped is not None else m.is_stopped():
            self._stopped = True
            return False
        # (asked once a position: forced_candidates may have, for the early redraw this one corrects)
        forced = self._ff if self._ff is not None else m.compute_ff_bytes()
        if forced:
            ok = m.validate_tokens
            splits, ext = self._index.candidates(forced)
            self._splits = accepted = [t for t in splits if ok([t]) == 1]
            if ext is not None and len(ext) <= FORCED_MAX_TOKENS - len(accepted):
                ids = sorted(accepted + [t for t in ext if ok([t]) == 1])
                self._forced = self._index.ids_array(tuple(ids)) if ids else False
        # the lookups may leave the matcher in an error state (a resource limit): asked again now,
        # one call (~0.03 µs), rather than on the next read of is_stopped
        self._stopped = bool(m.is_stopped())
        return self._forced

    def recheck_stopped(self) -> None:
        """Forget :attr:`is_stopped`'s answer for this position: llguidance's mask, forced bytes
        and token checks can put the matcher in an error state (a resource limit) without a
        token accepted."""
        self._stopped = None

    @property
    def is_stopped(self) -> bool:
        """The grammar has ended (or failed: see :attr:`error`): no further token can be accepted.
        Asked of llguidance once a position (the finish step, the sampler and the forced-position
        lookup each ask it every step), again after a mask, a forced-bytes lookup or a token check
        (:meth:`recheck_stopped`). One llguidance call: its ``is_stopped`` is also true in an error
        state (``LLMatcher.is_stopped``'s contract)."""
        if self._stopped is None:
            self._stopped = bool(self._m.is_stopped())
        return self._stopped

    @property
    def failed(self) -> bool:
        """The matcher is in an error state (a resource limit hit mid-answer): the answer is not
        known to match, so the sequence must not end as a success. Only a stopped matcher can be
        in one, so this asks llguidance only when :attr:`is_stopped` (the finish step asks every
        row every step)."""
        return self.is_stopped and bool(self._m.is_error())

    @property
    def is_accepting(self) -> bool:
        """The text so far is a complete match (the sequence may end here)."""
        return bool(self._m.is_accepting())

    @property
    def error(self) -> str | None:
        """The matcher's error message, if it is in an error state."""
        return self._m.get_error() if self._m.is_error() else None


class GrammarCompiler:
    """Compiles :class:`StructuredOutput` specs for one tokenizer and hands out matchers.

    Thread-safe: the server compiles on worker threads, the engine thread asks for matchers.
    The llguidance tokenizer (~0.4 s to build for a 49k vocabulary) is built on first use.

    Args:
        tokenizer: the model's tokenizer; its end-of-generation ids end a grammar.
        vocab_size: rows of the logits the masks apply to (the sampler's vocabulary).
    """

    def __init__(self, tokenizer: "Tokenizer", vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self._lltok = None
        self._index: TokenIndex | None = None
        self._lock = threading.Lock()
        self._build_lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._cache_chars = 0  # len of the cached specs' values (CACHE_CHARS)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")

    def _ll_tokenizer(self) -> Any:
        import llguidance

        with self._build_lock:  # one build at a time; the cache lock stays free for cached lookups
            if self._lltok is None:
                tok = self._tokenizer
                eog = sorted(tok.eog_ids) or None
                self._lltok = llguidance.LLTokenizer(tok.backend_json(), n_vocab=tok.vocab_size, eos_token=eog)
            return self._lltok

    def _build(self, spec: StructuredOutput) -> Any:
        import llguidance

        grammar = spec.grammar_text()
        matcher = llguidance.LLMatcher(self._ll_tokenizer(), grammar, log_level=0)
        if not matcher.is_error():
            # llguidance builds its lexer lazily, at the first masks: build them here, on this worker
            # thread and within the timeout -- the first mask, then one step past an allowed token on
            # a copy -- so a regex that explodes (``a{1000}{1000}``) is refused now rather than
            # failing or stalling the engine thread at the first steps (copies share the lexer)
            allowed = np.flatnonzero(np.unpackbits(np.frombuffer(matcher.compute_bitmask(), np.uint8),
                                                   bitorder="little")[:self.vocab_size])
            first = next((int(t) for t in allowed if int(t) not in self._tokenizer.eog_ids), None)
            if first is not None and not matcher.is_error():
                probe = matcher.deep_copy()
                probe.consume_token(first)
                if not probe.is_error():
                    probe.compute_bitmask()
                if probe.is_error():
                    raise InvalidRequestError(f"{spec.param}: {_first_line(probe.get_error())}", spec.param)
        if matcher.is_error():
            raise InvalidRequestError(f"{spec.param}: {_first_line(matcher.get_error())}", spec.param)
        return matcher

    def compile(self, spec: StructuredOutput, timeout: float = COMPILE_TIMEOUT_S) -> None:
        """Check and cache ``spec``'s grammar (a cached one returns at once). Call it before a
        request reaches the engine thread, so a slow or bad spec never stalls the decode loop.

        Raises:
            InvalidRequestError: the spec does not compile (the message is llguidance's, naming
                the unsupported keyword or the syntax error; a regex's is checked first and worded
                by :mod:`monobatch.engine.regex_check`), or takes longer than ``timeout``
                (the model's llguidance tokenizer, built at the first compile, is not counted).
        """
        key = (spec.kind, spec.value)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return
        if spec.kind == "regex":  # its syntax first: one clear line (engine/regex_check.py)
            regex_check.check_regex(spec.value, spec.param)
        # The llguidance tokenizer is the model's, built once (seconds for Gemma's 262K vocabulary,
        # ~0.4 s for SmolLM2's): it is not the spec's compile time, so the timeout starts after it.
        try:
            self._ll_tokenizer()
            self._token_index()
        except Exception as exc:  # llguidance missing or refusing the vocabulary: a 400 naming the field
            raise InvalidRequestError(f"{spec.param}: the grammar engine cannot load this model's tokenizer "
                                      f"({_first_line(str(exc))})", spec.param) from None
        future = self._pool.submit(self._build, spec)
        try:
            matcher = future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise InvalidRequestError(f"{spec.param}: the constraint took longer than {timeout:g} s to compile "
                                      "(simplify it)", spec.param) from None
        except InvalidRequestError as err:  # found by _build's probe (e.g. a lexer limit at the first mask)
            self._refuse_part(spec, timeout)
            raise _refused(spec, str(err).removeprefix(f"{spec.param}: ")) from None
        except Exception as exc:  # llguidance's ValueError on a malformed schema or regex
            self._refuse_part(spec, timeout)
            raise _refused(spec, _first_line(str(exc))) from None
        with self._lock:
            self._cache[key] = matcher
            self._cache_chars += len(spec.value)
            while len(self._cache) > 1 and (len(self._cache) > CACHE_SIZE or self._cache_chars > CACHE_CHARS):
                (_, value), _ = self._cache.popitem(last=False)
                self._cache_chars -= len(value)

    def _refuse_part(self, spec: StructuredOutput, timeout: float) -> None:
        """Where ``spec`` did not compile: raise the error of its first part that does not compile
        alone (:attr:`StructuredOutput.parts`, naming that part's field); return where each does,
        or where ``timeout`` (all parts together) runs out first (the caller then raises the whole
        spec's own error). The parts are built, not cached: a refused request evicts nothing."""
        deadline = time.monotonic() + timeout
        for part in spec.parts:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            try:
                self._pool.submit(self._build, part).result(timeout=left)
            except concurrent.futures.TimeoutError:
                return
            except InvalidRequestError as err:
                raise _refused(part, str(err).removeprefix(f"{part.param}: ")) from None
            except Exception as exc:
                raise _refused(part, _first_line(str(exc))) from None

    def matcher(self, spec: StructuredOutput) -> GrammarMatcher:
        """A fresh matcher at the start of ``spec``'s grammar (compiling it if it is not cached).

        Raises:
            InvalidRequestError: as :meth:`compile`.
        """
        key = (spec.kind, spec.value)
        with self._lock:
            template = self._cache.get(key)
        if template is None:
            self.compile(spec)
            with self._lock:
                template = self._cache.get(key)
            if template is None:  # evicted at once by a full cache under load: build directly
                template = self._build(spec)
        return GrammarMatcher(template.deep_copy(), self._token_index())

    def _token_index(self) -> TokenIndex:
        """The vocabulary by token bytes (forced positions' splits), built on first use (~0.1 s)."""
        with self._build_lock:
            if self._index is None:
                self._index = TokenIndex(self._tokenizer.token_bytes, self.vocab_size)
            return self._index


#: A GBNF escape: ``\\`` (kept whole, so the ``u`` after an escaped backslash is a letter), ``\uXXXX``
#: or ``\UXXXXXXXX``.
_GBNF_ESCAPE = re.compile(r"\\\\|\\u([0-9a-fA-F]{4})|\\U([0-9a-fA-F]{8})")


def _gbnf_escapes(text: str) -> str:
    r"""GBNF ``\uXXXX`` / ``\UXXXXXXXX`` escapes as llguidance's converter reads them right: it
    drops their leading zeros (0.x ``gbnf_to_lark``: ``\u00e9ab`` became ``\ue9ab``, another
    character, silently). A code point up to U+00FF becomes ``\xNN`` (which it keeps whole), a
    larger one the character itself (never GBNF syntax). Lark text (no ``::=``) is left as it is."""
    if "::=" not in text or "\\" not in text:
        return text

    def one(m: re.Match) -> str:
        hexa = m.group(1) or m.group(2)
        if hexa is None:
            return m.group(0)
        cp = int(hexa, 16)
        return f"\\x{cp:02x}" if cp <= 0xFF else (chr(cp) if cp <= 0x10FFFF and not 0xD800 <= cp <= 0xDFFF
                                                  else m.group(0))

    return _GBNF_ESCAPE.sub(one, text)


def _refused(spec: StructuredOutput, cause: str) -> InvalidRequestError:
    """The error of a spec llguidance refused: ``'<param>: <cause>'``; a regex's in
    :func:`regex_check.does_not_compile`'s words (one that parses but is too large for the lexer,
    e.g. ``a{1000000}``, says so)."""
    if spec.kind != "regex":
        return InvalidRequestError(f"{spec.param}: {cause}", spec.param)
    return regex_check.does_not_compile(spec.value, spec.param,
                                        cause + (" (the pattern is too large)" if "too many" in cause else ""))


def _first_line(message: str) -> str:
    """An llguidance error as one line: its first line, plus the ``error: ...`` line a regex
    error puts below its source excerpt (the rest is a parser-state dump)."""
    lines = [ln.strip() for ln in (message or "the constraint does not compile").strip().splitlines()]
    detail = next((ln for ln in lines[1:] if ln.startswith("error:")), "")
    return (lines[0].rstrip(":") + (f" ({detail[len('error:'):].strip()})" if detail else ""))[:500]


_EXECUTOR = None
_EXECUTOR_LOCK = threading.Lock()


def _executor() -> Any:
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            import llguidance

            _EXECUTOR = llguidance.LLExecutor()
        return _EXECUTOR


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row of a bitmask over ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def fill_bitmasks(matchers: Sequence[GrammarMatcher], vocab_size: int) -> np.ndarray:
    """The allowed tokens of each matcher's next position: llguidance's mask plus, at a forced
    position, the splits of the forced bytes its check accepts (:meth:`GrammarMatcher.splits`).

    Args:
        matchers: R matchers, none stopped.
        vocab_size: the tokenizer's vocabulary size.

    Returns:
        ``[R, ceil(vocab_size / 32)]`` int32 bitmasks (layout in the module docstring).
    """
    R, W = len(matchers), bitmask_words(vocab_size)
    out = np.zeros((R, W), dtype=np.int32)
    if R == 1:
        matchers[0].raw.unsafe_compute_mask_ptr(out.ctypes.data, W * 4)
    elif R:
        _executor().unsafe_compute_mask_ptr([(m.raw, i) for i, m in enumerate(matchers)], out.ctypes.data, W * 4, R)
    words = out.view(np.uint32)
    for i, m in enumerate(matchers):  # the accepted splits of forced bytes (the mask leaves some out)
        m.recheck_stopped()  # the mask may have ended the matcher in an error state
        for t in m.splits():
            words[i, t >> 5] |= np.uint32(1 << (t & 31))
    return out


_POW2: dict[torch.device, torch.Tensor] = {}


def _pow2(device: torch.device) -> torch.Tensor:
    """``[32]`` int32 bit ``i`` set in entry ``i`` (entry 31 is the sign bit), cached per device."""
    import torch

    t = _POW2.get(device)
    if t is None:
        t = _POW2[device] = torch.tensor([1 << i if i < 31 else -(1 << 31) for i in range(32)],
                                         dtype=torch.int32).to(device)
    return t


def apply_bitmask(x: torch.Tensor, rows: torch.Tensor | None, bitmask: torch.Tensor) -> torch.Tensor:
    """Set the logits of disallowed tokens to ``-inf`` in the given rows (three kernels).

    Args:
        x: ``(R, V)`` float32 logits, changed in place.
        rows: ``(M,)`` int64 row indices of the constrained rows; None: every row (M = R).
        bitmask: ``(M, W)`` int32 on ``x``'s device, W * 32 >= V (see :func:`fill_bitmasks`).

    Returns:
        x.
    """
    # columns past the mask's (a padded lm_head's) are no token's: the sampler has set them to -inf
    n = min(x.shape[1], bitmask.shape[1] * 32)
    banned = ((bitmask.unsqueeze(-1) & _pow2(x.device)) == 0).flatten(1)[:, :n]  # (M, n) bool
    if rows is None or rows.shape[0] == x.shape[0]:
        x[:, :n].masked_fill_(banned, float("-inf"))
        return x
    x[rows, :n] = x[rows, :n].masked_fill(banned, float("-inf"))
    return x
