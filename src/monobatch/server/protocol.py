"""Request bodies of the HTTP API, validated by pydantic (strict: ``"10"`` is not an integer).

Field names are OpenAI's, plus the llama.cpp/vLLM sampling extensions. A field we do not
implement is never ignored: the ones OpenAI or vLLM define (``best_of``, ``suffix``,
``functions``, ...) get a 400 that says they are not supported, any other unknown
field a 400 that names it (``extra="forbid"``). A null value counts as absent.

Value ranges are checked once, by :class:`monobatch.engine.params.SamplingParams`; this module
checks only JSON types, the fields that never reach it (``n``, ``echo``, ``top_logprobs``), and
where the HTTP API differs from the CLI (``max_tokens`` -1 is the CLI's "no limit", a 400 here
as in OpenAI and vLLM).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from monobatch.chat_output import REASONING_FORMATS
from monobatch.engine.constraint import StructuredOutput
from monobatch.errors import InvalidRequestError

#: Fields of the OpenAI (or vLLM) API this server refuses with a 400 unless null, per endpoint.
UNSUPPORTED_COMPLETION_FIELDS = ("suffix", "best_of", "prompt_logprobs", "lora_request", "guided_decoding_backend",
                                 "guided_whitespace_pattern")
UNSUPPORTED_CHAT_FIELDS = ("functions", "function_call", "audio", "modalities", "prediction", "web_search_options",
                           "reasoning_effort", "store", "metadata", "service_tier", "continue_final_message",
                           "documents", "guided_decoding_backend", "guided_whitespace_pattern")
#: Most choices one request may ask for (``n``).
MAX_N = 128
#: Most alternatives per token (``logprobs`` / ``top_logprobs``), as SamplingParams allows.
MAX_LOGPROBS = 20
ReasoningFormat = Literal[REASONING_FORMATS]  # type: ignore[valid-type]


def _refuse(fields: tuple[str, ...]):
    """A before-validator: drop null values of ``fields``, refuse any other value."""

    def check(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name in fields:
            if name in data:
                if data[name] is not None:
                    raise PydanticCustomError("unsupported_field", "{field}: this field is not supported by monobatch",
                                              {"field": name})
                data = {k: v for k, v in data.items() if k != name}
        return {k: v for k, v in data.items() if v is not None}

    return model_validator(mode="before")(check)


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Body):
    """``stream_options``: ``include_usage`` adds one usage chunk before ``[DONE]``."""

    include_usage: bool = False
    include_obfuscation: bool = False  # OpenAI's padding field: nothing to obfuscate here


class JsonSchemaFormat(_Body):
    """``response_format.json_schema`` (OpenAI): the schema the reply must match. ``strict`` is
    accepted and always honoured: the grammar enforces the whole schema either way."""

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | bool = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` (any JSON object) or
    ``json_schema`` (the reply matches ``json_schema.schema``)."""

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

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


#: The request fields that carry an output constraint (one per request at most).
CONSTRAINT_FIELDS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                     "guided_grammar", "json_schema", "grammar")


def _grammar(text: str, param: str) -> StructuredOutput:
    """A ``grammar`` field: GBNF (llama.cpp) or, when it looks like one, an llguidance Lark grammar."""
    return StructuredOutput("grammar", text, param)


class SamplingFields(_Body):
    """Sampling and stopping fields shared by both generation endpoints."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=0)  # -1 (the CLI's no limit) is a 400, as in OpenAI
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # -- llama.cpp / vLLM extensions --
    top_k: int | None = None
    min_p: float | None = None
    typical_p: float | None = None
    repetition_penalty: float | None = None
    repeat_penalty: float | None = None  # llama.cpp's name for repetition_penalty
    repeat_last_n: int | None = None
    dry_multiplier: float | None = None
    dry_base: float | None = None
    dry_allowed_length: int | None = None
    dry_penalty_last_n: int | None = None
    dry_sequence_breakers: list[str] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    cache_prompt: bool = True  # llama.cpp: false = do not adopt cached prefix blocks
    return_token_ids: bool = False  # vLLM: token ids of the prompt and of each choice
    # -- structured outputs: one constraint per request (OpenAI, vLLM, llama.cpp names) --
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None  # vLLM's older names
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    json_schema: dict[str, Any] | None = None  # llama-server's
    grammar: str | None = None  # llama-server's (GBNF)

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
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", StructuredOutput.json_object("response_format")))
        elif rf is not None and rf.type == "json_schema":
            found.append(("response_format", StructuredOutput.json_schema(rf.json_schema.schema_,
                                                                           "response_format.json_schema.schema")))
        so = self.structured_outputs
        if so is not None:
            kinds = []
            if so.json_ is not None:
                kinds.append(("structured_outputs.json", StructuredOutput.json_schema(so.json_, "structured_outputs.json")))
            if so.regex is not None:
                kinds.append(("structured_outputs.regex", StructuredOutput("regex", so.regex, "structured_outputs.regex")))
            if so.choice is not None:
                kinds.append(("structured_outputs.choice", StructuredOutput.choice(so.choice, "structured_outputs.choice")))
            if so.grammar is not None:
                kinds.append(("structured_outputs.grammar", _grammar(so.grammar, "structured_outputs.grammar")))
            if so.json_object:
                kinds.append(("structured_outputs.json_object", StructuredOutput.json_object("structured_outputs.json_object")))
            if not kinds:
                raise InvalidRequestError("structured_outputs: give one of json, regex, choice, grammar or json_object",
                                          "structured_outputs")
            found += kinds
        if self.guided_json is not None:
            found.append(("guided_json", StructuredOutput.json_schema(self.guided_json, "guided_json")))
        if self.guided_regex is not None:
            found.append(("guided_regex", StructuredOutput("regex", self.guided_regex, "guided_regex")))
        if self.guided_choice is not None:
            found.append(("guided_choice", StructuredOutput.choice(self.guided_choice, "guided_choice")))
        if self.guided_grammar is not None:
            found.append(("guided_grammar", _grammar(self.guided_grammar, "guided_grammar")))
        if self.json_schema is not None:
            found.append(("json_schema", StructuredOutput.json_schema(self.json_schema, "json_schema")))
        if self.grammar is not None:
            found.append(("grammar", _grammar(self.grammar, "grammar")))
        if len(found) > 1:
            names = [name for name, _ in found]
            raise InvalidRequestError(f"{names[0]}: one output constraint per request; this one has "
                                      f"{' and '.join(names)}", names[0])
        return found[0][1] if found else None

    @property
    def include_usage(self) -> bool:
        """``stream_options.include_usage``."""
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: ``prompt`` is a string, a list of strings, a list of token ids
    or a list of token-id lists (one choice set per prompt)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    drop_unsupported = _refuse(UNSUPPORTED_COMPLETION_FIELDS)


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``. ``messages`` are checked by the chat-template module
    (roles, text parts); ``max_completion_tokens`` wins over the deprecated ``max_tokens``."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=0)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_format: ReasoningFormat | None = None  # llama.cpp: overrides --reasoning-format
    # -- tool calling (OpenAI): checked by monobatch.tool_calls.check_tools --
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

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


class TokenizeRequest(_Body):
    """``POST /tokenize``: vLLM's (``prompt`` or ``messages``, ``add_special_tokens``,
    ``return_token_strs``) and llama.cpp's (``content``, ``add_special``, ``with_pieces``) shapes.

    Each special-tokens field keeps its own server's default: ``add_special_tokens`` (vLLM)
    defaults to true, ``add_special`` (llama.cpp) to false; whichever the client sent decides,
    both with different values is a 400. With ``messages`` the ids are exactly a chat request's
    (the template's special tokens, one BOS at most): either field may be true, never false.
    """

    model: str | None = None
    prompt: str | None = None
    content: str | None = None
    messages: list[dict[str, Any]] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = None
    add_special: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False
    with_pieces: bool = False

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _one_input(self) -> "TokenizeRequest":
        given = [name for name in ("prompt", "content", "messages") if getattr(self, name) is not None]
        if len(given) != 1:
            raise PydanticCustomError("tokenize_input", "prompt: give exactly one of prompt, content or messages",
                                      {"field": "prompt"})
        if None not in (self.add_special, self.add_special_tokens) and self.add_special != self.add_special_tokens:
            raise PydanticCustomError("alias", "add_special: conflicts with add_special_tokens (give one)",
                                      {"field": "add_special"})
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

    model: str | None = None
    tokens: list[int]
