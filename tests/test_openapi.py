"""/openapi.json describes the server: its shape (no 422, one error schema, the real content
types, the engine's ranges, null = absent, refused unknown fields), and a bounded schemathesis run
against a real `monobatch serve` that fails on any 5xx, undocumented status code or content type,
or response (JSON or server-sent events) that does not match its schema.

The run is derandomized and learns nothing from responses (the same requests every run of the
same code and test selection: Hypothesis also mixes in constants of the project modules already
imported): positive and negative data, MAX_EXAMPLES per operation and mode. A ``map_body`` hook keeps generation
requests cheap and mostly valid (see ``_cheap``): what it changes stays inside the document, so
positive data stays positive.
"""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest

from server_util import Server, start_server

schemathesis = pytest.importorskip("schemathesis")

from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.core.failures import FailureGroup  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

#: A small batch, one CPU thread (the test process and the server share 2 cores), and a context that
#: fits most generated conversations (fuzzed text is mostly multi-byte: several tokens a character).
ARGS = ("-t", "1", "-c", "1024", "--max-num-seqs", "4")
MAX_TOKENS = 3
#: Examples per operation and generation mode (positive, negative).
MAX_EXAMPLES = 12
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
GENERATION = ("/v1/completions", "/v1/chat/completions")


def _app(**settings):
    from monobatch.server import ServerSettings, create_app

    def never():  # the model never loads here: the document's static part
        raise AssertionError("not loaded in these tests")

    return create_app(ServerSettings(**settings), never)


def _walk(node):
    """Every dict inside ``node``."""
    if isinstance(node, dict):
        yield node
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for item in node:
            yield from _walk(item)


def _property(doc: dict, model: str, name: str) -> dict:
    return doc["components"]["schemas"][model]["properties"][name]


def _number_branch(prop: dict) -> dict:
    return next(b for b in prop.get("anyOf", [prop]) if b.get("type") != "null")


# -- the document's shape (no server) ----------------------------------------------------------------
def test_document_has_no_422_and_one_error_schema():
    doc = _app().openapi()
    assert '"422"' not in json.dumps(doc) and "HTTPValidationError" not in doc["components"]["schemas"]
    for path, methods in doc["paths"].items():
        for method, op in methods.items():
            errors = {code: r for code, r in op["responses"].items() if code[0] in "45"}
            assert {"413", "500"} <= set(errors), (method, path)
            for response in errors.values():
                assert response["content"] == {
                    "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}
    detail = doc["components"]["schemas"]["ErrorDetail"]
    assert set(detail["required"]) == {"message", "type", "param", "code"}


def test_document_content_types_and_statuses():
    doc = _app().openapi()
    ops = {path: next(iter(methods.values())) for path, methods in doc["paths"].items()}
    for path in GENERATION:
        ok = ops[path]["responses"]["200"]["content"]
        assert set(ok) == {"application/json", "text/event-stream"}
        assert set(ops[path]["responses"]) == {"200", "400", "404", "413", "500", "503"}  # no --api-key, --max-queue
    assert set(ops["/metrics"]["responses"]["200"]["content"]) == {"text/plain"}
    assert "503" not in ops["/metrics"]["responses"]
    assert set(ops["/health"]["responses"]) == {"200", "413", "500", "503"}
    locked = _app(api_key="k", max_queue=2).openapi()
    assert locked["components"]["securitySchemes"]["bearer"] == {
        "type": "http", "scheme": "bearer", "description": "--api-key / $MONOBATCH_API_KEY"}
    for path, methods in locked["paths"].items():
        op = next(iter(methods.values()))
        open_path = path in ("/health", "/metrics")
        assert ("401" in op["responses"]) is not open_path and ("security" in op) is not open_path, path
        assert ("429" in op["responses"]) is (path in GENERATION), path


def test_the_chat_delta_description_covers_a_first_tool_call():
    """ChatDelta's description (its docstring) says what the streamed role chunk holds: empty
    content, or with tools content null beside a first tool call (not "always empty content")."""
    text = " ".join(_app().openapi()["components"]["schemas"]["ChatDelta"]["description"].split())
    assert "with empty content" in text and "content null beside a first tool call" in text


def test_request_schemas_carry_the_engines_ranges_and_nulls():
    doc = _app().openapi()
    for model in ("CompletionRequest", "ChatCompletionRequest", "TokenizeRequest", "DetokenizeRequest",
                  "StreamOptions"):
        schema = doc["components"]["schemas"][model]
        assert schema["additionalProperties"] is False, model
        if model == "DetokenizeRequest":  # does not drop nulls: only its optional field accepts one
            continue
        for name, prop in schema["properties"].items():
            if name not in schema.get("required", ()):
                assert prop.get("type") == "null" or {"type": "null"} in prop.get("anyOf", []), (model, name)
    expected = {"temperature": {"minimum": 0, "maximum": 2}, "top_p": {"minimum": 0, "maximum": 1},
                "min_p": {"minimum": 0, "maximum": 1}, "typical_p": {"exclusiveMinimum": 0, "maximum": 1},
                "presence_penalty": {"minimum": -2, "maximum": 2}, "frequency_penalty": {"minimum": -2, "maximum": 2},
                "repeat_penalty": {"exclusiveMinimum": 0}, "repetition_penalty": {"exclusiveMinimum": 0},
                "top_k": {"minimum": -1}, "seed": {"minimum": -1, "exclusiveMaximum": 2**63},
                "n": {"minimum": 1, "maximum": 128}, "max_tokens": {"minimum": 0}, "min_tokens": {"minimum": 0},
                "dry_base": {"minimum": 1}}
    for model in ("CompletionRequest", "ChatCompletionRequest"):
        for name, bounds in expected.items():
            branch = _number_branch(_property(doc, model, name))
            assert {k: branch.get(k) for k in bounds} == bounds, (model, name)
    assert _number_branch(_property(doc, "CompletionRequest", "logprobs"))["maximum"] == 20
    assert _number_branch(_property(doc, "ChatCompletionRequest", "top_logprobs"))["maximum"] == 20
    bias = _number_branch(_property(doc, "CompletionRequest", "logit_bias"))["additionalProperties"]
    assert (bias["minimum"], bias["maximum"]) == (-100, 100)
    assert _property(doc, "CompletionRequest", "best_of")["type"] == "null"  # refused unless null
    assert _property(doc, "ChatCompletionRequest", "functions")["type"] == "null"
    chat = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert chat["verbosity"]["type"] == "null" and chat["reasoning_effort"]["type"] == "null"
    assert _number_branch(chat["store"]) == {"const": False, "type": "boolean"}  # accepted values only
    assert _number_branch(chat["service_tier"])["enum"] == ["auto", "default"]
    assert _number_branch(chat["modalities"]) == {"type": "array", "items": {"const": "text", "type": "string"},
                                                  "minItems": 1, "maxItems": 1}
    meta = _number_branch(chat["metadata"])
    assert (meta["maxProperties"], meta["propertyNames"]["maxLength"], meta["additionalProperties"]["maxLength"]) \
        == (16, 64, 512)
    assert _number_branch(chat["safety_identifier"])["maxLength"] == 128
    assert "store" not in doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert not any("x-monobatch" in node for node in _walk(doc))  # markers filled or dropped


def test_refused_and_null_fields_match_the_validation():
    """What the schema says about null and refused fields is what the models do."""
    from pydantic import ValidationError

    from monobatch.server.protocol import ChatCompletionRequest, CompletionRequest, StreamOptions

    body = {"prompt": "x", "stream": None, "n": None, "echo": None, "best_of": None, "cache_prompt": None}
    assert CompletionRequest.model_validate(body).n == 1
    assert StreamOptions.model_validate({"include_usage": None}).include_usage is False
    chat = {"messages": [{"role": "user", "content": "x"}], "logprobs": None, "add_generation_prompt": None}
    assert ChatCompletionRequest.model_validate(chat).add_generation_prompt is True
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": "x", "best_of": 2})
    whole = CompletionRequest.model_validate({"prompt": [1.0, 2], "n": 2.0, "max_tokens": 3.0, "seed": 7.0})
    assert (whole.prompt, whole.n, whole.max_tokens, whole.seed) == ([1, 2], 2, 3, 7)  # JSON Schema's integers
    for bad in ({"n": 2.5}, {"n": "2"}, {"n": True}, {"max_tokens": -1.0}):
        with pytest.raises(ValidationError):
            CompletionRequest.model_validate({"prompt": "x", **bad})


# -- schemathesis against a real server -----------------------------------------------------------------
@pytest.fixture(scope="module")
def server() -> Server:
    server = start_server(*ARGS)
    yield server
    server.stop()


#: Fields that each bring an output constraint (at most one per request, a 400 otherwise).
CONSTRAINTS = ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar", "json_schema", "grammar", "tools")
MESSAGE_KEYS = ("role", "content", "tool_calls", "tool_call_id", "name")


def _int(value) -> bool:
    """A JSON integer (``2`` or ``2.0``; not ``true``)."""
    return (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer())


def _answer_calls(messages: list) -> list:
    """Tool messages answer the calls before them (OpenAI's rules, which a schema cannot state): a
    message's call ids are made distinct, each assistant message's calls get one answer each right
    after it, in place of the tool messages there, and a tool message that answers nothing becomes
    a user message. Values of a wrong type are left alone (negative cases)."""
    out, answering = [], False
    for m in messages:
        if isinstance(m, dict) and m.get("role") == "tool" and isinstance(m.get("tool_call_id"), str):
            if not answering:
                out.append({**{k: v for k, v in m.items() if k != "tool_call_id"}, "role": "user"})
            continue
        answering = False
        calls = m.get("tool_calls") if isinstance(m, dict) and m.get("role") == "assistant" else None
        if isinstance(calls, list) and calls and all(isinstance(c, dict) and isinstance(c.get("id"), str)
                                                     for c in calls):
            calls = [c if all(c["id"] != d["id"] for d in calls[:k]) else {**c, "id": f"{c['id']}#{k}"}
                     for k, c in enumerate(calls)]
            out += [{**m, "tool_calls": calls}, *({"role": "tool", "tool_call_id": c["id"], "content": "ok"}
                                                  for c in calls)]
            answering = True
        else:
            out.append(m)
    return out


def _cheap(body, chat: bool):
    """A generated body that stays cheap: at most MAX_TOKENS tokens per choice (min_tokens no
    more), n <= 2, at most 2 prompts, 3 messages (without extra keys; tool calls answered:
    :func:`_answer_calls`) and one tool, at most one constraint field (rules the schema cannot
    state). Values of a wrong type are left alone: they are the negative cases."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    keys = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    limit = None
    for key in keys:
        value = body.get(key)
        if _int(value):
            body[key] = min(int(value), MAX_TOKENS)
            limit = body[key] if limit is None else limit  # max_completion_tokens wins
        elif value is not None:
            limit = limit if limit is not None else -1  # a wrong type: a 400 before anything runs
    if limit is None:
        body["max_tokens"] = limit = MAX_TOKENS
    if _int(body.get("min_tokens")) and limit >= 0:
        body["min_tokens"] = min(int(body["min_tokens"]), limit)
    if _int(body.get("n")):
        body["n"] = min(int(body["n"]), 2)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and not _int(prompt[0]):
        body["prompt"] = prompt[:2]
    messages = body.get("messages")
    if isinstance(messages, list):  # short conversations: a long one is only a context_length_exceeded 400
        body["messages"] = _answer_calls([{k: v for k, v in m.items() if k in MESSAGE_KEYS} if isinstance(m, dict)
                                          else m for m in messages[:3]])
    if isinstance(body.get("tools"), list):
        body["tools"] = body["tools"][:1]
    given = [key for key in CONSTRAINTS if body.get(key) is not None]
    for key in given[1:]:
        del body[key]
    return body


def test_loaded_document_names_this_servers_model_and_vocabulary(server):
    """Once loaded: the served names as enums, the vocabulary as every token id's maximum, and
    prompt text of at least one character (this tokenizer adds nothing to empty text)."""
    doc = server.get("/openapi.json").json()
    name = server.get("/v1/models").json()["data"][0]["id"]
    assert _number_branch(_property(doc, "CompletionRequest", "model"))["enum"] == [name, ""]
    param = doc["paths"]["/v1/models/{model_id}"]["get"]["parameters"][0]
    assert param["schema"]["enum"] == [name, ""]
    prompt = _property(doc, "CompletionRequest", "prompt")["anyOf"]
    assert prompt[0] == {"type": "string", "minLength": 1}
    assert prompt[2]["items"] == {"type": "integer", "minimum": 0, "maximum": 49151}  # SmolLM2: 49152 tokens
    assert _property(doc, "DetokenizeRequest", "tokens")["items"]["maximum"] == 49151
    assert not any("x-monobatch" in node for node in _walk(doc))


@pytest.fixture(scope="module")
def api_schema(server):
    """The served document, loaded by schemathesis, with the ``map_body`` hook that keeps
    generation cheap."""
    schema = schemathesis.openapi.from_url(server.base_url + "/openapi.json", config=schemathesis.Config.from_dict({
        "phases": {"examples": {"enabled": False}, "coverage": {"enabled": False}, "stateful": {"enabled": False},
                   # no learning from responses: the same cases every run
                   "fuzzing": {"error-feedback": {"enabled": False}}},
        "generation": {"deterministic": True, "database": "none"},
    }))

    def map_body(context, body):
        path = context.operation.path if context.operation is not None else ""
        return _cheap(body, chat="chat" in path) if path in GENERATION else body

    schema.hook(map_body)
    return schema


def _fuzz(operation, mode, stats: Counter, failures: list[str]) -> None:
    """MAX_EXAMPLES derandomized cases of ``operation`` in ``mode``; failures are collected (all of
    them, unshrunk) rather than raised, so one run reports every kind."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable

    @settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(operation.as_strategy(generation_mode=mode))
    def run(case) -> None:
        response = case.call(timeout=60)
        stats[(operation.path, mode.value, response.status_code)] += 1
        try:
            case.validate_response(response, checks=CHECKS)
        except FailureGroup as exc:
            failures.append(f"{operation.label} [{mode.value}] {response.status_code}: {exc}\n"
                            f"body: {json.dumps(case.body, default=repr)[:2000]}")

    try:
        run()
    except Unsatisfiable:  # nothing to negate (no body, no typed parameter): positive data only
        assert mode.value == "negative", operation.label


def test_fuzzed_server_matches_its_document(api_schema):
    """Every operation, positive and negative data: no 5xx, and every status code, content type
    and body as documented. Most positive generation requests reach the engine (a 200): the
    document's bounds are what the server checks."""
    from schemathesis import GenerationMode

    stats: Counter = Counter()
    failures: list[str] = []
    start = time.perf_counter()
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) == 8
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz(operation, mode, stats, failures)
    elapsed = time.perf_counter() - start
    print(f"schemathesis: {sum(stats.values())} requests in {elapsed:.1f} s: {dict(sorted(stats.items()))}")
    assert not failures, "\n\n".join(failures[:10]) + f"\n\n{len(failures)} failures"
    for path in GENERATION:
        positive = {status: n for (p, mode, status), n in stats.items() if p == path and mode == "positive"}
        assert positive.get(200, 0) >= sum(positive.values()) / 2, (path, positive)
