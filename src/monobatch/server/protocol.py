"""Request bodies of the HTTP API, validated by pydantic (strict: ``"10"`` is not an integer).

Field names are OpenAI's, plus the llama.cpp/vLLM sampling extensions. A field we do not
implement is never ignored: the ones OpenAI or vLLM define (``best_of``, ``suffix``,
``functions``, ...) get a 400 that says they are not supported, any other unknown
field a 400 that names it (``extra="forbid"``). A null value counts as absent. A few OpenAI chat
fields that SDKs send (``store``, ``metadata``, ``service_tier``, ...) are typed fields that take
only the values asking for nothing this server would do differently, and are then ignored; any
other value is a 400 naming the field.

Value ranges are checked once, by :class:`monobatch.engine.params.SamplingParams`; this module
checks only JSON types, the fields that never reach it (``n``, ``echo``, ``top_logprobs``), and
where the HTTP API differs from the CLI and the Python API: ``max_tokens`` -1 is the CLI's "no
limit", a 400 here as in OpenAI and vLLM; ``temperature`` is in [0, 2] here (OpenAI's range, both
ends checked here so that they read alike), any value >= 0 there (llama.cpp's knob).

The JSON schemas of these models are the request bodies of ``/openapi.json``: the ranges the
engine checks are written into them (``json_schema_extra``: documented here, still checked and
worded by SamplingParams), every optional field of a body that drops nulls accepts ``null``,
the refused fields are listed as ``null``-only properties, and ``additionalProperties: false``
comes from ``extra="forbid"``; cross-field rules (``stream_options`` needs ``stream``, one input
of ``/tokenize``, ...) are ``allOf`` clauses. ``x-monobatch`` markers (a served model name, a token
id, prompt text) are filled in by :mod:`monobatch.server.openapi` once the model is loaded.
Integer fields take a whole number written ``2.0`` (JSON Schema counts it as an integer).
"""

from __future__ import annotations

import copy
import json
import math
from typing import Annotated, Any, Callable, ClassVar, Literal, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, WrapValidator, model_validator
from pydantic_core import PydanticCustomError, ValidationError

from monobatch.chat_output import REASONING_FORMATS
from monobatch.engine.constraint import StructuredOutput
from monobatch.errors import InvalidRequestError
from monobatch.tokenizer.chat_template import ROLES

#: Fields of the OpenAI (or vLLM) API this server refuses with a 400 unless null, per endpoint.
UNSUPPORTED_COMPLETION_FIELDS = ("suffix", "best_of", "prompt_logprobs", "lora_request", "guided_decoding_backend",
                                 "guided_whitespace_pattern")
UNSUPPORTED_CHAT_FIELDS = ("functions", "function_call", "audio", "prediction", "web_search_options",
                           "reasoning_effort", "verbosity", "continue_final_message", "documents",
                           "guided_decoding_backend", "guided_whitespace_pattern")
#: Why a refused field is refused, where the bare "not supported" would leave a user guessing.
REFUSAL_REASONS = {"reasoning_effort": "the model has no control over its reasoning's length",
                   "verbosity": "the model has no verbosity control"}
#: OpenAI's limits on ``metadata`` (its API validates them): pairs, key and value characters.
METADATA_PAIRS, METADATA_KEY_CHARS, METADATA_VALUE_CHARS = 16, 64, 512
#: OpenAI's limit on ``safety_identifier`` (characters).
SAFETY_IDENTIFIER_CHARS = 128
#: Most choices one request may ask for (``n``).
MAX_N = 128
#: Most alternatives per token (``logprobs`` / ``top_logprobs``), as SamplingParams allows: OpenAI's
#: ``top_logprobs`` range (its legacy completions stop ``logprobs`` at 5; 20 is vLLM's default limit).
MAX_LOGPROBS = 20
#: The largest ``temperature`` a request may ask for: OpenAI's API reference ("between 0 and 2").
#: The CLI and the Python API take any temperature >= 0 (llama.cpp's knob): only HTTP bounds it.
MAX_TEMPERATURE = 2
ReasoningFormat = Literal[REASONING_FORMATS]  # type: ignore[valid-type]
#: Seeds are in ``[0, 2**63)``, or -1 for a random one (SamplingParams); as an exclusive bound it
#: survives FastAPI's float conversion of schema bounds exactly (2**63 - 1 would not).
SEED_LIMIT = 2**63
#: ``x-monobatch`` marker values (see :mod:`monobatch.server.openapi`).
MODEL_MARKER, TOKEN_ID_MARKER, PROMPT_TEXT_MARKER = "model", "token-id", "prompt-text"


def _whole_float(value: Any) -> Any:
    """``2.0`` as ``2``: JSON has one number type and JSON Schema counts 2.0 as an integer, so an
    integer field takes it; ``2.5``, ``"2"`` and ``true`` stay refused (strict)."""
    if type(value) is float and value.is_integer():
        return int(value)
    return value


#: An integer field: strict, but a whole JSON number written with a fraction (``2.0``) counts.
JsonInt = Annotated[int, BeforeValidator(_whole_float)]
#: pydantic's error types of a value outside a field's bounds.
_RANGE_ERRORS = frozenset({"greater_than", "greater_than_equal", "less_than", "less_than_equal"})
#: Characters of a refused value a range error shows (the rest as "...").
_SHOWN = 80


def _bounded(low: int, high: int | None = None) -> Any:
    """A :data:`JsonInt` in ``[low, high]`` (``high`` None: no upper bound), the bounds in its JSON
    schema (first: so the schema reads minimum/maximum), a value outside them refused as the
    engine's range errors read: ``max_tokens: must be >= 0, got -1``, ``n: must be in [1, 128],
    got 0`` (the field, the whole range, the value given as JSON; not pydantic's "Input should be
    ..."); a value that is no integer: ``max_tokens: must be an integer >= 0, got "10"``."""
    allowed = f">= {low}" if high is None else f"in [{low}, {high}]"

    def words(value: Any, handler: Callable[[Any], int], info: ValidationInfo) -> int:
        try:
            return handler(value)
        except ValidationError as exc:
            kind = exc.errors()[0]["type"]
            if kind not in _RANGE_ERRORS and not kind.startswith("int_"):
                raise
            what = "must be " + allowed if kind in _RANGE_ERRORS else "must be an integer " + allowed
            # escaped (a lone surrogate never reaches the reply) and cut (a huge value is not echoed)
            got = json.dumps(value, ensure_ascii=True, default=repr)
            got = got if len(got) <= _SHOWN else got[:_SHOWN] + "..."
            raise PydanticCustomError("range", "{field}: " + what + ", got {got}",
                                      {"field": info.field_name, "got": got}) from None

    return Annotated[int, Field(ge=low, le=high), BeforeValidator(_whole_float), WrapValidator(words)]


#: Bounded integer fields' types (a type, so that ``TokenCount | None`` keeps the bounds on the integer).
TokenCount = _bounded(0)
LogprobCount = _bounded(0, MAX_LOGPROBS)
ChoiceCount = _bounded(1, MAX_N)


# -- JSON-schema annotations (the OpenAPI document; validation is unchanged) -----------------------
def _branches(schema: dict) -> list[dict]:
    """The non-null alternatives of a field's schema (itself when it is no union)."""
    options = schema.get("anyOf")
    if options is None:
        return [schema]
    return [b for b in options if b.get("type") != "null"]


def _bounds(description: str, **keywords: Any) -> Callable[[dict], None]:
    """A ``json_schema_extra`` that documents a field (``description``) and adds JSON-schema
    ``keywords`` (``minimum``, ``exclusiveMinimum``, ...) to its non-null alternatives. Only the
    schema changes: the value is still checked (and the 400 worded) where it is today."""

    def extra(schema: dict) -> None:
        schema["description"] = description
        for branch in _branches(schema):
            branch.update(keywords)

    return extra


def _items(description: str, items: dict, **keywords: Any) -> Callable[[dict], None]:
    """A ``json_schema_extra`` for a list field: ``items`` replaces the item schema (and
    ``keywords`` are added) in every array alternative."""

    def extra(schema: dict) -> None:
        schema["description"] = description
        for branch in _branches(schema):
            if branch.get("type") == "array":
                branch.update(items=copy.deepcopy(items), **keywords)

    return extra


def _accepts_null(schema: dict) -> bool:
    return schema.get("type") == "null" or any(b.get("type") == "null" for b in schema.get("anyOf", ()))


def _null_is_absent(schema: dict, cls: type) -> None:
    """Model-level ``json_schema_extra`` of a body that drops null values: every optional
    property accepts null (it means "absent"), and the refused fields (``cls.refused_fields``)
    are properties that only null may take."""
    required = set(schema.get("required", ()))
    props = schema.setdefault("properties", {})
    for name, prop in list(props.items()):
        if name in required or _accepts_null(prop):
            continue
        meta = {k: prop.pop(k) for k in ("title", "description", "default") if k in prop}
        props[name] = {"anyOf": [prop, {"type": "null"}], **meta}
    for name in getattr(cls, "refused_fields", ()):
        props[name] = {"type": "null", "title": name.replace("_", " ").title(),
                       "description": "Not supported by monobatch: any value but null is a 400."}
    rules = getattr(cls, "schema_rules", ())
    if rules:
        schema["allOf"] = copy.deepcopy(list(rules))


def _absent(*names: str) -> dict:
    """JSON schema: each of ``names`` is absent or null."""
    return {"properties": {name: {"type": "null"} for name in names}}


def _given(name: str, schema: dict) -> dict:
    """JSON schema: ``name`` is present and matches ``schema`` (a non-null one)."""
    return {"required": [name], "properties": {name: schema}}


def _rules(*rules: dict) -> Callable[[dict], None]:
    """A model-level ``json_schema_extra``: cross-field rules the model checks (``allOf``)."""

    def extra(schema: dict) -> None:
        schema.setdefault("allOf", []).extend(copy.deepcopy(list(rules)))

    return extra


def _drop_nulls(data: Any) -> Any:
    return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


_TOKEN_ID = {"type": "integer", "minimum": 0, "x-monobatch": TOKEN_ID_MARKER}
_TEXT_PART = {"type": "object", "required": ["type", "text"],
              "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}
#: An assistant message's tool call, as monobatch.tool_calls checks history calls.
_HISTORY_CALL = {"type": "object", "required": ["id", "function"],
                 "properties": {"id": {"type": "string"}, "type": {"const": "function"},
                                "function": {"type": "object", "required": ["name", "arguments"],
                                             "properties": {"name": {"type": "string"},
                                                            "arguments": {"type": "string"}}}}}
#: One chat message, as monobatch.tokenizer.chat_template.normalize_messages checks it (keys
#: beyond role and content pass to the template).
MESSAGE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "role in system, developer (rendered as system), user, assistant, tool; content a string or "
                   "a list of text parts (joined with newlines). An assistant message with tool_calls ([{id, type: "
                   "function, function: {name, arguments}}]) may leave content out, and tool messages follow it, "
                   "one answering each call (tool_call_id: the id of the call it answers; OpenAI's rule, a 400 "
                   "otherwise). A message's call ids are distinct and each is answered once; arguments are JSON "
                   "text. Other keys (name, ...) pass to the chat template.",
    "required": ["role"],
    "properties": {"role": {"enum": sorted(ROLES)},
                   "content": {"anyOf": [{"type": "string"}, {"type": "array", "items": _TEXT_PART},
                                         {"type": "null"}]}},
    "allOf": [
        {"anyOf": [{"required": ["content"], "properties": {"content": {"anyOf": [
                        {"type": "string"}, {"type": "array", "items": _TEXT_PART}]}}},
                   {"required": ["tool_calls"], "properties": {"role": {"const": "assistant"},
                                                               "tool_calls": {"type": "array", "minItems": 1}}}]},
        {"anyOf": [{"properties": {"role": {"enum": sorted(ROLES - {"assistant"})}}},
                   {"properties": {"tool_calls": {"type": ["array", "null"], "items": _HISTORY_CALL}}}]},
        {"anyOf": [{"properties": {"role": {"enum": sorted(ROLES - {"tool"})}}},
                   {"required": ["tool_call_id"], "properties": {"tool_call_id": {"type": "string"}}}]},
    ],
}


#: One tool, as monobatch.tool_calls.check_tools checks it.
TOOL_SCHEMA: dict[str, Any] = {
    "type": "object", "required": ["function"],
    "properties": {"type": {"const": "function"},
                   "function": {"type": "object", "required": ["name"],
                                "properties": {"name": {"type": "string", "pattern": "\\S"},
                                               "description": {"type": "string"},
                                               "parameters": {"type": "object", "description": (
                                                   "A JSON schema of the arguments; absent: the function takes "
                                                   "none (arguments {}).")}}}}}


def _tool_choice_schema(schema: dict) -> None:
    schema["description"] = ("OpenAI's: none, auto, required or {type: function, function: {name}} (a tool's name); "
                             "required and a name need tools. Default: auto with tools, none without.")
    for branch in _branches(schema):
        if branch.get("type") == "object":
            branch.update(required=["type", "function"],
                          properties={"type": {"const": "function"},
                                      "function": {"type": "object", "required": ["name"],
                                                   "properties": {"name": {"type": "string"}}}})


def _stop_schema(schema: dict) -> None:
    schema["description"] = "Stop strings (non-empty), matched on the text across tokens."
    for branch in _branches(schema):
        (branch if branch.get("type") == "string" else branch["items"])["minLength"] = 1


def _logit_bias_schema(schema: dict) -> None:
    schema["description"] = "Token id (decimal digits, inside the vocabulary) -> bias in [-100, 100]."
    for branch in _branches(schema):
        branch.update(propertyNames={"pattern": "^[0-9]+$"},
                      additionalProperties={"type": "number", "minimum": -100, "maximum": 100})


def _model_name(schema: dict) -> None:
    schema["description"] = "A served model name (GET /v1/models); another name is a 404 model_not_found. " \
                            "Absent, null or empty: the first served name."
    for branch in _branches(schema):
        branch["x-monobatch"] = MODEL_MARKER


def _refuse(fields: tuple[str, ...]):
    """A before-validator: drop null values of ``fields``, refuse any other value."""

    def check(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name in fields:
            if name in data:
                if data[name] is not None:
                    reason = f" ({REFUSAL_REASONS[name]})" if name in REFUSAL_REASONS else ""
                    raise PydanticCustomError("unsupported_field", "{field}: this field is not supported by monobatch"
                                              "{reason}", {"field": name, "reason": reason})
                data = {k: v for k, v in data.items() if k != name}
        return {k: v for k, v in data.items() if v is not None}

    return model_validator(mode="before")(check)


def _shown(value: Any, limit: int = 80) -> str:
    """A client's value as JSON text for an error message, cut at ``limit`` characters."""
    text = json.dumps(value, ensure_ascii=True, default=repr)  # escapes: a lone surrogate never reaches the reply
    return text if len(text) <= limit else text[:limit] + "..."


def _only(name: str, allowed: tuple[Any, ...], why: str) -> BeforeValidator:
    """A field's before-validator: a value other than ``allowed`` (compared with its JSON type:
    ``0`` is not ``false``) is a 400 naming the field and saying ``why``. The field's type (a
    ``Literal``) writes the same values into the JSON schema."""

    def check(value: Any) -> Any:
        if not any(type(value) is type(a) and value == a for a in allowed):
            raise PydanticCustomError("unsupported_value", "{field}: {why}, got {got}",
                                      {"field": name, "why": why, "got": _shown(value)})
        return value

    return BeforeValidator(check)


def _check_metadata(value: Any) -> Any:
    """``metadata`` as OpenAI validates it: at most 16 pairs, string keys of at most 64 characters,
    string values of at most 512."""
    if not (isinstance(value, dict) and len(value) <= METADATA_PAIRS
            and all(isinstance(v, str) and len(k) <= METADATA_KEY_CHARS and len(v) <= METADATA_VALUE_CHARS
                    for k, v in value.items())):
        raise PydanticCustomError("metadata", "metadata: an object of at most {pairs} pairs, keys of at most {keys} "
                                  "characters and string values of at most {values} (OpenAI's limits), got {got}",
                                  {"field": "metadata", "pairs": METADATA_PAIRS, "keys": METADATA_KEY_CHARS,
                                   "values": METADATA_VALUE_CHARS, "got": _shown(value)})
    return value


def _one_of(name: str, literal: Any, why: str) -> Any:
    """``literal`` (a ``Literal`` type) as a field type whose other values are a 400 naming the
    field (:func:`_only`, with the literal's own values)."""
    return Annotated[literal, _only(name, get_args(literal), why)]


#: ``store``: only false (nothing is stored, so true would be a promise this server breaks).
StoreFalse = _one_of("store", Literal[False], "only false is supported (monobatch stores no completions)")
#: ``service_tier``: the values that ask for the one tier this server has.
ServiceTier = _one_of("service_tier", Literal["auto", "default"],
                      "only 'auto' or 'default' is supported (monobatch has one service tier)")
#: ``modalities``: text only.
TextModality = Annotated[list[Literal["text"]], Field(min_length=1, max_length=1), _only(
    "modalities", (["text"],), 'only ["text"] is supported (monobatch generates text, no audio)')]
def _check_tool_choice(value: Any) -> Any:
    """``tool_choice``: one of OpenAI's three words or an object (checked further by
    :func:`monobatch.tool_calls.check_tools`); anything else a 400 that says so, not pydantic's
    one line per union member."""
    if value is None or isinstance(value, dict) or (type(value) is str and value in ("none", "auto", "required")):
        return value
    raise PydanticCustomError("unsupported_value", "{field}: must be 'none', 'auto', 'required' or {named}, got {got}",
                              {"field": "tool_choice", "got": _shown(value),
                               "named": '{"type": "function", "function": {"name": ...}}'})


#: ``tool_choice``: OpenAI's words or a named function (schema: _tool_choice_schema).
ToolChoice = Annotated[Literal["none", "auto", "required"] | dict[str, Any] | None, BeforeValidator(_check_tool_choice)]
#: ``metadata``: labels of stored completions (schema from the type, checked by _check_metadata).
Metadata = Annotated[dict[Annotated[str, Field(max_length=METADATA_KEY_CHARS)],
                          Annotated[str, Field(max_length=METADATA_VALUE_CHARS)]],
                     Field(max_length=METADATA_PAIRS), BeforeValidator(_check_metadata)]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class _NullIsAbsent(_Body):
    """A body whose null values are dropped before validation (null = absent)."""

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        return _drop_nulls(data)


class StreamOptions(_NullIsAbsent):
    """``stream_options``: ``include_usage`` adds one usage chunk before ``[DONE]``."""

    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=_null_is_absent)

    include_usage: bool = Field(False, description="One extra chunk with the usage (and no choices) before [DONE].")
    include_obfuscation: bool = Field(False, description="OpenAI's padding field: accepted, ignored.")


def _check_schema(value: Any) -> Any:
    """``response_format.json_schema.schema``: an object, a boolean or null; anything else one
    clear 400 (not pydantic's line per union member)."""
    if value is None or isinstance(value, (dict, bool)):
        return value
    raise PydanticCustomError("unsupported_value", "{field}: must be a JSON schema (an object or a boolean), "
                              "got {got}", {"field": "response_format.json_schema.schema", "got": _shown(value)})


class JsonSchemaFormat(_Body):
    """``response_format.json_schema`` (OpenAI): the schema the reply must match. ``name`` is
    required; ``schema`` is optional in OpenAI's API (its OpenAPI document and the ``openai``
    client's types), and without it the reply is any JSON object, as ``json_object``. ``strict`` is
    accepted and always honoured: the grammar enforces the whole schema either way."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: Annotated[dict[str, Any] | bool | None, BeforeValidator(_check_schema)] = Field(None, alias="schema", description=(
        "A JSON schema of the reply. Absent or null: any JSON object (as type json_object)."))
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON object) or
    ``json_schema`` (the reply matches ``json_schema.schema``)."""

    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=_rules({"anyOf": [
        {"allOf": [{"properties": {"type": {"const": "json_schema"}}}, _given("json_schema", {"type": "object"})]},
        {"properties": {"type": {"enum": ["text", "json_object"]}, "json_schema": {"type": "null"}}}]}))

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise PydanticCustomError("response_format", "response_format: json_schema is required with type "
                                      "'json_schema' and only then", {"field": "response_format"})
        return self


class StructuredOutputsParams(_Body):
    """vLLM's ``structured_outputs`` object: exactly one of ``json`` (a JSON schema, object or
    text), ``regex``, ``choice`` (a list of strings), ``grammar`` (GBNF, llama.cpp's format, or
    llguidance's Lark) or ``json_object: true``."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None
    json_object: bool | None = None

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True, json_schema_extra=_rules({"anyOf": [
        *({"allOf": [_given(kind, {"type": kinds}), _absent(*(k for k in ("json", "regex", "choice", "grammar")
                                                              if k != kind)),
                     {"properties": {"json_object": {"enum": [False, None]}}}]}
          for kind, kinds in (("json", ["object", "string"]), ("regex", "string"), ("choice", "array"),
                              ("grammar", "string"))),
        {"allOf": [_given("json_object", {"const": True}), _absent("json", "regex", "choice", "grammar")]}]}))


#: The request fields that carry an output constraint (one per request at most).
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar", "json_schema", "grammar")


def _constraint(kind: str, value: Any, param: str) -> StructuredOutput:
    """One constraint field's :class:`StructuredOutput`: ``json`` (a schema), ``regex``, ``choice``,
    ``grammar`` (GBNF, or an llguidance Lark grammar) or ``json_object``."""
    if kind == "json":
        return StructuredOutput.json_schema(value, param)
    if kind == "choice":
        return StructuredOutput.choice(value, param)
    if kind == "json_object":
        return StructuredOutput.json_object(param)
    return StructuredOutput(kind, value, param)


class SamplingFields(_Body):
    """Sampling and stopping fields shared by both generation endpoints."""

    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=_null_is_absent)
    #: Cross-field rules in the JSON schema (checked by the validators below).
    schema_rules: ClassVar[tuple[dict, ...]] = (
        {"anyOf": [_absent("stream_options"), _given("stream", {"const": True})]},)

    model: str | None = Field(None, json_schema_extra=_model_name)
    n: ChoiceCount = Field(1, description="Choices per prompt; prompts x n is at most 256 (and at "
                                          "most --max-num-seqs + --max-queue when --max-queue is set).")
    stream: bool = Field(False, description="Answer with server-sent events (text/event-stream).")
    stream_options: StreamOptions | None = Field(None, description="Only with stream: true.")
    max_tokens: TokenCount | None = Field(None, description=(  # -1 (the CLI's no limit) is a 400, as in OpenAI
        "Most tokens to generate (default: 16 for completions, no limit for chat: until an end-of-generation "
        "token or the context end). Prompt + max_tokens may exceed the context: the reply then ends with "
        "finish_reason length there."))
    temperature: float | None = Field(None, json_schema_extra=_bounds(
        "0 = greedy (argmax); OpenAI's range, 0 to 2 (the CLI and the Python API take any value >= 0).", minimum=0,
        maximum=MAX_TEMPERATURE))
    top_p: float | None = Field(None, json_schema_extra=_bounds(
        "Nucleus sampling; 1 = off, 0 = the most likely token only.", minimum=0, maximum=1))
    stop: str | list[str] | None = Field(None, json_schema_extra=_stop_schema)
    seed: JsonInt | None = Field(None, json_schema_extra=_bounds(
        "Reproducible sampling; with n > 1 choice j uses seed + j modulo 2**63. -1: a random seed (llama-server's; it overrides "
        "the server's --seed).", minimum=-1, exclusiveMaximum=SEED_LIMIT))
    presence_penalty: float | None = Field(None, json_schema_extra=_bounds("Over generated tokens.", minimum=-2,
                                                                           maximum=2))
    frequency_penalty: float | None = Field(None, json_schema_extra=_bounds("Over generated tokens.", minimum=-2,
                                                                            maximum=2))
    logit_bias: dict[str, float] | None = Field(None, json_schema_extra=_logit_bias_schema)
    user: str | None = Field(None, description="Accepted, unused.")
    # -- llama.cpp / vLLM extensions --
    top_k: JsonInt | None = Field(None, json_schema_extra=_bounds("0 or -1 = off.", minimum=-1))
    min_p: float | None = Field(None, json_schema_extra=_bounds("Relative to the most likely token; 0 = off.",
                                                                minimum=0, maximum=1))
    typical_p: float | None = Field(None, json_schema_extra=_bounds("1 = off.", exclusiveMinimum=0, maximum=1))
    repetition_penalty: float | None = Field(None, json_schema_extra=_bounds(
        "vLLM's name for repeat_penalty (both with different values is a 400); 1 = off.", exclusiveMinimum=0))
    repeat_penalty: float | None = Field(None, json_schema_extra=_bounds(  # llama.cpp's name for repetition_penalty
        "llama.cpp's name for repetition_penalty; over prompt + output within repeat_last_n; 1 = off.",
        exclusiveMinimum=0))
    repeat_last_n: JsonInt | None = Field(None, json_schema_extra=_bounds("0 = off, -1 = the whole context.",
                                                                          minimum=-1))
    dry_multiplier: float | None = Field(None, json_schema_extra=_bounds("DRY; 0 = off.", minimum=0))
    dry_base: float | None = Field(None, json_schema_extra=_bounds("DRY.", minimum=1))
    dry_allowed_length: JsonInt | None = Field(None, json_schema_extra=_bounds("DRY.", minimum=0))
    dry_penalty_last_n: JsonInt | None = Field(None, json_schema_extra=_bounds(
        "DRY; 0 = off, -1 = the whole context.", minimum=-1))
    dry_sequence_breakers: list[str] | None = Field(None, json_schema_extra=_items(
        "DRY; non-empty strings, replacing the defaults.", {"type": "string", "minLength": 1}))
    ignore_eos: bool | None = Field(None, description="Keep generating past end-of-generation tokens.")
    min_tokens: JsonInt | None = Field(None, json_schema_extra=_bounds(
        "At most max_tokens; end-of-generation and stop token ids are masked until then.", minimum=0))
    stop_token_ids: list[JsonInt] | None = Field(None, json_schema_extra=_items(
        "Token ids (inside the vocabulary) that end the reply with finish_reason stop.", _TOKEN_ID))
    include_stop_str_in_output: bool | None = Field(None, description="Keep the matched stop string in the text.")
    skip_special_tokens: bool | None = Field(None, description="Leave special tokens out of the text (default true).")
    cache_prompt: bool = Field(True, description="llama.cpp's: false = do not adopt cached prefix blocks.")
    return_token_ids: bool = Field(False, description="vLLM's: token_ids per choice, and prompt_token_ids.")
    # -- structured outputs: one constraint per request (OpenAI, vLLM, llama.cpp names) --
    response_format: ResponseFormat | None = Field(None, description="OpenAI's output constraint (one constraint "
                                                                     "field per request).")
    structured_outputs: StructuredOutputsParams | None = Field(None, description="vLLM's output constraint: exactly "
                                                                                 "one of its fields.")
    guided_json: dict[str, Any] | str | None = Field(None, description="vLLM's older name: a JSON schema.")
    guided_regex: str | None = Field(None, description="vLLM's older name: a regular expression.")
    guided_choice: list[str] | None = Field(None, min_length=1, description="vLLM's older name: one of these strings.")
    guided_grammar: str | None = Field(None, description="vLLM's older name: a grammar (GBNF or Lark).")
    json_schema: dict[str, Any] | None = Field(None, description="llama-server's: a JSON schema.")
    grammar: str | None = Field(None, description="llama-server's: a GBNF grammar.")

    @model_validator(mode="after")
    def _openai_temperature(self) -> "SamplingFields":
        # the HTTP API's own range (0 to MAX_TEMPERATURE), both ends in its words; NaN: SamplingParams' 400
        if self.temperature is not None and not math.isnan(self.temperature) \
                and not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise PydanticCustomError("temperature", "temperature: must be in [0, 2] (OpenAI's range), got {value}",
                                      {"field": "temperature", "value": self.temperature})
        return self

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> "SamplingFields":
        if self.stream_options is not None and not self.stream:
            raise PydanticCustomError("stream_options", "stream_options: only allowed when stream is true",
                                      {"field": "stream_options"})
        if self.repetition_penalty is not None and self.repeat_penalty is not None \
                and self.repetition_penalty != self.repeat_penalty:
            raise PydanticCustomError("alias", "repeat_penalty: conflicts with repetition_penalty (give one)",
                                      {"field": "repeat_penalty"})
        return self

    def sampling_request(self) -> dict[str, Any]:
        """The fields that :func:`monobatch.engine.params.resolve_sampling` takes (set ones only)."""
        out = {name: getattr(self, name) for name in (
            "max_tokens", "temperature", "top_p", "seed", "presence_penalty", "frequency_penalty",
            "logit_bias", "top_k", "min_p", "typical_p", "repeat_last_n", "dry_multiplier", "dry_base",
            "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers", "ignore_eos", "min_tokens",
            "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens")}
        out["repeat_penalty"] = self.repetition_penalty if self.repetition_penalty is not None else self.repeat_penalty
        if self.stop is not None:
            out["stop"] = [self.stop] if isinstance(self.stop, str) else self.stop
        out["structured"] = self.structured_output()
        return {k: v for k, v in out.items() if v is not None}

    def structured_output(self) -> StructuredOutput | None:
        """The request's output constraint, from whichever field carries it.

        Raises:
            InvalidRequestError: two constraints in one request (naming both), a
                ``structured_outputs`` object with none or several kinds, a schema that is not
                JSON.
        """
        found: list[tuple[str, StructuredOutput]] = []
        rf = self.response_format
        if rf is not None and (rf.type == "json_object" or rf.type == "json_schema" and rf.json_schema.schema_ is None):
            # (OpenAI's json_schema.schema is optional: without one, any JSON object)
            found.append(("response_format", StructuredOutput.json_object("response_format")))
        elif rf is not None and rf.type == "json_schema":
            found.append(("response_format", StructuredOutput.json_schema(rf.json_schema.schema_,
                                                                           "response_format.json_schema.schema")))
        so = self.structured_outputs
        if so is not None:
            kinds = [(f"structured_outputs.{name}", _constraint(kind, value, f"structured_outputs.{name}"))
                     for name, kind, value in (("json", "json", so.json_), ("regex", "regex", so.regex),
                                               ("choice", "choice", so.choice), ("grammar", "grammar", so.grammar),
                                               ("json_object", "json_object", so.json_object or None))
                     if value is not None]
            if not kinds:
                raise InvalidRequestError("structured_outputs: give one of json, regex, choice, grammar or json_object",
                                          "structured_outputs")
            found += kinds
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar"), ("json_schema", "json"), ("grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                found.append((name, _constraint(kind, value, name)))
        if len(found) > 1:
            names = [name for name, _ in found]
            raise InvalidRequestError(f"{names[0]}: one output constraint per request; this one has "
                                      f"{' and '.join(names)}", names[0])
        return found[0][1] if found else None

    @property
    def include_usage(self) -> bool:
        """``stream_options.include_usage``."""
        return self.stream_options is not None and self.stream_options.include_usage


def _prompt_schema(schema: dict) -> None:
    """``prompt``: lists are never empty; token ids are >= 0 (and inside the vocabulary)."""
    schema["description"] = ("A string, a list of strings, a list of token ids or a list of token-id lists (one "
                             "choice set per prompt, choice index = prompt index * n + j). An empty prompt or list "
                             "is a 400.")
    for branch in _branches(schema):
        if branch.get("type") == "string":
            branch["x-monobatch"] = PROMPT_TEXT_MARKER
        if branch.get("type") != "array":
            continue
        branch["minItems"] = 1
        item = branch["items"]
        if item.get("type") == "string":
            item["x-monobatch"] = PROMPT_TEXT_MARKER
        elif item.get("type") == "integer":
            branch["items"] = copy.deepcopy(_TOKEN_ID)
        elif item.get("type") == "array":
            branch["items"] = {"type": "array", "items": copy.deepcopy(_TOKEN_ID), "minItems": 1}


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, a list of token ids
    or a list of token-id lists (one choice set per prompt)."""

    refused_fields: ClassVar[tuple[str, ...]] = UNSUPPORTED_COMPLETION_FIELDS

    prompt: str | list[str] | list[JsonInt] | list[list[JsonInt]] = Field(json_schema_extra=_prompt_schema)
    echo: bool = Field(False, description="Prepend the prompt to the text.")
    logprobs: LogprobCount | None = Field(None, description=(
        "The chosen token's logprob and this many alternatives (legacy shape, with text_offset); with echo the "
        "prompt's tokens too."))

    drop_unsupported = _refuse(UNSUPPORTED_COMPLETION_FIELDS)


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``. ``messages`` are checked by the chat-template module
    (roles, text parts); ``max_completion_tokens`` wins over the deprecated ``max_tokens``."""

    refused_fields: ClassVar[tuple[str, ...]] = UNSUPPORTED_CHAT_FIELDS
    schema_rules: ClassVar[tuple[dict, ...]] = (
        *SamplingFields.schema_rules,
        {"anyOf": [_absent("top_logprobs"), _given("logprobs", {"const": True})]},
        {"anyOf": [{"properties": {"tool_choice": {"enum": ["none", "auto", None]}}},
                   _given("tools", {"type": "array", "minItems": 1})]})

    messages: list[dict[str, Any]] = Field(min_length=1, json_schema_extra=_items(
        "The conversation, rendered by the model's chat template.", MESSAGE_SCHEMA))
    max_completion_tokens: TokenCount | None = Field(None, description="Wins over max_tokens.")
    logprobs: bool = Field(False, description="Per-token logprobs in OpenAI's chat shape.")
    top_logprobs: LogprobCount | None = Field(None, description="Alternatives per token; needs logprobs: true.")
    add_generation_prompt: bool = Field(True, description="End the rendered prompt with the assistant header.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description=(
        "Extra template variables; may not set messages, add_generation_prompt, bos_token or eos_token."))
    reasoning_format: ReasoningFormat | None = Field(None, description=(  # llama.cpp: overrides --reasoning-format
        "separate: a <think> block goes to reasoning_content; none: it stays in content. Default: the server's "
        "--reasoning-format."))
    # -- tool calling (OpenAI): checked by monobatch.tool_calls.check_tools --
    tools: list[dict[str, Any]] | None = Field(None, json_schema_extra=_items(
        "OpenAI's function tools (names unique).", TOOL_SCHEMA))
    tool_choice: ToolChoice = Field(None, json_schema_extra=_tool_choice_schema)
    parallel_tool_calls: bool | None = Field(None, description=(
        "OpenAI's: allow several calls in one reply (default true; at most 8 where the grammar enforces the calls; "
        "a named tool_choice gets exactly one)."))

    # -- OpenAI fields accepted and ignored: the values their types take ask for nothing this server
    # would do differently; any other value is a 400 naming the field (_only), never dropped --
    store: StoreFalse | None = Field(None, description=(
        "OpenAI's: false only (monobatch stores no completions); true is a 400."))
    metadata: Metadata | None = Field(None, description=(
        "OpenAI's labels of stored completions: at most 16 pairs, keys of at most 64 characters, string values of "
        "at most 512. Accepted, ignored (nothing is stored)."))
    service_tier: ServiceTier | None = Field(None, description=(
        "OpenAI's: auto or default (monobatch has one tier); any other (flex, priority, ...) is a 400."))
    prompt_cache_key: str | None = Field(None, description=(
        "OpenAI's routing hint for its prompt cache: accepted, ignored (monobatch's prefix cache is automatic; "
        "cache_prompt turns it off)."))
    safety_identifier: str | None = Field(None, max_length=SAFETY_IDENTIFIER_CHARS, description=(
        "OpenAI's end-user id (at most 128 characters), as user: accepted, unused."))
    modalities: TextModality | None = Field(None, description='OpenAI\'s output types: ["text"] only (audio is a 400).')

    drop_unsupported = _refuse(UNSUPPORTED_CHAT_FIELDS)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise PydanticCustomError("top_logprobs", "top_logprobs: needs logprobs: true", {"field": "top_logprobs"})
        return self

    def sampling_request(self) -> dict[str, Any]:
        """As :meth:`SamplingFields.sampling_request`, with ``max_completion_tokens`` (which
        wins over ``max_tokens``) and ``logprobs``/``top_logprobs`` as the engine's ``logprobs``
        (the number of alternatives; 0 = only the chosen token's)."""
        out = super().sampling_request()
        if self.max_completion_tokens is not None:
            out["max_tokens"] = self.max_completion_tokens
        if self.logprobs:
            out["logprobs"] = self.top_logprobs or 0
        return out


class TokenizeRequest(_NullIsAbsent):
    """``POST /tokenize``: vLLM's (``prompt`` or ``messages`` with optional ``tools``,
    ``add_special_tokens``, ``return_token_strs``) and llama.cpp's (``content``, ``add_special``, ``with_pieces``) shapes.

    Each special-tokens field keeps its own server's default: ``add_special_tokens`` (vLLM)
    defaults to true, ``add_special`` (llama.cpp) to false; whichever the client sent decides,
    both with different values is a 400. With ``messages`` the ids are exactly a chat request's
    (the template's special tokens, one BOS at most): either field may be true, never false.
    """

    model_config = ConfigDict(strict=True, extra="forbid", json_schema_extra=_null_is_absent)
    schema_rules: ClassVar[tuple[dict, ...]] = ({"anyOf": [
        {"allOf": [_given(name, {"type": kind}), _absent(*({"prompt", "content", "messages"} - {name}))]}
        for name, kind in (("prompt", "string"), ("content", "string"), ("messages", "array"))]},
        {"anyOf": [_absent("add_special"), _absent("add_special_tokens"),
                   {"properties": {"add_special": {"const": True}, "add_special_tokens": {"const": True}}},
                   {"properties": {"add_special": {"const": False}, "add_special_tokens": {"const": False}}}]},
        {"anyOf": [_absent("messages"), {"properties": {"add_special": {"enum": [True, None]},
                                                        "add_special_tokens": {"enum": [True, None]}}}]})

    model: str | None = Field(None, json_schema_extra=_model_name)
    prompt: str | None = Field(None, description="vLLM's input (give exactly one of prompt, content, messages).")
    content: str | None = Field(None, description="llama.cpp's input.")
    messages: list[dict[str, Any]] | None = Field(None, min_length=1, json_schema_extra=_items(
        "vLLM's chat input: the ids a chat request with these messages gets.", MESSAGE_SCHEMA))
    add_special_tokens: bool | None = Field(None, description="vLLM's (default true for prompt); with messages it "
                                                              "cannot be false.")
    add_special: bool | None = Field(None, description="llama.cpp's (default false for content); conflicts with a "
                                                       "different add_special_tokens.")
    add_generation_prompt: bool = Field(True, description="With messages.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="With messages.")
    tools: list[dict[str, Any]] | None = Field(None, json_schema_extra=_items(
        "With messages (vLLM's): the tools a chat request would render into the prompt.", TOOL_SCHEMA))
    tool_choice: ToolChoice = Field(None, json_schema_extra=_tool_choice_schema)
    parallel_tool_calls: bool | None = Field(None, description="With messages and tools, as a chat request's.")
    return_token_strs: bool = Field(False, description="Add token_strs.")
    with_pieces: bool = Field(False, description="tokens becomes [{id, piece}].")

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        given = [name for name in ("prompt", "content", "messages") if getattr(self, name) is not None]
        if len(given) != 1:
            raise PydanticCustomError("tokenize_input", "prompt: give exactly one of prompt, content or messages",
                                      {"field": "prompt"})
        if None not in (self.add_special, self.add_special_tokens) and self.add_special != self.add_special_tokens:
            raise PydanticCustomError("alias", "add_special: conflicts with add_special_tokens (give one)",
                                      {"field": "add_special"})
        if self.messages is None:
            for name in ("tools", "tool_choice", "parallel_tool_calls"):
                if getattr(self, name) is not None:
                    raise PydanticCustomError("chat_only", "{field}: only with messages (the ids of a chat request)",
                                              {"field": name})
        if self.messages is not None and False in (self.add_special, self.add_special_tokens):
            name = "add_special" if self.add_special is False else "add_special_tokens"
            raise PydanticCustomError("chat_special", "{field}: with messages the chat template decides the special "
                                      "tokens (the ids a chat request gets); it cannot be false", {"field": name})
        return self

    @property
    def add_specials(self) -> bool:
        """Whether to add the tokenizer's special tokens (BOS) to ``prompt``/``content``."""
        if self.add_special_tokens is not None:
            return self.add_special_tokens
        if self.add_special is not None:
            return self.add_special
        return self.content is None  # vLLM's default for prompt, llama.cpp's for content


class DetokenizeRequest(_Body):
    """``POST /detokenize``: ``{"tokens": [ids]}`` (vLLM and llama.cpp)."""

    model: str | None = Field(None, json_schema_extra=_model_name)
    tokens: list[JsonInt] = Field(json_schema_extra=_items("Token ids inside the vocabulary.", _TOKEN_ID))
