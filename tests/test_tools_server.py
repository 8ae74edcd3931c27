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

from monobatch.tool_calls import MAX_PARALLEL_CALLS
from server_util import assert_400_naming, shared_server, sse_events
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
#: Asked this, the greedy 135M model calls get_weather again and again (Paris, London, Paris, ...).
TWO_CITIES = [{"role": "user", "content": "What is the weather in Paris and in London?"}]


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


def _first_delta(server, **body):
    """The first delta of a streamed chat reply (raw SSE)."""
    resp = server.post("/v1/chat/completions", {**body, "stream": True})
    assert resp.status_code == 200, resp.text
    return sse_events(resp.text.splitlines())[0]["choices"][0]["delta"]


def _accumulated(client, **kw):
    """The choice the ``openai`` client's stream helper accumulates (``chat.completions.stream``)."""
    with client.chat.completions.stream(**kw) as stream:
        for _ in stream:
            pass
        return stream.current_completion_snapshot.choices[0]


def _logprob_rows(logprobs):
    return [(t.token, t.logprob, [(a.token, a.logprob) for a in t.top_logprobs]) for t in logprobs.content]


@pytest.mark.parametrize("tools,choice,logprobs", [
    (None, None, False), (TOOLS, "required", False), (TOOLS, NAMED, False), (TOOLS, "auto", False),
    (TOOLS, "none", False), (None, None, True), (TOOLS, "required", True), (TOOLS, "auto", True)])
def test_the_first_streamed_delta_says_what_openais_says(server, client, model, tools, choice, logprobs):
    """OpenAI's first delta: ``{"role": "assistant", "content": ""}`` for a text reply, the role
    with ``content: null`` and the first call for a reply that starts with a call (the role chunk
    waits for the reply's first piece when tools are offered; with ``logprobs`` the rows of the
    tokens before it wait too, and come with that first piece). The ``openai`` client's stream
    helper then accumulates the non-streamed message (``content`` null for a reply of only calls)
    and logprobs."""
    kw = dict(model=model, messages=ASK, temperature=0, max_tokens=60) | (
        {"tools": tools, "tool_choice": choice} if tools else {}) | (
        {"logprobs": True, "top_logprobs": 2} if logprobs else {})
    plain = client.chat.completions.create(**kw).choices[0]
    done = plain.message
    first = _first_delta(server, **kw)
    if done.tool_calls:
        assert first["role"] == "assistant" and first["content"] is None and list(first) == [
            "role", "content", "tool_calls"]
        call = first["tool_calls"][0]
        assert call["index"] == 0 and call["function"] == {"name": done.tool_calls[0].function.name, "arguments": ""}
    else:
        assert first == {"role": "assistant", "content": ""}
    # the grammar forces the calls; under auto the greedy bundled model answers this in text (the
    # deferred role chunk's text case)
    assert (choice in ("required", NAMED)) == bool(done.tool_calls)
    streamed_choice = _accumulated(client, **kw)
    streamed = streamed_choice.message
    assert streamed.content == done.content and streamed.role == "assistant"
    assert [(c.function.name, c.function.arguments) for c in streamed.tool_calls or ()] == [
        (c.function.name, c.function.arguments) for c in done.tool_calls or ()]
    if logprobs:
        assert _logprob_rows(streamed_choice.logprobs) == _logprob_rows(plain.logprobs)


def test_streamed_token_ids_travel_with_their_logprobs(server, model):
    """With ``return_token_ids`` and logprobs, a streamed reply that starts with a call carries
    the tokens held before the call in its first chunk beside their logprobs: every chunk's
    ``token_ids`` are the tokens its logprob rows are about, and they add up to the
    non-streamed ids."""
    body = dict(model=model, messages=ASK, temperature=0, max_tokens=60, tools=TOOLS, tool_choice="required",
                logprobs=True, return_token_ids=True)
    plain = server.post("/v1/chat/completions", body).json()["choices"][0]
    resp = server.post("/v1/chat/completions", {**body, "stream": True})
    ids = []
    for event in sse_events(resp.text.splitlines()):
        if not isinstance(event, dict) or not event.get("choices"):
            continue
        row = event["choices"][0]
        rows = (row.get("logprobs") or {}).get("content") or []
        assert len(row.get("token_ids") or []) == len(rows), row
        ids += row.get("token_ids") or []
    assert ids == plain["token_ids"]


def test_parallel_tool_calls_false_allows_one_call(client, model):
    done = client.chat.completions.create(model=model, messages=ASK, tools=TOOLS, tool_choice="required",
                                          parallel_tool_calls=False, temperature=0, max_tokens=80)
    assert len(done.choices[0].message.tool_calls) == 1


def _calls(message):
    return [(t.function.name, t.function.arguments) for t in message.tool_calls or ()]


def _streamed_calls(calls):
    return [(calls[i]["name"], calls[i]["arguments"]) for i in sorted(calls)]


def test_max_tokens_inside_a_further_call_ends_with_length(client, model):
    """max_tokens cuts the reply inside a second call (after its name): finish_reason is length (the
    reply was cut), never tool_calls, streamed and not. The complete call is still returned (a stream
    has sent it when it completed), and the cut one with its text as far as it came; no wrapper text
    is content (null), the same both ways."""
    kw = dict(model=model, messages=TWO_CITIES, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=60)
    done, (calls, content, reason, _) = plain_and_streamed(client, **kw)
    c = done.choices[0]
    assert c.finish_reason == "length" and reason == "length"
    assert len(c.message.tool_calls) == 2 and c.message.content is None and content == ""
    assert json.loads(c.message.tool_calls[0].function.arguments), "precondition: a complete call, then a cut one"
    assert _streamed_calls(calls) == _calls(c.message)


@pytest.mark.parametrize("choice,name", [("required", "get_weather"), (NAMED, "get_time")])
def test_max_tokens_inside_a_forced_call_returns_the_cut_call(client, model, choice, name):
    """OpenAI's reply when max_tokens cuts a forced call: finish_reason length, content null, and
    the call whose arguments are the JSON text as far as it came (not JSON); streamed, the same
    arguments joined. Cut before the name is complete: no call, content still null (no wrapper
    text)."""
    kw = dict(model=model, messages=ASK, tools=TOOLS, tool_choice=choice, temperature=0, max_tokens=22)
    done, (calls, content, reason, _) = plain_and_streamed(client, **kw)
    c = done.choices[0]
    assert c.finish_reason == "length" == reason and c.message.content is None and content == ""
    [call] = c.message.tool_calls
    assert call.function.name == name and call.id.startswith("call_")
    assert call.function.arguments.startswith('{"city') and not call.function.arguments.endswith("}")
    with pytest.raises(json.JSONDecodeError):
        json.loads(call.function.arguments)
    assert _streamed_calls(calls) == _calls(c.message)
    done, (calls, content, reason, _) = plain_and_streamed(client, **{**kw, "max_tokens": 12})  # '..."name": "get_'
    c = done.choices[0]
    assert c.finish_reason == "length" == reason and c.message.content is None and content == ""
    assert c.message.tool_calls is None and not calls


def test_a_named_function_is_called_exactly_once(client, model):
    """OpenAI forces exactly one call of a named function, whatever parallel_tool_calls says: the
    grammar allows one (this model, offered the one tool, calls it for both cities otherwise)."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(model=model, messages=TWO_CITIES, tools=TOOLS[:1], tool_choice=named, parallel_tool_calls=True,
              temperature=0, max_tokens=80)
    done, (calls, content, reason, _) = plain_and_streamed(client, **kw)
    c = done.choices[0]
    assert c.finish_reason == "stop" and reason == "stop" and c.message.content is None and content == ""
    assert [name for name, _ in _calls(c.message)] == ["get_weather"] and _streamed_calls(calls) == _calls(c.message)


def test_required_parallel_calls_are_bounded(client, model):
    """"required" with parallel calls: the grammar ends the list after MAX_PARALLEL_CALLS calls at
    the latest (this model repeats its call until the context ends otherwise), so the reply ends
    normally (tool_calls, not length); with parallel_tool_calls false exactly one call."""
    kw = dict(model=model, messages=TWO_CITIES, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=250)
    many, one = (r.choices[0] for r in parallel(lambda extra: client.chat.completions.create(**kw, **extra),
                                                [({},), ({"parallel_tool_calls": False},)]))
    assert many.finish_reason == "tool_calls" and many.message.content is None
    assert 2 <= len(many.message.tool_calls) <= MAX_PARALLEL_CALLS
    assert one.finish_reason == "tool_calls" and len(one.message.tool_calls) == 1


def test_a_tool_without_parameters_is_called_with_no_arguments(client, model):
    """A tool declared without parameters takes no arguments (OpenAI's reading): its arguments are
    "{}" (this model writes the schema's keys as arguments otherwise)."""
    now = [{"type": "function", "function": {"name": "get_time", "description": "The local time in a city"}}]
    kw = dict(model=model, messages=[{"role": "user", "content": "What time is it in Paris?"}], tools=now,
              tool_choice={"type": "function", "function": {"name": "get_time"}}, temperature=0, max_tokens=40)
    done, (calls, _, reason, _) = plain_and_streamed(client, **kw)
    assert _calls(done.choices[0].message) == [("get_time", "{}")] == _streamed_calls(calls)
    assert done.choices[0].finish_reason == "stop" == reason


@pytest.mark.parametrize("path,stream", [("/v1/chat/completions", False), ("/v1/chat/completions", True),
                                         ("/tokenize", False)])
@pytest.mark.parametrize("tool_call_id", [None, "missing", 7])
def test_a_tool_message_without_tool_call_id_is_a_400(server, path, stream, tool_call_id):
    """OpenAI answers 400 to a role "tool" message without a tool_call_id (a string); the error
    names messages[i].tool_call_id, before any SSE byte (and /tokenize's messages, which get a
    chat request's ids, the same)."""
    tool = {"role": "tool", "content": "18 C"} | ({} if tool_call_id == "missing" else {"tool_call_id": tool_call_id})
    messages = ASK + [{"role": "assistant", "content": "Let me look."}, tool]
    body = {"messages": messages} | ({"max_tokens": 4, "stream": stream, "tools": TOOLS} if path != "/tokenize" else {})
    err = assert_400_naming(server, path, body, "messages[2].tool_call_id")
    assert err["param"] == "messages[2].tool_call_id"


def _calling(*ids):
    """An assistant message calling get_weather once per id."""
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
        for i in ids]}


@pytest.mark.parametrize("path,stream", [("/v1/chat/completions", False), ("/v1/chat/completions", True),
                                         ("/tokenize", False)])
@pytest.mark.parametrize("messages,param,words", [
    (ASK + [{"role": "assistant", "content": "Let me look."}, {"role": "tool", "tool_call_id": "c1", "content": "18"}],
     "messages[2]", "must be a response to a preceding message with 'tool_calls'"),
    (ASK + [_calling("c1"), {"role": "tool", "tool_call_id": "c2", "content": "18"}],
     "messages[2].tool_call_id", "'c2' is not the id of a tool call of messages[1]"),
    (ASK + [_calling("c1", "c2"), {"role": "tool", "tool_call_id": "c1", "content": "18"}],
     "messages[1]", "The following tool_call_ids did not have response messages: c2"),
    (ASK + [_calling("c1"), {"role": "tool", "tool_call_id": "c1", "content": "18"},
            {"role": "tool", "tool_call_id": "c1", "content": "19"}],
     "messages[3].tool_call_id", "'c1': the call was answered already"),
    (ASK + [_calling("c1", "c2", "c1"), {"role": "tool", "tool_call_id": "c1", "content": "18"},
            {"role": "tool", "tool_call_id": "c2", "content": "19"}],
     "messages[1].tool_calls[2].id", "duplicate id 'c1'"),
    (ASK + [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get_weather", "arguments": {"city": "Paris"}}}]}, {"role": "tool", "tool_call_id": "c1", "content": "18"}],
     "messages[1].tool_calls[0].function.arguments", "must be a string (JSON text), got an object"),
    (ASK + [{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "get_weather"}}]}, {"role": "tool", "tool_call_id": "c1", "content": "18"}],
     "messages[1].tool_calls[0].function.arguments", "is missing"),
])
def test_tool_messages_must_answer_the_calls_before_them(server, path, stream, messages, param, words):
    """OpenAI's 400s: a tool message answers a call of the assistant message it follows, by one of
    its ids, and every call is answered, once; a message's call ids are distinct and its calls'
    arguments JSON text; before any SSE byte, and /tokenize's messages alike."""
    body = {"messages": messages} | ({"max_tokens": 4, "stream": stream, "tools": TOOLS} if path != "/tokenize" else {})
    err = assert_400_naming(server, path, body, param)
    assert err["param"] == param and words in err["message"]


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
    """A stop string that matches inside a call's arguments ends the reply there with stop, which
    under a named function a complete call's reply ends with too: no call (a client could not tell
    its arguments were cut), finish_reason stop, and content null: the text so far is the engine's
    grammar wrapper (``{"tool_calls": [{"name": ...``), not the model's, and OpenAI never answers a
    forced call with content; streamed and not the same. The official client's ``parse()`` (which
    refuses only length) has no cut arguments to validate; a complete call it parses."""
    from pydantic import BaseModel

    kw = dict(model=model, messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=80,
              stop=["Paris"])
    done, (calls, content, reason, _) = plain_and_streamed(client, **kw)
    c = done.choices[0]
    assert c.finish_reason == "stop" == reason and c.message.tool_calls is None and not calls
    assert c.message.content is None and content == ""

    class get_time(BaseModel):  # noqa: N801 (the tool's name)
        city: str

    parse = dict(model=model, messages=ASK, tools=[openai.pydantic_function_tool(get_time)], tool_choice=NAMED,
                 temperature=0, max_tokens=80)
    cut, whole = parallel(lambda extra: client.chat.completions.parse(**parse, **extra), [({"stop": ["Paris"]},), ({},)])
    assert cut.choices[0].finish_reason == "stop" and not cut.choices[0].message.tool_calls
    [call] = whole.choices[0].message.tool_calls
    assert whole.choices[0].finish_reason == "stop" and call.function.parsed_arguments == get_time(city="Paris")


@pytest.mark.parametrize("fields,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}, "tools[0].function.parameters"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "strang"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    # the grammar of all tools is refused: the field named is the tool whose schema does not compile
    ({"tools": [*TOOLS, {"type": "function", "function": {"name": "f", "parameters": {"type": "blah"}}}],
      "tool_choice": "required"}, f"tools[{len(TOOLS)}].function.parameters"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_tools_are_400s_naming_the_field(server, fields, param, stream):
    assert_400_naming(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 4, "stream": stream, **fields},
                      param)


@pytest.mark.parametrize("choice", ["sometimes", 42, ["auto"]])
def test_a_tool_choice_of_no_known_shape_says_which_shapes_are(server, choice):
    """Not pydantic's line per union member ("Input should be 'none', 'auto' or 'required';
    Input should be a valid dictionary"): the three words and the named-function object."""
    r = server.post("/v1/chat/completions", {"messages": ASK, "max_tokens": 4, "tools": TOOLS, "tool_choice": choice})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tool_choice" and err["message"].startswith(
        "tool_choice: must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}, got ")


@pytest.mark.parametrize("choice", [None, "required", "none"])
def test_tokenize_with_tools_gives_the_chat_requests_ids(server, choice):
    """vLLM's /tokenize takes the tools too: its ids are those of a chat request with the same
    messages, tools and tool_choice (the generic format's system prompt lists the tools); tools
    without messages are a 400 naming the field."""
    fields = {"tools": TOOLS} | ({"tool_choice": choice} if choice else {})
    tokenized = server.post("/tokenize", {"messages": ASK, **fields})
    assert tokenized.status_code == 200, tokenized.text
    chat = server.post("/v1/chat/completions", {"messages": ASK, "max_tokens": 1, "return_token_ids": True, **fields})
    assert chat.status_code == 200, chat.text
    assert tokenized.json()["tokens"] == chat.json()["prompt_token_ids"]
    if choice is None:  # the tools are in the prompt (the bundled template knows none: the generic format's)
        assert len(tokenized.json()["tokens"]) > len(server.post("/tokenize", {"messages": ASK}).json()["tokens"])
    assert_400_naming(server, "/tokenize", {"prompt": "hi", "tools": TOOLS}, "tools")
