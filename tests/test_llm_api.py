"""``monobatch.LLM``: the Python API drives the same loop as the CLI (same ids as `generate`),
accepts strings and token ids, per-prompt params, chat, and refuses bad input without side effects."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from cli_util import cli_env
from monobatch import LLM, SamplingParams
from monobatch.errors import ContextLengthError, InvalidRequestError

pytestmark = pytest.mark.usefixtures("one_cpu_thread")
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def llm(loaded):
    return LLM(loaded=loaded)


def test_generate_strings_and_token_ids_in_order(llm):
    texts = ["The capital of France is", "def fibonacci(n):", "Roses are red,"]
    outs = llm.generate(texts, GREEDY)
    assert [o.prompt for o in outs] == texts
    ids = [o.prompt_token_ids for o in outs]
    again = llm.generate(ids, GREEDY)  # token id lists give the same tokens
    for a, b in zip(outs, again):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert b.prompt is None and len(a.outputs[0].token_ids) <= 12
        assert a.outputs[0].finish_reason in ("stop", "length")
        assert a.outputs[0].text == llm.tokenizer.decode(a.outputs[0].token_ids)
    single = llm.generate(ids[0], GREEDY)  # one tokenized prompt
    assert len(single) == 1 and single[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_vllm_prompt_dicts_mixed_with_strings_and_ids(llm):
    """vLLM's {"prompt": ...} and {"prompt_token_ids": ...}, alone or in a list with the other forms."""
    short = SamplingParams(temperature=0.0, max_tokens=3)
    text = "The capital of France is"
    ids = llm.tokenizer.encode(text)
    outs = llm.generate([{"prompt": text}, {"prompt_token_ids": ids}, text, ids, tuple(ids)], short, use_tqdm=False)
    assert [o.prompt for o in outs] == [text, None, text, None, None]
    assert all(o.prompt_token_ids == ids for o in outs)
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 1
    one_text = llm.generate({"prompt": text}, short, use_tqdm=False)
    one_ids = llm.generate({"prompt_token_ids": ids}, short, use_tqdm=False)
    assert len(one_text) == len(one_ids) == 1 and one_text[0].prompt == text and one_ids[0].prompt is None
    assert one_text[0].outputs[0].token_ids == one_ids[0].outputs[0].token_ids == outs[0].outputs[0].token_ids


@pytest.mark.parametrize("prompts", [
    None, 3.5, True, 7, b"bytes", [None], [1.5], [True, False], [1, "a"], ["ok", 3], [[[1, 2]]], [[1, [2]]],
    {"prompt": "a", "prompt_token_ids": [1]}, {"prompt": 5}, {"prompt_token_ids": "abc"},
    {"prompt_token_ids": [1, "2"]}, {"prompt_token_ids": [True]}, {"text": "a"}, {}, [{"prompt": "a"}, {"bogus": 1}],
    [{"prompt": None}],
], ids=repr)
def test_other_prompt_shapes_are_invalid_requests(llm, prompts):
    with pytest.raises(InvalidRequestError) as raised:
        llm.generate(prompts, GREEDY, use_tqdm=False)
    message = str(raised.value)
    assert "a string, a list of token ids" in message and '{"prompt": str}' in message, message
    assert '{"prompt_token_ids": [int, ...]}' in message and raised.value.param == "prompts"
    assert not llm.scheduler.has_unfinished()


def test_prompt_shape_errors_say_what_is_wrong(llm):
    with pytest.raises(InvalidRequestError, match="not both"):
        llm.generate({"prompt": "a", "prompt_token_ids": [1]})
    with pytest.raises(InvalidRequestError, match=r"unknown keys \['bogus'\]"):
        llm.generate([{"prompt": "a"}, {"prompt": "b", "bogus": 1}])
    with pytest.raises(InvalidRequestError, match=r"prompts\[1\] must be .*; got float"):
        llm.generate(["a", 1.5])


def test_text_that_is_not_utf8_is_an_invalid_request(llm):
    """A lone surrogate (a JSON escape, a terminal's undecodable byte) in a prompt or a message:
    InvalidRequestError naming the field, not the tokenizer's TypeError; nothing left queued."""
    with pytest.raises(InvalidRequestError, match="not valid UTF-8") as raised:
        llm.generate(["fine", "hi \ud800"])
    assert raised.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="not valid UTF-8") as raised:
        llm.chat([{"role": "user", "content": "hi \udfff"}])
    assert raised.value.param == "messages"
    assert not llm.scheduler.has_unfinished()


def test_same_ids_as_the_cli(llm, bundled_path):
    prompt = "The three primary colours are"
    res = subprocess.run([sys.executable, "-m", "monobatch", "generate", "-p", prompt, "--temperature", "0", "-n", "12",
                          "--output-format", "json", "-t", "1", "--no-progress"], capture_output=True, text=True, timeout=300,
                         env=cli_env())  # this checkout's src, as every other CLI test runs it
    assert res.returncode == 0, res.stderr
    cli = json.loads(res.stdout)
    assert llm.generate(prompt, GREEDY)[0].outputs[0].token_ids == cli["token_ids"]


def test_per_prompt_params_defaults_and_logprobs(llm):
    outs = llm.generate(["Hello", "Hello"], [SamplingParams(temperature=0, max_tokens=3),
                                             SamplingParams(temperature=0, max_tokens=5, logprobs=2)])
    assert len(outs[0].outputs[0].token_ids) <= 3 and outs[0].outputs[0].logprobs is None
    lp = outs[1].outputs[0].logprobs
    assert lp and len(lp) == len(outs[1].outputs[0].token_ids) and len(lp[0][2]) == 2
    assert llm.default_sampling_params().max_tokens == 16  # vLLM's default when none is given
    assert len(llm.generate("Hello", use_tqdm=False)[0].outputs[0].token_ids) <= 16


def test_vllms_repetition_penalty_reaches_the_sampler(llm):
    """``SamplingParams(repetition_penalty=...)`` (vLLM's name) is llama.cpp's repeat_penalty: the
    same ids as ``repeat_penalty=``, and not the unpenalised ones (the prompt's "1" is penalised)."""
    prompt = "1 1 1 1 1 1 1 1 1 1 1 1"
    ref, vllm, llama = (o.outputs[0].token_ids for o in llm.generate([prompt] * 3, [
        SamplingParams(temperature=0, max_tokens=6),
        SamplingParams(temperature=0, max_tokens=6, repetition_penalty=3.0),
        SamplingParams(temperature=0, max_tokens=6, repeat_penalty=3.0)], use_tqdm=False))
    assert ref[0] in llm.tokenizer.encode(prompt), "precondition: the reference repeats the prompt"
    assert vllm == llama and vllm[0] != ref[0]


def test_chat_one_conversation_or_many(llm):
    conv = [{"role": "user", "content": "Name a colour."}]
    one = llm.chat(conv, GREEDY)
    many = llm.chat([conv, [{"role": "user", "content": "Name a fruit."}]], GREEDY)
    assert len(one) == 1 and len(many) == 2
    assert one[0].outputs[0].token_ids == many[0].outputs[0].token_ids
    assert one[0].prompt_token_ids == llm.tokenizer.encode_chat(conv)


def test_bad_input_is_refused_and_changes_nothing(llm):
    with pytest.raises(InvalidRequestError):
        llm.generate(["fine", [10**9]], GREEDY)  # the second prompt has an id outside the vocabulary
    with pytest.raises(ContextLengthError):
        llm.generate([[1] * 10_000], GREEDY)
    with pytest.raises(InvalidRequestError):
        llm.generate(["a", "b"], [GREEDY])
    with pytest.raises(InvalidRequestError):
        llm.generate([], GREEDY)
    with pytest.raises(InvalidRequestError) as raised:
        llm.chat([{"role": "nobody", "content": "x"}], GREEDY)
    assert raised.value.param == "messages[0].role"  # the element, as the server's 400 names it
    # sampling_params of the wrong type (a vLLM or HTTP user's dict, a string, the class itself)
    for bad, says in [({"max_tokens": 2}, "not dict .*SamplingParams\\(\\*\\*fields\\)"), ("x", "not str"),
                      (5, "not int"), (SamplingParams, "the class itself"), ([GREEDY, {"n": 1}], r"sampling_params\[1\]")]:
        with pytest.raises(InvalidRequestError, match=says) as raised:
            llm.generate(["a", "b"], bad)
        assert raised.value.param == "sampling_params"
    with pytest.raises(InvalidRequestError, match="not dict"):
        llm.chat([{"role": "user", "content": "hi"}], {"max_tokens": 2})
    # conversations of the wrong shape, named as the server names them (it refuses these with a 400)
    hi = {"role": "user", "content": "hi"}
    for bad, param in [([None], "messages[0]"), ([[]], "messages[0]"), ([[hi], hi], "messages[1]"), ([], "messages")]:
        with pytest.raises(InvalidRequestError) as raised:
            llm.chat(bad, GREEDY)
        assert raised.value.param == param, (bad, raised.value)
    # a field assigned after construction is checked when the request is submitted
    mutated = SamplingParams(temperature=0.0, max_tokens=4)
    mutated.temperature = float("nan")
    with pytest.raises(InvalidRequestError, match="temperature"):
        llm.generate("x", mutated)
    mutated.temperature, mutated.max_tokens = 0.0, "abc"
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        llm.generate(["x"], [mutated])
    # LLM's own arguments of the wrong type name the argument (the engine's too)
    from monobatch.engine.engine import EngineConfig
    for kwargs, name in [({"max_model_len": "8"}, "max_model_len"), ({"max_num_seqs": 2.5}, "max_num_seqs"),
                         ({"kv_cache_memory": "1G"}, "kv_cache_memory"), ({"deterministic": "yes"}, "deterministic")]:
        with pytest.raises(InvalidRequestError) as raised:
            EngineConfig(**kwargs)
        assert raised.value.param == name
    assert EngineConfig(kv_cache_memory=1.5e9).kv_cache_memory == 1_500_000_000
    for kwargs, name in [({"model": 5}, "model"), ({"enforce_eager": "no"}, "enforce_eager"),
                         ({"chat_template": 5}, "chat_template")]:
        with pytest.raises(InvalidRequestError) as raised:
            LLM(**kwargs)
        assert raised.value.param == name
    with pytest.raises(InvalidRequestError, match="chat_template_kwargs must be an object") as raised:
        llm.chat([hi], GREEDY, chat_template_kwargs="x")
    assert raised.value.param == "chat_template_kwargs"
    s = llm.scheduler
    assert not s.has_unfinished() and s.kv.usage().used_blocks == 0
    assert llm.generate("fine", GREEDY)[0].outputs[0].token_ids  # still works


def test_a_failed_step_leaves_nothing_behind(loaded, monkeypatch):
    """An error while stepping (a device failure, Ctrl-C) aborts the call's requests: the next
    call starts clean and works."""
    llm = LLM(loaded=loaded)
    real = llm.scheduler.engine.step
    calls = {"n": 0}

    def failing_once(*args):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("simulated device failure")
        return real(*args)

    monkeypatch.setattr(llm.scheduler.engine, "step", failing_once)
    with pytest.raises(RuntimeError, match="simulated"):
        llm.generate(["Hello", "The capital of France is"], GREEDY)
    s = llm.scheduler
    assert not s.has_unfinished() and s.kv.usage().used_blocks == 0
    assert llm.generate("Hello", GREEDY)[0].outputs[0].token_ids


def test_structured_output_and_tools_through_the_python_api(llm):
    """SamplingParams.structured constrains LLM.generate / LLM.chat as it does the server; tools
    with tool_choice "required" give a parsed call whose arguments match the tool's schema."""
    import json

    from monobatch import SamplingParams, StructuredOutput
    from monobatch.errors import InvalidRequestError

    schema = {"type": "object", "properties": {"colour": {"enum": ["red", "green", "blue"]}}, "required": ["colour"]}
    sp = SamplingParams(temperature=0, max_tokens=30, structured=StructuredOutput.json_schema(schema))
    out = llm.chat([{"role": "user", "content": "Pick a colour."}], sp)[0].outputs[0]
    assert out.finish_reason == "stop" and json.loads(out.text)["colour"] in ("red", "green", "blue")
    gen = llm.generate("Pick a colour:", SamplingParams(temperature=0, max_tokens=8,
                                                         structured=StructuredOutput.choice(["red", "blue"])))
    assert gen[0].outputs[0].text in ("red", "blue")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}}}]
    res = llm.chat([{"role": "user", "content": "Weather in Rome?"}], SamplingParams(temperature=0, max_tokens=60),
                   tools=tools, tool_choice="required", parallel_tool_calls=False)[0].outputs[0]
    assert len(res.tool_calls) == 1 and res.tool_calls[0].name == "get_weather"
    assert res.finish_reason == "tool_calls"  # as the chat endpoint reports it
    assert isinstance(json.loads(res.tool_calls[0].arguments)["city"], str)
    with pytest.raises(InvalidRequestError) as info:
        llm.generate("x", SamplingParams(max_tokens=2, structured=StructuredOutput.regex("[0-9")))
    assert info.value.param == "regex"
    assert str(info.value) == 'regex: the regular expression "[0-9" does not compile: unclosed character class'
    with pytest.raises(InvalidRequestError) as info:  # the pattern as typed: one backslash, as every door shows it
        llm.generate("x", SamplingParams(max_tokens=2, structured=StructuredOutput.regex(r"\d+[a-")))
    assert str(info.value) == r'regex: the regular expression "\d+[a-" does not compile: unclosed character class'
