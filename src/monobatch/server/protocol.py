"""Request bodies of the HTTP API, validated by pydantic (strict: ``"10"`` is not an integer).

Field names are OpenAI's, plus the llama.cpp/vLLM sampling extensions. A field we do not
implement is never ignored: the ones OpenAI or vLLM define (``tools``, ``response_format``,
``best_of``, ``suffix``, ...) get a 400 that says they are not supported, any other unknown
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

#: Fields of the OpenAI (or vLLM) API this server refuses with a 400 unless null, per endpoint.
UNSUPPORTED_COMPLETION_FIELDS = ("suffix", "best_of", "prompt_logprobs", "response_format", "guided_json",
                                 "guided_regex", "guided_choice", "guided_grammar", "lora_request")
UNSUPPORTED_CHAT_FIELDS = ("tools", "tool_choice", "functions", "function_call", "parallel_tool_calls",
                           "response_format", "audio", "modalities", "prediction", "web_search_options",
                           "reasoning_effort", "store", "metadata", "service_tier", "continue_final_message",
                           "documents", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
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
        return {k: v for k, v in out.items() if v is not None}

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
