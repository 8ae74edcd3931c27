"""Tool calling through the real server with the official ``openai`` client (the bundled
SmolLM2's template knows no tools: the generic format, constrained JSON).

``required`` and a named function are enforced by the grammar: the call is valid JSON matching
``parameters`` even from the 135M model (validated with ``jsonschema``); ``auto`` lets the model
choose. Streamed tool-call arguments joined equal the non-streamed ones. The server runs
``--deterministic`` (a request's tokens do not depend on its neighbours), so a test's independent
requests (the streamed and the non-streamed one) are sent concurrently.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from server_util import assert_400_naming, shared_server
from test_server import MAIN_ARGS, parallel

openai = pytest.importorskip("openai")

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "description": "The local time in a city",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"type": "string", "maxLength": 30}},
                                               "required": ["city"], "additionalProperties": False}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module")
def server():
    return shared_server("main", *MAIN_ARGS)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def _stream(client, **kw):
    """(calls by index: {id, name, arguments}, content, finish_reason, chunks) of a streamed reply."""
    calls, content, reason, chunks = {}, "", None, 0
    for chunk in client.chat.completions.create(stream=True, **kw):
        if not chunk.choices:
            continue
        chunks += 1
        d = chunk.choices[0].delta
        for t in d.tool_calls or ():
            entry = calls.setdefault(t.index, {"id": None, "name": None, "arguments": ""})
            if t.id:
                assert entry["id"] is None, "the id comes once, first"
                entry["id"] = t.id
            if t.function and t.function.name:
                entry["name"] = t.function.name
            assert entry["id"] is not None and entry["name"] is not None, "id and name come first"
            entry["arguments"] += (t.function.arguments or "") if t.function else ""
        content += d.content or ""
        reason = chunk.choices[0].finish_reason or reason
    return calls, content, reason, chunks


def plain_and_streamed(client, **kw):
    """The non-streamed reply and :func:`_stream`'s result for the same request, sent concurrently."""
    return parallel(lambda streamed: _stream(client, **kw) if streamed else client.chat.completions.create(**kw),
                    [(False,), (True,)])


@pytest.mark.parametrize("choice,names", [("required", {"get_weather", "get_time"}), (NAMED, {"get_time"})])
def test_required_and_named_are_enforced_streamed_and_not(client, model, choice, names):
    kw = dict(model=model, messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=80)
    done, (calls, content, reason, _) = plain_and_streamed(client, **kw)
    c = done.choices[0]
    want = "stop" if isinstance(choice, dict) else "tool_calls"  # OpenAI: a named function ends with stop
    assert c.finish_reason == want and c.message.content is None
    assert len(c.message.tool_calls) == 1
    call = c.message.tool_calls[0]
    assert call.type == "function" and call.id.startswith("call_") and call.function.name in names
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)
    assert reason == want and content == "" and list(calls) == [0]
    assert calls[0]["name"] == call.function.name and calls[0]["arguments"] == call.function.arguments


def test_parallel_tool_calls_false_allows_one_call(client, model):
    done = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=False, temperature=0, max_tokens=80)
    assert len(done.choices[0].message.tool_calls) == 1


def test_auto_lets_the_model_choose_and_is_parsed(client, model):
    """The generic format's auto: a call or a text response; either way the shape is OpenAI's."""
    kw = dict(model=model, messages=[{"role": "user", "content": "Say hello."}], tools=TOOLS, tool_choice="auto",
              temperature=0, max_tokens=60)
    done, (calls, content, reason, _) = plain_and_streamed(client, **kw)
    c = done.choices[0]
    if c.message.tool_calls:
        assert c.finish_reason == "tool_calls" and reason == "tool_calls"
        assert [calls[i]["arguments"] for i in sorted(calls)] == [t.function.arguments for t in c.message.tool_calls]
    else:
        assert c.finish_reason in ("stop", "length") and c.message.content and not calls
        assert content == c.message.content and not content.lstrip().startswith("{")


def test_round_trip_call_result_answer(client, model):
    """Call, tool result, final answer: assistant tool_calls and tool messages in the history."""
    first = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice=NAMED,
                                           temperature=0, max_tokens=80).choices[0].message
    call = first.tool_calls[0]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "14:05"}]
    final, again = (r.choices[0] for r in parallel(lambda kw: client.chat.completions.create(**kw), [
        (dict(model=model, messages=history, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=40),),
        (dict(model=model, messages=history, tools=TOOLS, temperature=0, max_tokens=60),)]))  # auto again: valid either way
    assert final.finish_reason in ("stop", "length") and final.message.content and not final.message.tool_calls
    assert again.message.tool_calls or again.message.content


def test_tool_choice_none_and_no_tools_leave_the_reply_as_text(client, model):
    for kw in ({"tools": TOOLS, "tool_choice": "none"}, {}):
        c = client.chat.completions.create(model=model, messages=ASK, temperature=0, max_tokens=12, **kw).choices[0]
        assert c.message.tool_calls is None and c.message.content


def test_stop_string_inside_the_arguments_gives_no_call(client, model):
    """G2: a stop string that matches inside a call's arguments ends the reply there; the cut
    call is no tool call (no invalid JSON is claimed as arguments): its text is content, with
    finish_reason stop; no half marker leaks."""
    kw = dict(model=model, messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=80,
              stop=["Paris"])
    done, (calls, content, reason, _) = plain_and_streamed(client, **kw)
    c = done.choices[0]
    assert c.finish_reason == "stop" and not c.message.tool_calls
    assert c.message.content.startswith('{"tool_calls"') and "Paris" not in c.message.content
    assert not calls and content == c.message.content and reason == "stop"


@pytest.mark.parametrize("fields,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strang"}}}],
      "tool_choice": "required"}, "tools"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_tools_are_400s_naming_the_field(server, fields, param, stream):
    assert_400_naming(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 4, "stream": stream, **fields},
                      param)
