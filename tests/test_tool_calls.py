"""Tool calling (monobatch.tool_calls): request checks, format detection, prompt rewriting, the
enforcing constraints (compiled and matched on the bundled tokenizer) and the streaming parser
(unit texts per format, hypothesis split-point properties, field cases G1 and G2)."""

from __future__ import annotations

import copy
import json
import re

import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from monobatch.errors import InvalidRequestError
from monobatch.tokenizer.chat_template import ChatTemplate
from monobatch.tool_calls import (MAX_PARALLEL_CALLS, ToolCallParser, ToolFormat, ToolSpec, check_tools,
                                  detect_format, generic_system_prompt, parse_tool_calls, prepare_messages,
                                  tool_constraint)

H, L, M, G = ToolFormat.HERMES, ToolFormat.LLAMA3_JSON, ToolFormat.MISTRAL, ToolFormat.GENERIC
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city"], "additionalProperties": False}}}
# pydantic-style: local $refs into $defs, which must still resolve once embedded in a bigger schema
MOVE = {"type": "function", "function": {
    "name": "move", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/Point"}}, "required": ["to"],
        "additionalProperties": False,
        "$defs": {"Point": {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                            "required": ["x", "y"], "additionalProperties": False}}}}}
TOOLS = [WEATHER, MOVE]
ID = re.compile(r"call_[A-Za-z0-9]{24}")


def spec(choice=None, parallel=None, tools=TOOLS):
    return check_tools(copy.deepcopy(tools), choice, parallel)


def stream(text, fmt, sp=None, cuts=None, reason="stop"):
    """Feed ``text`` cut at ``cuts`` (default: one character at a time), then flush with the engine's
    finish ``reason``; returns (content, calls, deltas)."""
    parser = ToolCallParser(sp or spec(), fmt)
    cuts = range(1, len(text)) if cuts is None else cuts
    bounds = [0, *sorted(set(c for c in cuts if 0 < c < len(text))), len(text)]
    deltas = [parser.feed(text[a:b]) for a, b in zip(bounds, bounds[1:])] + [parser.flush(reason)]
    assert "".join(d.content for d in deltas) == parser.content
    return parser.content, parser.tool_calls, [c for d in deltas for c in d.calls]


def pairs(calls):
    return [(c.name, json.loads(c.arguments)) for c in calls]


def call_text(fmt, calls, prefix="", ensure_ascii=False, indent=None, tag=False):
    """What a model of ``fmt`` writes for ``calls`` ([(name, args)])."""
    dump = lambda obj: json.dumps(obj, ensure_ascii=ensure_ascii, indent=indent)  # noqa: E731
    if fmt is H:
        body = "\n".join(f'<tool_call>\n{dump({"name": n, "arguments": a})}\n</tool_call>' for n, a in calls)
        return f"{prefix}\n{body}" if prefix else body
    if fmt is M:
        return prefix + "[TOOL_CALLS]" + dump([{"name": n, "arguments": a} for n, a in calls])
    if fmt is L:
        return ("<|python_tag|>" if tag else "") + "; ".join(dump({"name": n, "parameters": a}) for n, a in calls)
    return dump({"tool_calls": [{"name": n, "arguments": a} for n, a in calls]})


# -- check_tools ---------------------------------------------------------------------------------
def test_check_tools_normalizes():
    sp = check_tools([{"function": {"name": "ping"}}, WEATHER])
    assert sp.choice == "auto" and sp.parallel is True and sp.active
    assert sp.tools[0] == {"type": "function", "function": {"name": "ping", "parameters": {  # no arguments (OpenAI)
        "type": "object", "properties": {}, "additionalProperties": False}}}
    assert check_tools(None) == ToolSpec([], "none", True) and not check_tools([], "auto").active
    assert check_tools(TOOLS, {"type": "function", "function": {"name": "move"}}, False).choice == "move"
    named = check_tools(TOOLS, {"type": "function", "function": {"name": "move"}})
    assert [f["name"] for f in named.allowed] == ["move"] and len(named.tools) == 2
    assert check_tools(TOOLS, "none").active is False


@pytest.mark.parametrize("tools, choice, param, words", [
    ({"name": "x"}, None, "tools", "list"),
    (["x"], None, "tools[0]", "object"),
    ([{"type": "retrieval", "function": {"name": "x"}}], None, "tools[0].type", "type"),
    ([{"type": "function"}], None, "tools[0].function", "function must be an object"),
    ([{"type": "function", "function": {"name": ""}}], None, "tools[0].function.name", "name"),
    ([{"type": "function", "function": {"description": "no name"}}], None, "tools[0].function.name", "name"),
    ([WEATHER, WEATHER], None, "tools[1].function.name", "duplicate"),
    ([{"type": "function", "function": {"name": "x", "parameters": "{}"}}], None, "tools[0].function.parameters", "parameters"),
    ([{"type": "function", "function": {"name": "x", "parameters": []}}], None, "tools[0].function.parameters", "parameters"),
    ([{"type": "function", "function": {"name": "x", "description": 3}}], None, "tools[0].function.description", "description"),
    ([WEATHER, {"type": "function", "function": {"name": 'a b"}'}}], None, "tools[1].function.name", "OpenAI's rule"),
    ([{"type": "function", "function": {"name": "x" * 65}}], None, "tools[0].function.name", "1 to 64 characters"),
    ([{"type": "function", "function": {"name": "x", "parameters": {"type": "object", "properties": {
        "n": {"const": 2**60}}}}}], None, "tools[0].function.parameters", "2**53"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice", "nope"),
    (TOOLS, "sometimes", "tool_choice", "sometimes"),
    (TOOLS, "get_weather", "tool_choice", "get_weather"),  # a bare name is not OpenAI's named form
    (TOOLS, {"type": "function", "name": "move"}, "tool_choice", "function"),
    (TOOLS, {"type": "tool", "function": {"name": "move"}}, "tool_choice", "function"),
    (None, "required", "tool_choice", "needs tools"),
    ([], {"type": "function", "function": {"name": "move"}}, "tool_choice", "move"),
])
def test_check_tools_errors_name_their_field(tools, choice, param, words):
    with pytest.raises(InvalidRequestError) as err:
        check_tools(tools, choice)
    assert err.value.param == param and words in str(err.value)


def test_parallel_tool_calls_must_be_bool():
    with pytest.raises(InvalidRequestError) as err:
        check_tools(TOOLS, None, "yes")
    assert err.value.param == "parallel_tool_calls"


# -- detect_format -------------------------------------------------------------------------------
QWEN25 = ('{%- if tools %}{{- "<tools>" }}{%- for tool in tools %}{{- tool | tojson }}{%- endfor %}'
          '{{- "</tools>\\n\\nFor each function call, return a json object with function name and arguments within '
          '<tool_call></tool_call> XML tags" }}{%- endif %}{%- for message in messages %}'
          '{%- if message.role == "assistant" and message.tool_calls %}{{- "<|im_start|>assistant" }}'
          '{%- for tool_call in message.tool_calls %}{%- if tool_call.function is defined %}'
          '{%- set tool_call = tool_call.function %}{%- endif %}{{- "\\n<tool_call>\\n{\\"name\\": \\"" }}'
          '{{- tool_call.name }}{{- "\\", \\"arguments\\": " }}{{- tool_call.arguments | tojson }}'
          '{{- "}\\n</tool_call>" }}{%- endfor %}{{- "<|im_end|>\\n" }}'
          '{%- elif message.role == "tool" %}{{- "<|im_start|>user\\n<tool_response>\\n" + message.content + '
          '"\\n</tool_response><|im_end|>\\n" }}{%- else %}{{- "<|im_start|>" + message.role + "\\n" + message.content'
          ' + "<|im_end|>\\n" }}{%- endif %}{%- endfor %}')
LLAMA32 = ('{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}'
           '{{- \'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
           'value}.\' }}{%- for message in messages %}{%- if \'tool_calls\' in message %}'
           '{%- if not message.tool_calls|length == 1 %}{{- raise_exception("This model only supports single '
           'tool-calls at once!") }}{%- endif %}{%- set tool_call = message.tool_calls[0].function %}'
           '{{- \'{"name": "\' + tool_call.name + \'", "parameters": \' }}{{- tool_call.arguments | tojson }}'
           '{{- "}<|eot_id|>" }}{%- elif message.role == "tool" %}{{- "<|start_header_id|>ipython<|end_header_id|>'
           '\\n\\n" + message.content + "<|eot_id|>" }}{%- else %}{{- message.role + ": " + message.content + '
           '"<|eot_id|>" }}{%- endif %}{%- endfor %}')
LLAMA31 = '{{- "<|python_tag|>" + tool_call.name + ".call(" }}{%- if message.role == "ipython" %}{% endif %}'
MISTRAL = ('{%- for message in messages %}{%- if message.tool_calls is defined and message.tool_calls %}'
           '{{- "[TOOL_CALLS][" }}{%- for tool_call in message.tool_calls %}'
           '{%- if not tool_call.id is defined or tool_call.id|length != 9 %}{{- raise_exception("Tool call IDs '
           'should be alphanumeric strings with length 9!") }}{%- endif %}{{- {"name": tool_call.function.name, '
           '"arguments": tool_call.function.arguments, "id": tool_call.id} | tojson }}{%- endfor %}{{- "]</s>" }}'
           '{%- elif message.role == "tool" %}{{- \'[TOOL_RESULTS]{"call_id": "\' + message.tool_call_id + '
           '\'", "content": \' + message.content|tojson + "}[/TOOL_RESULTS]" }}{%- else %}'
           '{{- "[INST] " + message.content + "[/INST]" }}{%- endif %}{%- endfor %}')


@pytest.mark.parametrize("template, fmt", [
    (QWEN25, H), ("Hermes: <tools></tools> ... <tool_call>\n{...}\n</tool_call>", H),
    (LLAMA32, L), (LLAMA31, L), (MISTRAL, M), ("[AVAILABLE_TOOLS] ... [TOOL_CALLS]", M),
    ("{{ '[TOOL_CALLS]' + name + '[ARGS]' + arguments }}", G),  # Mistral's newer form: not parsed here
    ("<tool_call>\n<function=name>\n<parameter=x>", G),        # Qwen3-Coder XML: not parsed here
    ("{% for m in messages %}{{ m.content }}{% endfor %}", G), ("", G), (None, G),
])
def test_detect_format(template, fmt):
    assert detect_format(template) is fmt


def test_bundled_template_is_generic(loaded):
    assert detect_format(loaded.tokenizer.chat_template) is G


# -- prepare_messages ----------------------------------------------------------------------------
HISTORY = [
    {"role": "user", "content": "Weather in Paris and Rome? Then move."},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_abcdefghijklmnopqrstuvwx", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_abcdefghijklmnopqrstuvwx", "content": "18 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "21 C"}]},
    {"role": "assistant", "content": "Paris 18 C, Rome 21 C."},
]


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_prepare_messages_leaves_the_callers_dicts(fmt):
    messages = copy.deepcopy(HISTORY)
    prepare_messages(messages, spec(), fmt)
    assert messages == HISTORY


def test_prepare_hermes_renders_tools_and_dict_arguments():
    msgs, kwargs = prepare_messages(HISTORY, spec(), H)
    assert kwargs == {"tools": spec().tools}
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    text = ChatTemplate(QWEN25).render(msgs, **kwargs)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>' in text
    assert "<tool_response>\n21 C\n</tool_response>" in text and '"name": "move"' in text
    msgs_none, kwargs_none = prepare_messages(HISTORY, spec("none"), H)  # no tools, history still rendered
    assert kwargs_none == {} and msgs_none == msgs
    assert "<tools>" not in ChatTemplate(QWEN25).render(msgs_none, **kwargs_none)


def test_prepare_llama3_splits_parallel_history():
    msgs, kwargs = prepare_messages(HISTORY, spec(), L)
    assert [len(m.get("tool_calls", ())) for m in msgs] == [0, 1, 1, 0, 0, 0] and "tools" in kwargs
    text = ChatTemplate(LLAMA32).render(msgs, **kwargs)  # raises on a multi-call message
    assert '{"name": "get_weather", "parameters": {"city": "Rome"}}<|eot_id|>' in text


def test_prepare_mistral_ids_are_nine_alphanumerics():
    msgs, _ = prepare_messages(HISTORY, spec(), M)
    ids = [tc["id"] for tc in msgs[1]["tool_calls"]]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids) and ids[0] == "pqrstuvwx"
    assert [msgs[2]["tool_call_id"], msgs[3]["tool_call_id"]] == ids
    text = ChatTemplate(MISTRAL).render(msgs)  # the template raises on any other id
    assert '"arguments": {"city": "Paris"}' in text and f'"call_id": "{ids[1]}"' in text


def test_prepare_mistral_ids_stay_distinct_when_their_last_nine_collide():
    """``call_0_abcdefghijk`` and ``call_1_abcdefghijk`` share their last 9 alphanumerics: each
    gets a hash of the whole id instead (deterministic), the same in its call and its result."""
    calls = [{"id": f"call_{k}_abcdefghijk", "type": "function",
              "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}} for k in range(2)]
    history = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": None, "tool_calls": calls},
               {"role": "tool", "tool_call_id": "call_1_abcdefghijk", "content": "18 C"},
               {"role": "tool", "tool_call_id": "call_0_abcdefghijk", "content": "19 C"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {**calls[0], "id": "call_pqrstuvwx"}]},
               {"role": "tool", "tool_call_id": "call_pqrstuvwx", "content": "20 C"}]
    msgs, _ = prepare_messages(history, spec(), M)
    ids = [tc["id"] for tc in msgs[1]["tool_calls"]]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids) and len(set(ids)) == 2
    assert [msgs[2]["tool_call_id"], msgs[3]["tool_call_id"]] == ids[::-1]
    assert msgs[4]["tool_calls"][0]["id"] == msgs[5]["tool_call_id"] == "pqrstuvwx"  # no collision: as before
    assert prepare_messages(history, spec(), M)[0] == msgs
    ChatTemplate(MISTRAL).render(msgs)  # the template raises on any other id


def test_prepare_generic_on_the_bundled_template(loaded):
    sp = spec()
    msgs, kwargs = prepare_messages(HISTORY, sp, G)
    assert kwargs == {} and msgs[0] == {"role": "system", "content": generic_system_prompt(sp)}
    assert json.loads(msgs[2]["content"]) == {"tool_calls": [
        {"name": "get_weather", "arguments": {"city": "Paris"}},
        {"name": "get_weather", "arguments": {"city": "Rome"}}]}
    assert msgs[3]["role"] == "user" and [json.loads(line) for line in msgs[3]["content"].split("\n")] == [
        {"tool_response": {"id": "call_abcdefghijklmnopqrstuvwx", "name": "get_weather", "content": "18 C"}},
        {"tool_response": {"id": "call_2", "name": "get_weather", "content": "21 C"}}]
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant"]
    text = loaded.tokenizer.apply_chat_template(msgs, **kwargs)
    assert text.startswith("<|im_start|>system\nYou can call these tools") and '"name": "move"' in text
    assert '{"response": "<your reply>"}' in text and "SmolLM" not in text
    with_system = [{"role": "system", "content": "Be brief."}, *HISTORY]
    first = prepare_messages(with_system, spec("required", False), G)[0][0]
    assert first["content"].startswith("Be brief.\n\nYou can call") and "exactly one call" in first["content"]
    assert "You must call a tool" in first["content"] and '"response"' not in first["content"]
    none_msgs, _ = prepare_messages(HISTORY, spec("none"), G)
    assert none_msgs[0] == HISTORY[0] and none_msgs[1]["content"].startswith('{"tool_calls"')


def test_prepare_rejects_malformed_history():
    bad = [{"role": "assistant", "content": None, "tool_calls": [{"id": "x", "function": {"arguments": "{}"}}]}]
    with pytest.raises(InvalidRequestError) as err:
        prepare_messages(bad, spec(), H)
    assert err.value.param == "messages[0].tool_calls[0]"


# -- tool messages answer calls (chat_prompt.check_tool_results: OpenAI's rules) ------------------
def calling(*ids):
    """An assistant message calling get_weather once per id."""
    return {"role": "assistant", "content": None, "tool_calls": [
        {"id": i, "type": "function", "function": {"name": "get_weather", "arguments": "{}"}} for i in ids]}


def answer(call_id, content="18 C"):
    return {"role": "tool", "tool_call_id": call_id, "content": content}


ASKED, LATER = {"role": "user", "content": "Weather?"}, {"role": "user", "content": "And tomorrow?"}


@pytest.mark.parametrize("messages, param, words", [
    ([ASKED, answer("c1")], "messages[1]", "must be a response to a preceding message with 'tool_calls'"),
    ([ASKED, {"role": "assistant", "content": "Looking."}, answer("c1")], "messages[2]", "preceding message"),
    ([ASKED, calling("c1"), answer("c1"), LATER, answer("c1")], "messages[4]", "preceding message"),
    ([ASKED, calling("c1"), answer("c2")], "messages[2].tool_call_id", "'c2' is not the id of a tool call of "
                                                                        "messages[1] (its ids: c1)"),
    ([ASKED, calling("c1", "c2"), answer("c1")], "messages[1]",
     "must be followed by tool messages responding to each 'tool_call_id'. The following tool_call_ids did not "
     "have response messages: c2"),
    ([ASKED, calling("c1", "c2"), answer("c2"), LATER], "messages[1]", "response messages: c1"),
    ([ASKED, calling("c1"), LATER, answer("c1")], "messages[1]", "response messages: c1"),  # the first fault
    ([ASKED, calling("c1")], "messages[1]", "response messages: c1"),
    ([ASKED, calling("c1"), {"role": "tool", "content": "18 C"}], "messages[2].tool_call_id", "is missing"),
    ([ASKED, calling("c1"), answer(7)], "messages[2].tool_call_id", "must be a string"),
    ([ASKED, {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "get_weather"}}]}],
     "messages[1].tool_calls[0].id", "is missing"),
    ([ASKED, {"role": "assistant", "tool_calls": [{"id": 3, "function": {"name": "get_weather"}}]}],
     "messages[1].tool_calls[0].id", "must be a string"),
    ([ASKED, calling("c1"), answer("c1"), answer("c1")], "messages[3].tool_call_id", "answered already"),
    ([ASKED, {"role": "assistant", "tool_calls": [{"id": "c1", "type": "bogus", "function": {
        "name": "get_weather", "arguments": "{}"}}]}, answer("c1")], "messages[1].tool_calls[0].type", "'bogus'"),
    ([ASKED, calling("c1", "c2"), answer("c2"), answer("c1"), answer("c2")], "messages[4].tool_call_id",
     "'c2': the call was answered already (each call of messages[1] gets one tool message)"),
    ([ASKED, calling("c1", "c1"), answer("c1")], "messages[1].tool_calls[1].id", "duplicate id 'c1'"),
    ([ASKED, calling("c1", "c2", "c2"), answer("c1"), answer("c2")], "messages[1].tool_calls[2].id", "duplicate"),
    ([ASKED, {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "get_weather"}}]}, answer("c1")],
     "messages[1].tool_calls[0].function.arguments", "is missing"),
    *[([ASKED, {"role": "assistant", "tool_calls": [{"id": "c1", "function": {"name": "get_weather", "arguments": a}}]},
        answer("c1")], "messages[1].tool_calls[0].function.arguments", f"must be a string (JSON text), got {t}")
      for a, t in (({"city": "Paris"}, "an object"), ([], "an array"), (3, "a number"), (True, "a boolean"))],
])
def test_tool_messages_must_answer_the_calls_before_them(messages, param, words):
    from monobatch.chat_prompt import check_tool_results

    with pytest.raises(InvalidRequestError) as err:
        check_tool_results(messages)
    assert err.value.param == param and words in str(err.value)


def test_history_arguments_nested_past_the_recursion_limit_stay_text():
    """A client's history call whose arguments nest deeper than json's decoder can go (it raises
    RecursionError, not ValueError): the arguments stay the text the client sent, as any that do
    not parse as an object, never an error (a 500 on the server)."""
    from monobatch.chat_prompt import check_tool_results

    deep = "[" * 5000 + "]" * 5000
    history = [ASKED, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": deep}}]}, answer("c1")]
    check_tool_results(history)
    msgs, _ = prepare_messages(history, spec(), H)
    assert msgs[1]["tool_calls"][0]["function"]["arguments"] == deep


def test_answered_calls_pass_in_any_order():
    from monobatch.chat_prompt import check_tool_results

    check_tool_results([ASKED, calling("c1", "c2"), answer("c2"), answer("c1"), {"role": "assistant", "content": "ok"},
                        LATER, calling("c3"), answer("c3")])
    check_tool_results(HISTORY)
    check_tool_results([ASKED, {"role": "assistant", "content": "Hi", "tool_calls": []}, LATER])  # no calls
    check_tool_results([ASKED, calling("c1"), answer("c1"), LATER, calling("c1"), answer("c1")])  # another turn's


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_the_ids_we_give_calls_round_trip(fmt):
    """A reply's calls (ids from new_call_id) sent back with their tool results pass the checks as
    the client sent them, and every format renders that history (Mistral's 9-character rewrite comes
    after the check: its template gets the rewritten ids on both sides)."""
    from monobatch.chat_prompt import check_tool_results

    _, calls = parse_tool_calls(call_text(fmt, [PARIS, ORIGIN]), spec(), fmt, "stop")
    history = [ASKED, {"role": "assistant", "content": None, "tool_calls": [c.to_openai() for c in calls]},
               *(answer(c.id) for c in calls)]
    assert all(ID.fullmatch(c.id) for c in calls)
    check_tool_results(history)
    msgs, _ = prepare_messages(history, spec(), fmt)
    if fmt is M:
        ids = [tc["id"] for tc in msgs[1]["tool_calls"]]
        assert [m["tool_call_id"] for m in msgs[2:]] == ids and all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids)
        ChatTemplate(MISTRAL).render(msgs)  # raises on any other id


def test_every_chat_door_checks_tool_results(loaded):
    """The checks run in prepare_chat, which the server, /tokenize and LLM.chat share."""
    from monobatch.chat_prompt import prepare_chat
    from monobatch.llm import LLM

    bad = [ASKED, calling("c1"), answer("c2")]
    for door in (lambda: prepare_chat(loaded.tokenizer, bad), lambda: LLM(loaded=loaded).chat(bad, use_tqdm=False)):
        with pytest.raises(InvalidRequestError) as err:
            door()
        assert err.value.param == "messages[2].tool_call_id"


# -- constraints on the bundled tokenizer --------------------------------------------------------
@pytest.fixture(scope="module")
def compiler(loaded):
    from monobatch.engine.constraint import GrammarCompiler

    return GrammarCompiler(loaded.tokenizer, loaded.tokenizer.vocab_size)


def matches(compiler, tokenizer, so, text):
    """Whether every token of ``text`` is accepted and the matcher then accepts (may end)."""
    matcher = compiler.matcher(so)
    return all(matcher.accept(t) for t in tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting


PARIS = ("get_weather", {"city": "Paris", "unit": "c"})
ORIGIN = ("move", {"to": {"x": 0, "y": -3}})


@pytest.mark.parametrize("fmt", list(ToolFormat))
@pytest.mark.parametrize("parallel", [True, False])
def test_required_is_enforced(compiler, loaded, fmt, parallel):
    tok, so = loaded.tokenizer, tool_constraint(spec("required", parallel), fmt, loaded.tokenizer)
    assert so.kind == ("json_schema" if fmt is G else "lark") and so.param == "tools"
    compiler.compile(so)
    for calls in ([PARIS], [ORIGIN]):
        assert matches(compiler, tok, so, call_text(fmt, calls)), calls
        assert pairs(parse_tool_calls(call_text(fmt, calls), spec(), fmt, "stop")[1]) == calls
    assert matches(compiler, tok, so, call_text(fmt, [PARIS, ORIGIN])) is parallel
    for bad in ([("get_weather", {"city": 3})], [("get_weather", {"town": "Paris"})], [("fly", {})],
                [("move", {"to": {"x": 0}})]):
        assert not matches(compiler, tok, so, call_text(fmt, bad)), bad
    assert not matches(compiler, tok, so, "The weather is fine.")
    if fmt is G:  # the schema itself means the same to a JSON-schema validator
        jsonschema.validate(json.loads(call_text(fmt, [PARIS, ORIGIN][:1 + parallel])), json.loads(so.value))


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_named_function_is_enforced(compiler, loaded, fmt):
    named = spec({"type": "function", "function": {"name": "move"}}, False)
    so = tool_constraint(named, fmt, loaded.tokenizer)
    assert matches(compiler, loaded.tokenizer, so, call_text(fmt, [ORIGIN]))
    assert not matches(compiler, loaded.tokenizer, so, call_text(fmt, [PARIS]))


@pytest.mark.parametrize("fmt", list(ToolFormat))
@pytest.mark.parametrize("parallel", [True, False])
def test_named_function_allows_exactly_one_call(compiler, loaded, fmt, parallel):
    """OpenAI forces exactly one call of a named function, whatever parallel_tool_calls says."""
    named = spec({"type": "function", "function": {"name": "move"}}, parallel)
    so = tool_constraint(named, fmt, loaded.tokenizer)
    assert named.max_calls == 1
    assert matches(compiler, loaded.tokenizer, so, call_text(fmt, [ORIGIN]))
    assert not matches(compiler, loaded.tokenizer, so, call_text(fmt, [ORIGIN, ORIGIN]))
    if fmt is G:
        assert "exactly one call" in generic_system_prompt(named)


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_parallel_calls_are_bounded_and_may_end_after_each(compiler, loaded, fmt):
    """"required" with parallel calls: one to MAX_PARALLEL_CALLS calls, the grammar accepting
    (the end allowed) after each complete call; one more is refused."""
    tok, so = loaded.tokenizer, tool_constraint(spec("required", True), fmt, loaded.tokenizer)
    for n in (1, 2, MAX_PARALLEL_CALLS):
        assert matches(compiler, tok, so, call_text(fmt, [PARIS] * n)), n
    assert not matches(compiler, tok, so, call_text(fmt, [PARIS] * (MAX_PARALLEL_CALLS + 1)))
    if fmt is G:  # GENERIC's "auto" has the same bound
        auto = tool_constraint(spec("auto", True), fmt)
        assert matches(compiler, tok, auto, call_text(fmt, [PARIS] * MAX_PARALLEL_CALLS))
        assert not matches(compiler, tok, auto, call_text(fmt, [PARIS] * (MAX_PARALLEL_CALLS + 1)))


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_a_tool_without_parameters_takes_no_arguments(compiler, loaded, fmt):
    """OpenAI reads a missing ``parameters`` as a function without arguments: only ``{}``."""
    sp = spec("required", False, tools=[{"type": "function", "function": {"name": "now"}}])
    so = tool_constraint(sp, fmt, loaded.tokenizer)
    assert matches(compiler, loaded.tokenizer, so, call_text(fmt, [("now", {})]))
    for args in ({"city": "Paris"}, {"type": "object", "properties": {}}):
        assert not matches(compiler, loaded.tokenizer, so, call_text(fmt, [("now", args)])), args
    assert parse_tool_calls(call_text(fmt, [("now", {})]), sp, fmt, "stop")[1][0].arguments == "{}"


def test_generic_auto_is_calls_or_response(compiler, loaded):
    tok, so = loaded.tokenizer, tool_constraint(spec("auto"), G)
    assert matches(compiler, tok, so, '{"response": "It is \\"sunny\\" in Paris."}')
    assert matches(compiler, tok, so, call_text(G, [PARIS, ORIGIN]))
    assert not matches(compiler, tok, so, "It is sunny in Paris.")
    assert not matches(compiler, tok, so, '{"response": 3}')


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_no_constraint_for_none_and_free_auto(fmt):
    assert tool_constraint(spec("none"), fmt) is None and tool_constraint(None, fmt) is None
    assert tool_constraint(check_tools(None), fmt) is None
    assert (tool_constraint(spec("auto"), fmt) is None) is (fmt is not G)


def test_special_token_marker_is_matched_as_the_token(compiler, loaded):
    """A marker that is one special token of the vocabulary (Mistral's [TOOL_CALLS] is id 5 in
    its vocab) is matched as that token, not as its text. Here a stand-in tokenizer says the
    marker is special id 1 (the bundled vocab's <|im_start|>)."""
    class Stub:
        def encode(self, text, add_special_tokens=False):
            return [1] if text == "[TOOL_CALLS]" else [7, 8]

        def is_special(self, token_id):
            return token_id == 1

    so = tool_constraint(spec("required"), M, Stub())
    assert "<[1]>" in so.value
    body = call_text(M, [PARIS])[len("[TOOL_CALLS]"):]
    assert matches(compiler, loaded.tokenizer, so, "<|im_start|>" + body)
    assert not matches(compiler, loaded.tokenizer, so, "[TOOL_CALLS]" + body)


# -- parser: unit texts --------------------------------------------------------------------------
def test_hermes_content_and_calls():
    text = ('Let me check both.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "move", "arguments": {"to": {"x": 1, "y": 2}}}\n</tool_call>\n')
    content, calls = parse_tool_calls(text, spec(), H, "stop")
    assert content == "Let me check both." and pairs(calls) == [("get_weather", {"city": "Paris"}),
                                                                 ("move", {"to": {"x": 1, "y": 2}})]
    assert all(ID.fullmatch(c.id) for c in calls) and calls[0].id != calls[1].id
    assert calls[0].to_openai() == {"id": calls[0].id, "type": "function",
                                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    between = '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>\nNow the other.\n' \
              '<tool_call>\n{"name": "move", "arguments": {}}\n</tool_call>'
    assert parse_tool_calls(between, spec(), H, "stop")[0] == "Now the other."
    assert parse_tool_calls("A plain reply.\n", spec(), H, "stop") == ("A plain reply.\n", [])


def test_hermes_variants():
    # no arguments key, arguments as a JSON string, a missing close tag, a broken call kept as text
    assert pairs(parse_tool_calls('<tool_call>{"name": "ping"}</tool_call>', spec(), H, "stop")[1]) == [("ping", {})]
    text = '<tool_call>\n{"name": "move", "arguments": "{\\"to\\": 1}"}\n</tool_call>'
    assert pairs(parse_tool_calls(text, spec(), H, "stop")[1]) == [("move", {"to": 1})]
    content, calls = parse_tool_calls('<tool_call>\n{"name": "move", "arguments": {}}\nDone.', spec(), H, "stop")
    assert content == "Done." and len(calls) == 1
    content, calls = parse_tool_calls('x <tool_call> not json </tool_call> y', spec(), H, "stop")
    assert calls == [] and content == "x <tool_call> not json </tool_call> y"
    bad = '<tool_call>\n{"name": "move", "arguments": {"x": NaN}}\n</tool_call>'
    assert parse_tool_calls(bad, spec(), H, "stop") == (bad, [])


def test_mistral():
    text = '[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "move", "arguments": {}}]'
    content, calls = parse_tool_calls(text, spec(), M, "stop")
    assert content == "" and [c.name for c in calls] == ["get_weather", "move"]
    one = parse_tool_calls('Sure.[TOOL_CALLS]{"name": "move", "arguments": {"to": 1}}', spec(), M, "stop")
    assert one[0] == "Sure." and pairs(one[1]) == [("move", {"to": 1})]
    assert parse_tool_calls("[1, 2] are numbers", spec(), M, "stop") == ("[1, 2] are numbers", [])


def test_llama3_json():
    assert pairs(parse_tool_calls('{"name": "move", "parameters": {"to": 1}}', spec(), L, "stop")[1]) == [
        ("move", {"to": 1})]
    text = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}} ; {"name": "move", "parameters": {}}'
    assert [c.name for c in parse_tool_calls(text, spec(), L, "stop")[1]] == ["get_weather", "move"]
    for plain in ('{"name": "Bob", "parameters": {}}', '{"name": "move"}', "The answer is {1}.", '{"a": [1, 2]}'):
        assert parse_tool_calls(plain, spec(), L, "stop") == (plain, [])  # not a call: content, verbatim


def test_generic():
    content, calls = parse_tool_calls(call_text(G, [PARIS, ORIGIN], indent=2), spec(), G, "stop")
    assert content == "" and pairs(calls) == [PARIS, ORIGIN]
    escaped = '{"response": "Hi \\"you\\"\\n\\u00e9\\ud83d\\ude00"}'
    assert parse_tool_calls(escaped, spec(), G, "stop") == ('Hi "you"\né😀', [])
    for raw in ("Just text.", '{"answer": 42}', '{"response": 42}', "[1]"):
        assert parse_tool_calls(raw, spec(), G, "stop") == (raw, [])  # not the format: the raw text
    assert parse_tool_calls('{"response": "It is sunny', spec(), G, "stop") == ("It is sunny", [])
    tricky = '{"response": "a\\\\ud83d b \\ud83d\\ude00"}'  # an escaped backslash, then a real pair
    for cut in range(len(tricky) + 1):
        assert stream(tricky, G, cuts=[cut])[0] == "a\\ud83d b 😀", cut


def test_response_streams_as_it_comes():
    parser = ToolCallParser(spec(), G)
    assert parser.feed('{"response": "It is su').content == "It is su"
    assert parser.feed('nny \\u00').content == "nny "  # an escape is held until complete
    assert parser.feed('e9"}').content == "é" and parser.flush("stop").content == ""
    assert parser.content == "It is sunny é" and not parser.has_calls


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_no_tools_passes_everything_through(fmt):
    text = call_text(fmt, [PARIS], prefix="Hi <tool_ca")
    for sp in (spec("none"), check_tools(None), None):
        parser = ToolCallParser(sp, fmt)
        assert parser.feed(text).content == text and not parser.flush("stop") and parser.content == text
        assert not parser.has_calls


# -- field cases ----------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_g1_a_whole_call_in_one_piece(fmt):
    """G1: start marker, JSON and end marker arriving in ONE fed piece still give deltas with the
    full name and arguments (never empty arguments)."""
    parser = ToolCallParser(spec(), fmt)
    delta = parser.feed(call_text(fmt, [ORIGIN]))
    delta += parser.flush("stop")
    assert len(delta.calls) == 1 and delta.calls[0].name == "move" and ID.fullmatch(delta.calls[0].id)
    assert json.loads(delta.calls[0].arguments) == ORIGIN[1]
    assert delta.calls[0].arguments == parser.tool_calls[0].arguments
    assert delta.calls[0].to_openai()["function"] == {"name": "move", "arguments": delta.calls[0].arguments}


@pytest.mark.parametrize("fmt, text, content", [
    (H, "Let me look.\n<tool_ca", "Let me look."),
    (H, 'Done.<tool_call>\n{"name": "move", "arguments": {}}\n</tool_', "Done."),
    (M, "Calling [TOOL_CA", "Calling"),
    (L, "<|python_t", ""),
    (H, "a <", "a <"),  # one character is text, not a marker
])
def test_g2_flush_never_leaks_half_a_marker(fmt, text, content):
    """G2: the final flush drops a dangling partial control marker instead of emitting it."""
    for cuts in (None, []):
        assert stream(text, fmt, cuts=cuts)[0] == content


NAMED_WEATHER = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize("choice", ["auto", "required", NAMED_WEATHER])
@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_a_call_max_tokens_cut_after_its_name_keeps_its_cut_arguments(fmt, choice):
    """max_tokens (finish_reason length) that cut a call after its name gives the call, its
    arguments the text as far as it came (OpenAI's reply when max_tokens cuts a forced call; not
    JSON), and no content; streamed or not, the same call; the parser says the reply was cut."""
    full = call_text(fmt, [("get_weather", {"city": "Paris"})])
    cut = full[:full.index("Par") + 2]
    for cuts in (None, []):
        parser = ToolCallParser(spec(choice), fmt)
        content, calls, deltas = stream(cut, fmt, spec(choice), cuts=cuts, reason="length")
        assert [(c.name, c.arguments) for c in calls] == [("get_weather", '{"city": "Pa')] and content == ""
        assert [(d.index, d.id, d.name, d.arguments) for d in deltas] == [(0, calls[0].id, "get_weather",
                                                                           '{"city": "Pa')]
        parser.feed(cut)
        parser.flush("length")
        assert parser.cut


@pytest.mark.parametrize("choice", ["auto", "required", NAMED_WEATHER])
@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_a_call_a_stop_string_cut_is_no_call(fmt, choice):
    """A stop string that cut a call (finish_reason stop, which a complete call under a named
    function ends with too, so a client could not tell) gives no call, after its name or before
    it. Where a grammar forced the format (required, a named function, GENERIC's auto) its text is
    the engine's wrapper, not the model's: dropped, no content (OpenAI never answers a forced call
    with content); under auto in a model's own format it is content, markers included. Streamed or
    not, the same; the parser says the reply was cut (finish_reason is not tool_calls)."""
    full = call_text(fmt, [("get_weather", {"city": "Paris"})])
    forced = choice != "auto" or fmt is G
    for cut in (full[:full.index("Par") + 2], full[:full.index("get_wea") + 7]):
        parser = ToolCallParser(spec(choice), fmt)
        parser.feed(cut)
        assert parser.flush("stop").calls == [] and parser.tool_calls == [] and parser.cut
        assert parser.content == ("" if forced else cut)
        for cuts in (None, []):
            assert stream(cut, fmt, spec(choice), cuts=cuts)[:2] == (parser.content, [])


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_a_call_cut_before_its_name_is_no_call(fmt):
    """max_tokens inside the name: no call. Under a grammar (required, a named function, GENERIC's
    auto) the text is the format's wrapper: dropped, no content (the reply's content is null); under
    auto in a model's own format the model may have been writing text: it is content, verbatim (vLLM)."""
    full = call_text(fmt, [("get_weather", {"city": "Paris"})])
    cut = full[:full.index("get_wea") + 7]
    for choice in ("auto", "required"):
        parser = ToolCallParser(spec(choice), fmt)
        parser.feed(cut)
        parser.flush("length")
        forced = choice == "required" or fmt is G
        assert parser.tool_calls == [] and parser.cut and parser.content == ("" if forced else cut)
        assert stream(cut, fmt, spec(choice), reason="length")[:2] == (parser.content, [])


@pytest.mark.parametrize("fmt", [H, M, G])
def test_a_cut_wrapper_under_a_grammar_leaves_no_content(fmt):
    """Under "required" nothing but the format's text can come, so any unfinished wrapper (a marker,
    GENERIC's opening) max_tokens or a stop string cut is dropped at the end, and the reply counts
    as cut; a reply that ended after its calls is not cut."""
    full = call_text(fmt, [PARIS])
    for cut in (full[:1], full[:4], full[:full.index("{", 2 if fmt is G else 0) + 1]):
        for reason in ("length", "stop"):
            parser = ToolCallParser(spec("required"), fmt)
            parser.feed(cut)
            parser.flush(reason)
            assert (parser.content, parser.tool_calls, parser.cut) == ("", [], True), (cut, reason)
            assert stream(cut, fmt, spec("required"), reason=reason)[:2] == ("", [])
    whole = ToolCallParser(spec("required"), fmt)
    whole.feed(full + ("\n" if fmt is H else ""))
    whole.flush("stop")
    assert pairs(whole.tool_calls) == [PARIS] and not whole.cut and whole.content == ""


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_arguments_nested_past_the_recursion_limit_raise_nothing(fmt):
    """A model looping on "[" inside a call's arguments: json's decoder raises RecursionError past
    the interpreter's limit. Cut there (max_tokens), the call keeps its arguments' text as far as
    it came; closed, it is no call (its text is content, as any call that does not parse), never an
    error."""
    head = call_text(fmt, [("get_weather", {})])
    key = '"parameters": ' if fmt is L else '"arguments": '
    start = head.index(key) + len(key)
    deep = '{"x": ' + "[" * 5000
    content, calls, _ = stream(head[:start] + deep, fmt, spec("auto"), cuts=[], reason="length")
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", deep)] and content == ""
    closed = head[:start] + deep + "]" * 5000 + "}" + head[start + 2:]
    content, calls, _ = stream(closed, fmt, spec("auto"), cuts=[])
    assert calls == [] and deep in content


def _arguments_head(fmt):
    """A get_weather call of ``fmt`` up to its arguments' value ("arguments": / Llama's "parameters": )."""
    head = call_text(fmt, [("get_weather", {})])
    key = '"parameters": ' if fmt is L else '"arguments": '
    return head[:head.index(key) + len(key)]


@pytest.mark.parametrize("ensure_ascii", [False, True])
@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_cut_arguments_written_as_a_string_are_decoded(fmt, ensure_ascii):
    """Arguments the model wrote as a JSON string: a complete call's are the string's text, and so
    are a cut call's, as far as whole characters came (an escape, or a surrogate pair, cut in its
    middle is left out), at every cut point of the string."""
    inner = json.dumps({"city": 'Pa"r\\is é 😀\n', "unit": "c"}, ensure_ascii=False)
    literal = json.dumps(inner, ensure_ascii=ensure_ascii)
    head = _arguments_head(fmt)
    whole = call_text(fmt, [("get_weather", {})]).replace("{}", literal, 1)
    assert [(c.name, c.arguments) for c in stream(whole, fmt, spec("auto"), cuts=[])[1]] == [("get_weather", inner)]
    ends = [0]  # where each character of inner ends in the literal's body
    for ch in inner:
        ends.append(ends[-1] + len(json.dumps(ch, ensure_ascii=ensure_ascii)) - 2)
    for k in range(1, len(literal) + 1):
        body = literal[1:k]
        want = inner[:max(n for n, end in enumerate(ends) if end <= len(body))]
        content, calls, _ = stream(head + literal[:k], fmt, spec("auto"), cuts=[], reason="length")
        assert [(c.name, c.arguments) for c in calls] == [("get_weather", want)] and content == "", k
    cut = head + literal[:len(literal) // 2]
    assert stream(cut, fmt, spec("auto"), reason="length")[1][0].arguments == \
        stream(cut, fmt, spec("auto"), cuts=[], reason="length")[1][0].arguments


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_cut_arguments_with_nan_are_no_call_as_complete_ones(fmt):
    """NaN and Infinity are no JSON (the json module reads them): a complete call holding one is no
    call, and so is a cut one where the scanner met one before the cut, written as an object or
    inside a string; a finite number is a call either way."""
    head = _arguments_head(fmt)
    for bad in ('{"x": NaN, "city": "Pa', '{"x": [1, -Infinity], "city": "Pa', '{"x": Infinity}',
                '"{\\"x\\": NaN, \\"city\\": \\"Pa', '"{\\"x\\": NaN}"'):
        content, calls, _ = stream(head + bad, fmt, spec("auto"), cuts=[], reason="length")
        assert calls == [] and content == ("" if fmt is G else head + bad), bad
    closed = call_text(fmt, [("get_weather", {"x": 1})]).replace("1", "NaN")
    assert stream(closed, fmt, spec("auto"), cuts=[])[1] == []
    for good, args in (('{"x": 1.5, "city": "Pa', '{"x": 1.5, "city": "Pa'),
                       ('"{\\"x\\": 1e9, \\"city\\": \\"Pa', '{"x": 1e9, "city": "Pa')):
        calls = stream(head + good, fmt, spec("auto"), cuts=[], reason="length")[1]
        assert [(c.name, c.arguments) for c in calls] == [("get_weather", args)]


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_cut_arguments_follow_the_complete_calls_rules(fmt):
    """A complete call's arguments are an object, or a JSON string whose text is one; anything else
    is no call. A cut call's are held to the same as far as they came: a value that completed
    ("hello", [1, 2], 42, null, a string whose text is no object) is no call, and so is a cut one
    that can no longer begin an object ([1, , tru, a string whose text begins otherwise); an
    object's beginning, or nothing yet, is a call. No call: the text is content (auto in a model's
    own format) or nothing (the generic format's grammar)."""
    head = _arguments_head(fmt)
    for bad in ('"hello"', "[1, 2]", "42", "null", '"[1, 2]"', '"{\\"a\\": 1"', '"hello", "x": 1', "[1, 2] ",
                "[1, ", "tru", '"hel', '"  [1', '"\\u005b'):
        whole = call_text(fmt, [("get_weather", {})]).replace("{}", bad.rstrip(), 1)
        assert stream(whole, fmt, spec("auto"), cuts=[])[1] == [], bad  # closed: no call either
        for cuts in (None, []):
            content, calls, _ = stream(head + bad, fmt, spec("auto"), cuts=cuts, reason="length")
            assert calls == [] and content == ("" if fmt is G else head + bad), bad
    for good, args in (('"{\\"a\\": 1}"', '{"a": 1}'), ('"  {\\"a', '  {"a'), ('"', ""), ("", ""),
                       ('{"a": 1}', '{"a": 1}'), ('"\\u007b', "{"), ('{"a": [1, ', '{"a": [1, ')):
        for cuts in (None, []):
            calls = stream(head + good, fmt, spec("auto"), cuts=cuts, reason="length")[1]
            assert [(c.name, c.arguments) for c in calls] == [("get_weather", args)], good


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_a_lone_surrogate_escape_is_u_fffd_never_a_500(fmt):
    """JSON (and so a grammar) allows any \\uXXXX escape, and the json module decodes a high
    surrogate whose low half did not come ("\\ud83dx") to a lone surrogate, which no UTF-8 response
    carries (JSONResponse and the SSE encoding raised: a 500). Wherever the parser decodes a model's
    JSON string (a call's name and arguments, whole or cut, written as an object or a string, and
    GENERIC's response) a lone surrogate is U+FFFD, streamed and not alike; a pair stays one
    character, and a cut call's raw object text keeps the model's escape as written."""
    head, lone = _arguments_head(fmt), "\\ud83dx \\ud83d\\ude00"
    whole = call_text(fmt, [("get_weather", {"city": "@"})]).replace("@", lone)
    as_string = call_text(fmt, [("get_weather", {})]).replace("{}", json.dumps(json.dumps({"city": "@"})), 1)
    cases = [(whole, "stop", '{"city": "\ufffdx 😀"}'),
             (as_string.replace("@", lone), "stop", '{"city": "\ufffdx 😀"}'),  # escaped in the string's text
             (as_string.replace("@", lone.replace("\\", "\\\\")), "stop", '{"city": "\ufffdx 😀"}'),  # twice
             (head + '"{\\"city\\": \\"' + lone, "length", '{"city": "\ufffdx 😀'),  # the brief's probe
             (head + '"{\\"city\\": \\"\\ud83dx\\ud83d', "length", '{"city": "\ufffdx'),  # a pair may follow
             (head + '{"city": "' + lone, "length", '{"city": "' + lone)]  # raw text: the escape, as written
    for text, reason, arguments in cases:
        for choice in ("auto", "required"):
            for cuts in (None, []):
                content, calls, deltas = stream(text, fmt, spec(choice), cuts, reason)
                assert [(c.name, c.arguments) for c in calls] == [("get_weather", arguments)], (text, cuts)
                assert content == "" and [d.arguments for d in deltas] == [arguments]
                json.dumps([c.to_openai() for c in calls], ensure_ascii=False).encode("utf-8")
    if fmt is not L:  # a name no tool has: a call only where no names are checked
        named = whole.replace('"get_weather"', '"get_\\ud83d"')
        assert [c.name for c in stream(named, fmt, spec("auto"))[1]] == ["get_\ufffd"]
    if fmt is G:
        reply = '{"response": "a\\ud83dx b\\ud83d\\ude00 \\udc00"}'
        for cuts in (None, []):
            assert stream(reply, G, spec("auto"), cuts)[:2] == ("a\ufffdx b😀 \ufffd", [])


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_a_further_call_cut_mid_json_keeps_the_complete_ones(fmt):
    """A reply cut inside its second call's name: the first call stays a call, the cut one is no
    call (max_tokens or a stop string: content under auto in a model's own format, nothing under a
    grammar), and the parser says the reply was cut (so finish_reason is not "tool_calls"); a whole
    reply is not cut."""
    full = call_text(fmt, [PARIS, ORIGIN])
    cut = full[:full.index('"move"') + 3]
    for choice in ("auto", "required"):
        for reason in ("length", "stop"):
            dropped = choice == "required" or fmt is G
            for pieces in ([cut], list(cut)):  # whole, and one character at a time
                parser = ToolCallParser(spec(choice), fmt)
                for piece in pieces:
                    parser.feed(piece)
                parser.flush(reason)
                assert pairs(parser.tool_calls) == [PARIS] and parser.cut
                if dropped:
                    assert parser.content == ""
                else:
                    assert parser.content.endswith('"mo') and '"get_weather"' not in parser.content
        whole = ToolCallParser(spec(choice), fmt)
        whole.feed(full)
        whole.flush("stop")
        assert pairs(whole.tool_calls) == [PARIS, ORIGIN] and not whole.cut


@pytest.mark.parametrize("engine, calls, cut, choice, want", [
    ("stop", True, False, "required", "tool_calls"),
    ("stop", True, False, "auto", "tool_calls"),
    ("length", True, False, "required", "length"),  # max_tokens after complete calls: still cut
    ("length", True, True, "required", "length"),   # max_tokens inside a further call
    ("stop", True, True, "required", "stop"),       # a stop string inside a further call
    ("stop", True, False, {"type": "function", "function": {"name": "move"}}, "stop"),  # OpenAI: named -> stop
    ("length", True, False, {"type": "function", "function": {"name": "move"}}, "length"),
    ("stop", False, False, "auto", "stop"),
    ("length", False, True, "required", "length"),
])
def test_finish_reason_is_tool_calls_only_after_a_normal_end(engine, calls, cut, choice, want):
    from monobatch.chat_prompt import ChatPrompt

    assert ChatPrompt([1], spec(choice), G, None, False).finish_reason(engine, calls, cut) == want


# -- parser: properties over split points ---------------------------------------------------------
KEYS = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=6)
NASTY = st.sampled_from(['"', "\\", "{", "}", "[", "]", "</tool_call>", "<tool_call>", "[TOOL_CALLS]",
                         "<|python_tag|>", ";", ",", "\n", "é", "😀", "\u2028", "\x00"])
STRINGS = st.lists(NASTY | st.text(max_size=4), max_size=5).map("".join)
SCALARS = (STRINGS | st.integers(-10**6, 10**6) | st.booleans() | st.none()
           | st.floats(allow_nan=False, allow_infinity=False))
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(KEYS, inner, max_size=3),
                      max_leaves=8)
ARGS = st.dictionaries(KEYS, VALUES, max_size=4)
NAMES = st.from_regex(r"[a-z_][a-z0-9_]{0,8}", fullmatch=True)
PREFIX = st.text(st.characters(exclude_characters="<[{"), max_size=12)


@st.composite
def replies(draw):
    fmt = draw(st.sampled_from(list(ToolFormat)))
    names = draw(st.lists(NAMES, min_size=1, max_size=3, unique=True))
    calls = draw(st.lists(st.tuples(st.sampled_from(names), ARGS), min_size=1, max_size=3))
    sp = check_tools([{"type": "function", "function": {"name": n}} for n in names])
    text = call_text(fmt, calls, prefix=draw(PREFIX), ensure_ascii=draw(st.booleans()),
                     indent=draw(st.sampled_from([None, 1])), tag=draw(st.booleans()))
    cuts = draw(st.lists(st.integers(1, max(1, len(text) - 1)), max_size=12))
    return fmt, sp, calls, text, cuts


PROPERTY = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(replies())
def test_streamed_equals_whole_text_parse(case):
    """Whatever the split points: the joined content and each call's joined argument pieces equal
    the one-piece parse, and the arguments are JSON equal to the generated objects."""
    fmt, sp, calls, text, cuts = case
    whole_content, whole_calls = parse_tool_calls(text, sp, fmt, "stop")
    content, got, deltas = stream(text, fmt, sp, cuts)
    assert content == whole_content and [(c.name, c.arguments) for c in got] == [(c.name, c.arguments)
                                                                                  for c in whole_calls]
    assert pairs(got) == calls
    for i, call in enumerate(got):
        mine = [d for d in deltas if d.index == i]
        assert mine[0].id == call.id and mine[0].name == call.name and all(d.id is None for d in mine[1:])
        assert "".join(d.arguments for d in mine) == call.arguments
    assert "<tool_call>" not in content and "[TOOL_CALLS]" not in content


@PROPERTY
@given(replies(), st.data())
def test_a_cut_call(case, data):
    """Cut by max_tokens anywhere inside the first call's JSON, whatever the split points: after its
    name, the call with its arguments' text as far as it came (the whole value once it was
    complete), the text before it the content; before, no call and the text verbatim as content
    (auto in a model's own format) or nothing (under GENERIC's grammar). Cut by a stop string: no
    call, the text verbatim as content, or nothing under GENERIC's grammar."""
    fmt, sp, calls, text, cuts = case
    start = text.index("{", text.index("[TOOL_CALLS]") if fmt is M else 1 if fmt is G else 0)
    end = json.JSONDecoder().raw_decode(text, start)[1]
    cut = text[:data.draw(st.integers(start + 1, end - 1))]
    cuts = [c for c in cuts if c < len(cut)]
    assert stream(cut, fmt, sp, cuts, reason="stop")[:2] == ("" if fmt is G else cut, [])
    content, got, deltas = stream(cut, fmt, sp, cuts, reason="length")
    name, args = calls[0]
    head = f'"name": {json.dumps(name)}'
    name_end = text.index(head, start) + len(head)
    if len(cut) >= name_end:
        key = '"parameters": ' if fmt is L else '"arguments": '
        value = text.index(key, start) + len(key)
        value_end = json.JSONDecoder().raw_decode(text, value)[1]
        want = cut[value:value_end] if len(cut) > value else ""
        before = parse_tool_calls(text, sp, fmt, "stop")[0]  # the text before the calls (HERMES, MISTRAL)
        assert [(c.name, c.arguments) for c in got] == [(name, want)] and content == before
        assert [(d.name, d.arguments) for d in deltas] == [(name, want)]
    else:
        assert got == [] and deltas == [] and content == ("" if fmt is G else cut)


@settings(max_examples=100, deadline=None)
@given(STRINGS, st.booleans(), st.lists(st.integers(1, 60), max_size=10))
def test_generic_response_streams_exactly(reply, ascii_only, cuts):
    text = json.dumps({"response": reply}, ensure_ascii=ascii_only)
    assert stream(text, G, cuts=cuts)[:2] == (reply, [])


# -- end to end on the bundled model ---------------------------------------------------------------
@pytest.mark.usefixtures("one_cpu_thread")
def test_bundled_model_calls_a_tool_under_the_generic_constraint(loaded):
    """SmolLM2 (GENERIC): with "required" the greedy reply is a valid call of an allowed tool;
    with "auto" it is one of GENERIC's two forms, and either way the parser takes it apart."""
    from monobatch.engine.params import SamplingParams
    from monobatch.llm import LLM

    llm, tok = LLM(loaded=loaded), loaded.tokenizer
    fmt = detect_format(tok.chat_template)
    for choice in ("required", "auto"):
        sp = spec(choice, False, tools=[WEATHER])
        messages, kwargs = prepare_messages([{"role": "user", "content": "What is the weather in Paris?"}], sp, fmt)
        params = SamplingParams(temperature=0, max_tokens=60, structured=tool_constraint(sp, fmt, tok))
        out = llm.generate([tok.apply_chat_template(messages, **kwargs)], params, use_tqdm=False)[0].outputs[0]
        assert out.finish_reason == "stop", out.text
        content, calls, _ = stream(out.text, fmt, sp)
        if choice == "required" or calls:
            assert content == "" and [c.name for c in calls] == ["get_weather"]
            jsonschema.validate(json.loads(calls[0].arguments), WEATHER["function"]["parameters"])
        else:
            assert content == json.loads(out.text)["response"] and content


@pytest.mark.usefixtures("one_cpu_thread")
def test_llm_chat_returns_a_forced_call_cut_by_max_tokens(loaded):
    """LLM.chat parses as the chat endpoint does (one chat_output): max_tokens inside a required
    call's arguments gives the call, its arguments the raw text after '"arguments": '; inside its
    name, no call; a stop string inside its arguments, no call (finish_reason stop)."""
    from monobatch.engine.params import SamplingParams
    from monobatch.llm import LLM

    llm, ask = LLM(loaded=loaded), [{"role": "user", "content": "What is the weather in Paris?"}]
    cut, early, stopped = (llm.chat(ask, SamplingParams(temperature=0, max_tokens=n, stop=stop), tools=[WEATHER],
                                    tool_choice="required", use_tqdm=False)[0].outputs[0]
                           for n, stop in ((20, []), (12, []), (60, ["Paris"])))
    assert cut.finish_reason == "length" and early.finish_reason == "length"
    assert stopped.finish_reason == "stop" and stopped.tool_calls == [] and stopped.text.endswith('"city": "')
    key = '"arguments": '
    assert key in cut.text and not cut.text.endswith("}")
    args = cut.text[cut.text.index(key) + len(key):]
    assert [(c.name, c.arguments) for c in cut.tool_calls] == [("get_weather", args)]
    assert early.tool_calls == [] and '"get_weather"' not in early.text


def test_tool_history_without_tools_renders_in_the_generic_format(loaded):
    """A tool history sent without ``tools`` (vLLM's clients do) is rendered as the tool format
    renders history — for the bundled SmolLM2, whose template knows no tools, the generic JSON —
    instead of failing in the template on an assistant message with ``content: None``."""
    from monobatch.chat_prompt import prepare_chat

    tok = loaded.tokenizer
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "18C"}]
    prompt = prepare_chat(tok, messages)
    text = tok.decode(prompt.prompt_ids, skip_special_tokens=False)
    assert '{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}' in text
    assert '"tool_response": {"id": "c1", "name": "get_weather", "content": "18C"}' in text
    assert prompt.tools.choice == "none" and prompt.structured is None  # no tools offered: none constrained


@pytest.mark.parametrize("fmt", [H, M, L])
def test_calls_past_the_bound_are_dropped_where_no_grammar_ran(fmt):
    """auto in a model's own format runs without a grammar: a reply with more calls than the
    request allows (parallel_tool_calls false: one) reports the first ones only, streamed or not."""
    text = call_text(fmt, [PARIS, ORIGIN, PARIS])
    assert pairs(parse_tool_calls(text, spec("auto", True), fmt, "stop")[1]) == [PARIS, ORIGIN, PARIS]
    one = spec("auto", False)
    assert one.max_calls == 1
    content, calls = parse_tool_calls(text, one, fmt, "stop")
    assert pairs(calls) == [PARIS] and content == ""
    _, streamed, deltas = stream(text, fmt, one)
    assert pairs(streamed) == [PARIS] and {d.index for d in deltas} == {0}


def test_a_further_call_whose_marker_was_cut_counts_as_cut():
    """A reply ending inside a further call's marker (a stop string, EOS) after complete calls:
    the partial marker is dropped (G2) and the reply counts as cut (finish_reason is not tool_calls)."""
    parser = ToolCallParser(spec(), H)
    parser.feed(call_text(H, [PARIS]) + "\n<tool_ca")
    parser.flush("stop")
    assert pairs(parser.tool_calls) == [PARIS] and parser.cut and parser.content == ""
    alone = ToolCallParser(spec(), H)  # no call before: a dangling partial marker is just dropped
    alone.feed("Sure.\n<tool_ca")
    alone.flush("stop")
    assert not alone.cut and alone.content == "Sure."


@pytest.mark.parametrize("tools", [None, "auto"])
def test_chat_reply_flush_needs_the_finish_reason(tools):
    """ChatReply.flush ends the reply: it needs the engine's finish_reason, which decides what held
    call text becomes (max_tokens: the cut call; a stop string: content here, auto in Hermes). None
    (no reason: the reply has not ended) is refused, never taken as "do not flush the calls", which
    dropped the held text silently."""
    from monobatch.chat_output import ChatReply, split_reply

    cut = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa'
    sp = spec(tools) if tools else None
    with pytest.raises(TypeError, match="finish_reason"):
        reply = ChatReply(tools=sp, fmt=H)
        reply.feed(cut)
        reply.flush(None)
    if tools:
        out, reply = split_reply(cut, "length", tools=sp, fmt=H)
        assert out.content == "Sure." and [(c.name, c.arguments) for c in reply.tool_calls] == [
            ("get_weather", '{"city": "Pa')] and [c.arguments for c in out.tool_calls] == ['{"city": "Pa']
        out, reply = split_reply("<think>hm</think>" + cut, "stop", tools=sp, fmt=H)
        assert (out.reasoning, out.content, reply.tool_calls, reply.cut_call) == ("hm", cut, [], True)


def test_an_agents_tool_set_fits_and_an_oversized_one_is_refused_before_its_grammar():
    """A tool-call grammar may be larger than one schema (MAX_TOOLS_SPEC_CHARS, not the 64 KiB of
    MAX_SPEC_CHARS): 300 tools constrain "auto" for a template that knows no tools; a tool list
    whose JSON is over the limit is refused by check_tools, before any grammar is built."""
    from monobatch.engine.constraint import MAX_SPEC_CHARS, MAX_TOOLS_SPEC_CHARS

    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}}}} for i in range(300)]
    so = tool_constraint(check_tools(tools, "auto"), ToolFormat.GENERIC)
    assert MAX_SPEC_CHARS < len(so.value) <= MAX_TOOLS_SPEC_CHARS and so.param == "tools"
    huge = tools * (MAX_TOOLS_SPEC_CHARS // len(json.dumps(tools)) + 1)
    with pytest.raises(InvalidRequestError, match="fewer tools") as err:
        check_tools(huge, "auto")
    assert err.value.param == "tools"
