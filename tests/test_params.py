"""SamplingParams refuses wrong types and out-of-range values with the field's name (E3-like
input at the engine's one validation point) and applies the documented precedence."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

from monobatch.engine.params import SamplingParams, resolve_sampling
from monobatch.errors import InvalidRequestError


@pytest.mark.parametrize("kwargs,field", [
    ({"max_tokens": "10"}, "max_tokens"), ({"temperature": "hot"}, "temperature"), ({"temperature": -1}, "temperature"),
    ({"top_p": 2}, "top_p"), ({"top_p": -0.1}, "top_p"), ({"top_k": -5}, "top_k"), ({"top_k": 2.5}, "top_k"), ({"stop": 7}, "stop"),
    ({"stop_token_ids": 5}, "stop_token_ids"), ({"logprobs": True}, "logprobs"), ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"5": 1e9}}, "logit_bias"),
    ({"logit_bias": {"5_0": 1}}, "logit_bias"), ({"logit_bias": {" 5": 1}}, "logit_bias"),
    ({"logit_bias": {True: 1}}, "logit_bias"), ({"max_tokens": -2}, "max_tokens"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"), ({"seed": -2}, "seed"), ({"seed": 2**63}, "seed"), ({"presence_penalty": 3}, "presence_penalty"),
])
def test_bad_values_are_refused_with_the_field_name(kwargs, field):
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(**kwargs)
    assert err.value.param == field and field in str(err.value)


def test_the_cli_and_python_api_take_any_temperature_and_top_p_0():
    """llama.cpp's knobs: the engine takes any temperature >= 0 (only the HTTP API holds to OpenAI's
    0-2, server/protocol.py), and top_p 0 keeps the most likely token (OpenAI's and llama.cpp's)."""
    assert SamplingParams(temperature=3.5).temperature == 3.5
    assert resolve_sampling({"temperature": 5}, {}, entry_point="chat").temperature == 5
    assert SamplingParams(top_p=0).top_p == 0


def test_openai_shapes_are_accepted():
    p = SamplingParams(stop="END", logit_bias={"50": -100}, temperature=1, top_p=1)
    assert p.stop == ("END",) and p.logit_bias == {50: -100.0}
    assert SamplingParams(max_tokens=-1).max_tokens is None  # llama.cpp's -n -1: no limit
    assert SamplingParams(seed=-1).seed is None  # llama.cpp's --seed -1 / llama-server's seed -1: random


def test_a_requests_seed_minus_1_overrides_a_server_seed():
    """-1 is "random" at every level: a request's -1 beats the server's --seed (request > flag),
    and a flag's -1 beats the model's generation config."""
    assert resolve_sampling({"seed": -1}, {"seed": 42}).seed is None
    assert resolve_sampling({}, {"seed": -1}, {"seed": 7}).seed is None
    assert resolve_sampling({"seed": 5}, {"seed": -1}).seed == 5


def test_precedence_request_over_flag_over_model_over_table():
    p = resolve_sampling({"temperature": 0.3}, {"temperature": 0.5, "top_k": 7}, {"temperature": 0.9, "top_k": 3, "top_p": 0.8})
    assert (p.temperature, p.top_k, p.top_p, p.min_p) == (0.3, 7, 0.8, 0.0)
    assert resolve_sampling(entry_point="completions").max_tokens == 16
    assert resolve_sampling({"max_tokens": -1}).max_tokens is None
    with pytest.raises(InvalidRequestError, match="unknown"):
        resolve_sampling({"best_of": 2})


def test_numpy_scalars_are_accepted_as_numbers():
    import numpy as np

    p = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(40), stop_token_ids=[np.int64(2)])
    assert (p.temperature, p.top_k, p.stop_token_ids) == (0.5, 40, (2,))
    assert type(p.top_k) is int


def test_vllms_repetition_penalty_is_an_alias_of_repeat_penalty():
    """vLLM's name for llama.cpp's multiplicative repeat penalty, as the HTTP API takes it
    (server/protocol.py): same field, both given and different is refused, errors say the name given."""
    assert SamplingParams(repetition_penalty=1.1).repeat_penalty == 1.1
    assert SamplingParams(repetition_penalty=1.1, repeat_penalty=1.1).repeat_penalty == 1.1
    assert SamplingParams(repetition_penalty=None, repeat_penalty=1.2).repeat_penalty == 1.2
    assert dataclasses.replace(SamplingParams(repetition_penalty=1.3), top_k=5).repeat_penalty == 1.3
    with pytest.raises(InvalidRequestError, match=r"^repeat_penalty: conflicts with repetition_penalty") as err:
        SamplingParams(repetition_penalty=1.1, repeat_penalty=1.2)
    assert err.value.param == "repeat_penalty"
    with pytest.raises(InvalidRequestError,
                       match=r"^repetition_penalty \(alias of repeat_penalty\): must be > 0") as err:
        SamplingParams(repetition_penalty=0)
    assert err.value.param == "repetition_penalty"
    with pytest.raises(InvalidRequestError, match="repetition_penalty.*expected a number"):
        SamplingParams(repetition_penalty="1.1")
    assert "repetition_penalty" in inspect.signature(SamplingParams).parameters
    # resolve_sampling takes it at any level, and a request's alias beats a flag's field
    assert resolve_sampling({"repetition_penalty": 1.5}, {"repeat_penalty": 1.2}).repeat_penalty == 1.5
    assert resolve_sampling({}, {"repetition_penalty": 1.2}, {"repeat_penalty": 1.05}).repeat_penalty == 1.2
    with pytest.raises(InvalidRequestError, match="conflicts"):
        resolve_sampling({"repetition_penalty": 1.5, "repeat_penalty": 1.2})


@pytest.mark.parametrize("name", ["best_of", "n", "max_new_tokens", "repetition"])
def test_an_unknown_keyword_is_an_invalid_request_listing_the_fields(name):
    """Not Python's bare ``TypeError: __init__() got an unexpected keyword argument``."""
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(temperature=0, **{name: 2})
    message = str(err.value)
    assert err.value.param == name and message.startswith(f"{name}: unknown sampling parameter")
    assert "max_tokens, temperature, top_k" in message and "repeat_penalty" in message
    assert "repetition_penalty for repeat_penalty" in message
    with pytest.raises(InvalidRequestError, match=f"^{name}: unknown sampling parameter; SamplingParams takes"):
        resolve_sampling({name: 2})


@pytest.mark.parametrize("field,value", [("presence_penalty", 3.0), ("frequency_penalty", -2.5), ("logprobs", 50),
                                         ("dry_base", 0.5), ("min_tokens", -1)])
def test_a_range_error_says_what_was_given(field, value):
    """Every range message ends with the value given (as top_p's and temperature's do)."""
    from monobatch.engine.params import SamplingParams
    from monobatch.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match=rf"^{field}: must .*got {value}$"):
        SamplingParams(**{field: value})
