"""`monobatch serve` end to end: a real server process on a loopback port, talked to with the
official `openai` client and httpx.

Protocol shape (F1), degenerate and bad input (E1-E4), chat/completions parity (F2), tokenize,
metrics, and greedy parity with `monobatch generate`. The server runs `--deterministic`, so a
request's tokens do not depend on what else is in the batch: tests send their requests
concurrently to keep the suite fast. Field cases S1, S2, T1, P1, C1, C2 are in
test_server_cases.py; server options (API key, reasoning, queue limit) in test_server_options.py.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from server_util import ROOT, Server, shared_server, sse_events

#: Server A: deterministic, small context, room for 40 sequences, one CPU thread.
MAIN_ARGS = ("-t", "1", "-c", "512", "--max-num-seqs", "40", "--deterministic")
STORY = "Once upon a time, in a small village"
QUESTION = "Reply with one word: yes or no?"


@pytest.fixture(scope="session")
def server() -> Server:
    return shared_server("main", *MAIN_ARGS)


@pytest.fixture(scope="session")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def completion(server: Server, **body) -> dict:
    r = server.post("/v1/completions", {"temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def chat(server: Server, content: str = QUESTION, **body) -> dict:
    r = server.post("/v1/chat/completions", {"messages": [{"role": "user", "content": content}], "temperature": 0,
                                             **body})
    assert r.status_code == 200, r.text
    return r.json()


def stream(server: Server, path: str, body: dict) -> list:
    with httpx.stream("POST", server.base_url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events(r.iter_lines())


def assert_error(r: httpx.Response, status: int = 400, param: str | None = None, needle: str = "") -> dict:
    """An OpenAI-shaped error, sent as JSON (never as SSE)."""
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["message"] and needle in err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


def parallel(fn, args_list):
    with ThreadPoolExecutor(len(args_list)) as pool:
        return list(pool.map(lambda a: fn(*a), args_list))


# -- endpoints and the openai client --------------------------------------------------------------
def test_health_models_and_loading(server, client):
    """/health: 503 (OpenAI-shaped) while the model loaded, then 200; /v1/models names the model."""
    assert server.health_while_loading, "precondition: the fixture polled /health while the model loaded"
    for r in server.health_while_loading:  # the fixture polled from the moment the port opened
        assert_error(r, 503)
    assert server.get("/health").json() == {"status": "ok"}
    models = client.models.list().data
    assert len(models) == 1 and models[0].id.startswith("SmolLM2")
    assert server.get(f"/v1/models/{models[0].id}").json()["id"] == models[0].id
    assert_error(server.post("/v1/completions", {"model": "gpt-4", "prompt": "hi"}), 404, "model")
    assert_error(server.get("/v1/nothing-here"), 404)
    # a trailing slash is no route: an OpenAI-shaped 404, not a 307 with an empty body (a client
    # does not follow a redirect of its POST) nor the default model's card
    assert_error(server.post("/v1/chat/completions/", {"messages": [{"role": "user", "content": "hi"}]}), 404)
    assert_error(server.get("/v1/models/"), 404, "model")
    head = httpx.head(server.base_url + "/health", timeout=30)  # load balancers probe with HEAD
    assert head.status_code == 200 and not head.content


def test_openai_client_completions_and_chat(server, client):
    """The official client: completions and chat, streamed and not, n=2, usage, logprobs."""
    model = client.models.list().data[0].id
    done = client.completions.create(model=model, prompt=STORY, max_tokens=6, temperature=0, logprobs=2)
    (c,) = done.choices
    assert c.finish_reason == "length" and done.usage.completion_tokens == 6
    assert len(c.logprobs.tokens) == 6 and all(len(t) == 2 for t in c.logprobs.top_logprobs)
    pieces = list(client.completions.create(model=model, prompt=STORY, max_tokens=6, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in pieces) == c.text

    reply = client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                           max_tokens=8, temperature=0, n=2, logprobs=True, top_logprobs=3)
    assert [ch.index for ch in reply.choices] == [0, 1]
    assert reply.choices[0].message.content == reply.choices[1].message.content  # greedy: n copies agree
    assert reply.usage.completion_tokens == 2 * len(reply.choices[0].logprobs.content)
    top = reply.choices[0].logprobs.content[0]
    assert len(top.top_logprobs) == 3 and top.top_logprobs[0].logprob >= top.logprob - 1e-4
    chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": QUESTION}],
                                                 max_tokens=8, temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == reply.choices[0].message.content
    assert chunks[-1].usage.prompt_tokens == reply.usage.prompt_tokens


#: What SDKs and agent frameworks (openai-agents, LiteLLM) send with values that ask for nothing.
NO_OP_FIELDS = {"store": False, "metadata": {"run": "trial-7", "user_tier": "free"}, "service_tier": "auto",
                "prompt_cache_key": "k", "safety_identifier": "u", "modalities": ["text"]}


def test_openai_client_no_op_fields_are_accepted_and_change_nothing(server, client):
    """store false, metadata, service_tier auto/default, prompt_cache_key, safety_identifier and
    modalities ["text"] (and verbosity/reasoning_effort null) are accepted from the official client
    and give the same tokens as the same request without them, streamed and not; store true,
    service_tier flex and audio are 400s naming the field."""
    import openai

    model = client.models.list().data[0].id
    ask = {"model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 8, "temperature": 0,
           "extra_body": {"return_token_ids": True}}
    plain = client.chat.completions.create(**ask)
    dressed = client.chat.completions.create(**ask, **NO_OP_FIELDS, verbosity=None, reasoning_effort=None)
    assert dressed.choices[0].token_ids == plain.choices[0].token_ids  # vLLM's extra field, kept by the client
    assert dressed.choices[0].message.content == plain.choices[0].message.content
    assert dressed.usage.completion_tokens == plain.usage.completion_tokens > 0
    chunks = list(client.chat.completions.create(**ask, **{**NO_OP_FIELDS, "service_tier": "default"}, stream=True))
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices) == plain.choices[0].message.content
    for refused, param in (({"store": True}, "store"), ({"service_tier": "flex"}, "service_tier"),
                           ({"modalities": ["text", "audio"]}, "modalities"), ({"verbosity": "low"}, "verbosity"),
                           ({"reasoning_effort": "low"}, "reasoning_effort")):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(**ask, **{**NO_OP_FIELDS, **refused})
        assert info.value.body["param"] == param and param in info.value.body["message"], info.value.body


def test_n_with_seed_gives_distinct_reproducible_choices(server):
    """n>1 with a seed: choice j draws with seed + j modulo 2**63 (choice 0 equals the n=1
    request; after the largest seed comes 0, in range)."""
    body = {"prompt": STORY, "max_tokens": 8, "temperature": 1.0, "seed": 123, "return_token_ids": True}
    both = completion(server, n=3, **body)["choices"]
    one = completion(server, **body)["choices"][0]
    shifted = completion(server, **{**body, "seed": 124})["choices"][0]
    assert both[0]["token_ids"] == one["token_ids"] and both[1]["token_ids"] == shifted["token_ids"]
    assert len({tuple(c["token_ids"]) for c in both}) > 1
    top = completion(server, **{**body, "seed": 2**63 - 1, "n": 2})["choices"]  # choice 1: seed 2**63 wraps to 0
    assert top[1]["token_ids"] == completion(server, **{**body, "seed": 0})["choices"][0]["token_ids"]


# -- F1: SSE shape ---------------------------------------------------------------------------------
@pytest.mark.parametrize("include_usage", [False, True])
def test_f1_chat_stream_shape(server, include_usage):
    """F1: role first per choice, finish_reason null until exactly one final chunk per choice,
    usage only when asked (one chunk, choices [], before [DONE]) equal to the non-streamed usage."""
    body = {"messages": [{"role": "user", "content": QUESTION}], "temperature": 0, "max_tokens": 6, "n": 2}
    if include_usage:
        body["stream_options"] = {"include_usage": True}
    events = stream(server, "/v1/chat/completions", body)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    for i in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == i]
        assert mine[0]["delta"]["role"] == "assistant"
        assert all("role" not in m["delta"] for m in mine[1:])
        assert [m["finish_reason"] for m in mine[:-1]] == [None] * (len(mine) - 1)
        assert mine[-1]["finish_reason"] in ("stop", "length")
    plain = chat(server, max_tokens=6, n=2)
    if include_usage:
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == plain["usage"]
        assert all(c["usage"] is None for c in chunks[:-1])
    else:
        assert all("usage" not in c for c in chunks)
    texts = ["".join(c["choices"][0]["delta"].get("content", "") for c in chunks
                     if c["choices"] and c["choices"][0]["index"] == i) for i in (0, 1)]
    assert texts == [ch["message"]["content"] for ch in plain["choices"]]


def test_f1_completions_stream_shape(server):
    """F1 for /v1/completions, with echo: the prompt comes first, usage last, then [DONE]."""
    events = stream(server, "/v1/completions", {"prompt": STORY, "max_tokens": 5, "temperature": 0, "echo": True,
                                                "stream_options": {"include_usage": True}})
    assert events[-1] == "[DONE]" and events[-2]["choices"] == []
    choices = [e["choices"][0] for e in events[:-2]]
    assert choices[0]["text"] == STORY
    assert [c["finish_reason"] for c in choices[:-1]] == [None] * (len(choices) - 1)
    assert choices[-1]["finish_reason"] == "length"
    plain = completion(server, prompt=STORY, max_tokens=5, echo=True)
    assert "".join(c["text"] for c in choices) == plain["choices"][0]["text"]
    assert events[-2]["usage"] == plain["usage"]


def _streamed_logprobs(events: list) -> tuple[str, dict]:
    """A streamed completion's text and its logprobs lists joined."""
    choices = [e["choices"][0] for e in events[:-1] if e["choices"]]
    joined = {k: [v for c in choices if c["logprobs"] for v in c["logprobs"][k]]
              for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    return "".join(c["text"] for c in choices), joined


def test_echo_with_prompt_logprobs(server):
    """echo + logprobs: prompt tokens first (the first without a logprob), then the generated;
    streamed equals non-streamed (text, logprobs, text_offset)."""
    body = {"prompt": STORY, "max_tokens": 3, "echo": True, "logprobs": 1, "temperature": 0}
    out, events = parallel(lambda f: f(), [(lambda: completion(server, **body),),
                                           (lambda: stream(server, "/v1/completions", body),)])
    c = out["choices"][0]
    n_prompt = out["usage"]["prompt_tokens"]
    lp = c["logprobs"]
    assert len(lp["tokens"]) == n_prompt + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(v <= 0 for v in lp["token_logprobs"][1:]) and all(len(t) == 1 for t in lp["top_logprobs"][1:])
    assert "".join(lp["tokens"][:n_prompt]) == STORY and c["text"].startswith(STORY)
    assert lp["text_offset"][n_prompt] == len(STORY)
    text, streamed_lp = _streamed_logprobs(events)
    assert text == c["text"]
    assert streamed_lp["tokens"] == lp["tokens"] and streamed_lp["text_offset"] == lp["text_offset"]
    assert streamed_lp["token_logprobs"] == pytest.approx(lp["token_logprobs"][:1] + lp["token_logprobs"][1:])


@pytest.mark.parametrize("stream_", [False, True])
def test_echo_logprobs_with_max_tokens_0_scores_the_prompt(server, stream_):
    """echo + logprobs + max_tokens 0 (scoring a prompt, as lm-eval-harness does): the prompt
    and its logprobs, no completion token, finish_reason "length"."""
    body = {"prompt": STORY, "max_tokens": 0, "echo": True, "logprobs": 0, "temperature": 0}
    if stream_:
        events = stream(server, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
        text, lp = _streamed_logprobs(events)
        finish, used = events[-3]["choices"][0]["finish_reason"], events[-2]["usage"]
    else:
        out = completion(server, **body)
        text, lp, finish, used = (out["choices"][0]["text"], out["choices"][0]["logprobs"],
                                  out["choices"][0]["finish_reason"], out["usage"])
    assert text == STORY and "".join(lp["tokens"]) == STORY and finish == "length"
    assert used["completion_tokens"] == 0 and len(lp["tokens"]) == used["prompt_tokens"]
    assert lp["token_logprobs"][0] is None and all(v <= 0 for v in lp["token_logprobs"][1:])


# -- E1: degenerate input ----------------------------------------------------------------------------
@pytest.mark.parametrize("stream_", [False, True])
@pytest.mark.parametrize("body", [{"prompt": ""}, {"prompt": []}, {"prompt": [""]}, {"prompt": [[]]}])
def test_e1_empty_prompts_are_400(server, body, stream_):
    """E1: empty prompts are a 400 before any SSE byte (the server stays up)."""
    assert_error(server.post("/v1/completions", {**body, "stream": stream_}), 400, "prompt", "empty")


@pytest.mark.parametrize("stream_", [False, True])
def test_e1_empty_messages_is_400(server, stream_):
    assert_error(server.post("/v1/chat/completions", {"messages": [], "stream": stream_}), 400, "messages")


@pytest.mark.parametrize("max_tokens", [0, 1, 2, 10**9])
def test_e1_max_tokens_edges(server, max_tokens):
    """E1: max_tokens 0, 1, 2 and 10**9, streamed and not: completion_tokens <= max_tokens,
    "length" when the cap hits (0 is a documented empty completion); 10**9 runs to EOS."""
    body = {"messages": [{"role": "user", "content": QUESTION}], "temperature": 0, "max_tokens": max_tokens}
    plain, events = chat(server, max_tokens=max_tokens), stream(server, "/v1/chat/completions", body)
    usage, choice = plain["usage"], plain["choices"][0]
    assert usage["completion_tokens"] <= max_tokens
    if max_tokens <= 2:
        assert choice["finish_reason"] == "length" and usage["completion_tokens"] == max_tokens
    else:
        assert choice["finish_reason"] == "stop"
    text = "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1])
    assert text == choice["message"]["content"] and events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == choice["finish_reason"]


# -- E2: context length ------------------------------------------------------------------------------
@pytest.mark.parametrize("stream_", [False, True])
def test_e2_prompt_over_the_context(server, stream_):
    """E2: a prompt over the context is a 400 naming the limit, before any SSE byte; prompt +
    max_tokens over the context stops with "length" at the context end; no KV block is left."""
    ids = [28] * 600  # over -c 512
    assert_error(server.post("/v1/completions", {"prompt": ids, "stream": stream_}), 400, "prompt", "512")
    long_chat = {"messages": [{"role": "user", "content": "hi " * 600}], "stream": stream_}
    err = assert_error(server.post("/v1/chat/completions", long_chat), 400, "messages", "512")  # OpenAI's param
    assert err["code"] == "context_length_exceeded"
    near = [28] * 508
    out = completion(server, prompt=near, max_tokens=50, ignore_eos=True)
    assert out["choices"][0]["finish_reason"] == "length" and out["usage"]["completion_tokens"] == 4
    server.wait_idle()


# -- E3: wrong types ---------------------------------------------------------------------------------
BAD_BODIES = [
    ("/v1/chat/completions", {"stream": "false"}, "stream"),
    ("/v1/chat/completions", {"max_tokens": "10"}, "max_tokens"),
    ("/v1/chat/completions", {"temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {"messages": {}}, "messages"),
    # a message's fault names the element, as OpenAI does (messages[0].role), at every check
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}, {"role": "wizard", "content": "hi"}]},
     "messages[1].role"),
    ("/v1/chat/completions", {"messages": ["hi"]}, "messages[0]"),
    ("/v1/chat/completions", {"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {}}]}]},
     "messages[0].tool_calls[0]"),
    ("/v1/chat/completions", {"n": 0}, "n"),
    ("/v1/chat/completions", {"top_p": 2}, "top_p"),
    ("/v1/chat/completions", {"temperature": -1}, "temperature"),
    ("/v1/chat/completions", {"top_k": -5}, "top_k"),
    ("/v1/chat/completions", {"stop": 7}, "stop"),
    ("/v1/chat/completions", {"tools": [{"type": "function"}]}, "tools[0].function"),
    ("/v1/chat/completions", {"response_format": {"type": "xml"}}, "response_format.type"),
    ("/v1/chat/completions", {"frobnicate": 1}, "frobnicate"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    # OpenAI fields accepted only with values that ask for nothing (the rest would change the answer)
    ("/v1/chat/completions", {"store": True}, "store"),
    ("/v1/chat/completions", {"service_tier": "flex"}, "service_tier"),
    ("/v1/chat/completions", {"modalities": ["audio"]}, "modalities"),
    ("/v1/chat/completions", {"verbosity": "high"}, "verbosity"),
    ("/v1/chat/completions", {"reasoning_effort": "minimal"}, "reasoning_effort"),
    ("/v1/chat/completions", {"metadata": {"k": "v" * 513}}, "metadata"),
    ("/v1/chat/completions", {"safety_identifier": 7}, "safety_identifier"),
    ("/v1/completions", {"prompt": "x", "store": False}, "store"),  # not a field of OpenAI's completions
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("/v1/completions", {"prompt": "x", "best_of": 2}, "best_of"),
    ("/v1/completions", {"prompt": 7}, "prompt"),
    ("/v1/completions", {"prompt": [1, 99999999]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "logprobs": 50}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),  # -1 is the CLI's "no limit" only
    ("/v1/chat/completions", {"max_tokens": -1}, "max_tokens"),
    ("/v1/chat/completions", {"max_completion_tokens": -1}, "max_completion_tokens"),
    # OpenAI's ranges (the HTTP API's; temperature above 2 is the CLI's and the Python API's only)
    ("/v1/chat/completions", {"temperature": 2.01}, "temperature"),
    ("/v1/completions", {"prompt": "x", "temperature": 3}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": -0.1}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.5}, "top_p"),
    ("/v1/chat/completions", {"presence_penalty": 2.5}, "presence_penalty"),
    ("/v1/completions", {"prompt": "x", "frequency_penalty": -2.5}, "frequency_penalty"),
    ("/v1/chat/completions", {"logit_bias": {"5": 100.5}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": -101}}, "logit_bias"),
    ("/v1/chat/completions", {"n": 129}, "n"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/completions", {"prompt": "x", "logprobs": 21}, "logprobs"),
]


@pytest.mark.parametrize("stream_", [False, True])
@pytest.mark.parametrize("path,patch,param", BAD_BODIES, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD_BODIES)])
def test_e3_wrong_types_are_400(server, path, patch, param, stream_):
    """E3: each bad field is an OpenAI-shaped 400 naming it, before any SSE byte."""
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2} if "chat" in path else {"max_tokens": 2}
    body = {**body, "stream": stream_, **patch}
    assert_error(server.post(path, body), 400, param)


@pytest.mark.parametrize("path,patch,message", [
    ("/v1/completions", {"max_tokens": -1}, "max_tokens: must be >= 0, got -1"),
    ("/v1/chat/completions", {"max_tokens": -1}, "max_tokens: must be >= 0, got -1"),
    ("/v1/chat/completions", {"max_completion_tokens": -1}, "max_completion_tokens: must be >= 0, got -1"),
    ("/v1/chat/completions", {"n": 129}, "n: must be in [1, 128], got 129"),
    ("/v1/completions", {"logprobs": 21}, "logprobs: must be in [0, 20], got 21"),
    ("/v1/completions", {"max_tokens": "16"}, 'max_tokens: must be an integer >= 0, got "16"'),
])
def test_an_integer_out_of_range_says_the_range_and_the_value(server, path, patch, message):
    """The 400 of an integer out of its range reads as the engine's range errors do (the field,
    the whole range, the value given), not as pydantic's "Input should be greater than or equal to 0"."""
    body = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    assert assert_error(server.post(path, {**body, **patch}), 400, next(iter(patch)))["message"] == message


@pytest.mark.parametrize("patch,param", [('"store": "\\ud800"', "store"), ('"service_tier": "\\ud800"', "service_tier"),
                                         ('"metadata": {"k": 1, "x": "\\ud800"}', "metadata")])
def test_a_lone_surrogate_in_a_refused_value_is_a_400(server, patch, param):
    """The 400's message quotes the refused value JSON-escaped: a lone surrogate escape sent by
    the client (raw JSON: httpx would not encode it) never makes the reply unencodable (a 500)."""
    body = '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, ' + patch + "}"
    resp = httpx.post(server.base_url + "/v1/chat/completions", content=body.encode(),
                      headers={"content-type": "application/json"}, timeout=60)
    assert_error(resp, 400, param)


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi \\ud800"}], "max_tokens": 2}', "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "system", "content": "\\udfff"}, {"role": "user", "content": "hi"}], '
                             '"max_tokens": 2, "stream": true}', "messages"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": [{"type": '
                             '"function", "function": {"name": "f", "description": "\\ud800", "parameters": {}}}]}',
     "messages"),
    ("/v1/completions", '{"prompt": "hi \\ud800", "max_tokens": 2}', "prompt"),
    ("/v1/completions", '{"prompt": ["ok", "\\ud800"], "max_tokens": 2, "stream": true}', "prompt"),
    ("/tokenize", '{"content": "\\ud800"}', "prompt"),
    ("/tokenize", '{"messages": [{"role": "user", "content": "\\ud800"}]}', "messages"),
])
def test_a_lone_surrogate_in_the_text_is_a_400(server, path, body, param):
    """Text the tokenizer gets (a prompt, a message, a tool's description in the rendered chat)
    with a lone surrogate escape, which JSON allows and UTF-8 cannot hold: an OpenAI-shaped 400
    naming the field, before any SSE byte; never the tokenizer's TypeError as a 500."""
    resp = httpx.post(server.base_url + path, content=body.encode(), headers={"content-type": "application/json"},
                      timeout=60)
    assert "not valid UTF-8" in assert_error(resp, 400, param)["message"]
    assert server.post("/v1/completions", {"prompt": "hi", "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_openai_range_edges_are_accepted(server, path):
    """The ends of OpenAI's ranges are valid: temperature 2, top_p 0 (the most likely token only),
    penalties -2 and 2, a bias of -100 and 100."""
    base = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    for edge in ({"temperature": 2, "top_p": 0, "presence_penalty": -2, "frequency_penalty": 2},
                 {"temperature": 0, "top_p": 1, "presence_penalty": 2, "frequency_penalty": -2,
                  "logit_bias": {"5": -100, "6": 100}}):
        r = server.post(path, {**base, "max_tokens": 2, **edge})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("content,ctype,says", [
    (b"{not json", "application/json", "not valid JSON"), (b"", "application/json", "empty"),
    (b'{"prompt": "hi"}', "text/plain", "Content-Type 'text/plain'"),
    (b'{"prompt": "hi"}', "application/x-www-form-urlencoded", "-H 'Content-Type: application/json'"),
    (b"[1, 2]", "application/json", "must be a JSON object"),
    ('{"prompt": "caf\xe9"}'.encode("latin-1"), "application/json", "not valid UTF-8 (byte 0xe9 at offset 15)"),
    (b'{"prompt": "hi", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "application/json", "nested too deeply")])
def test_e3_bad_bodies_are_400(server, content, ctype, says):
    """E3: a non-JSON body, an empty body, a wrong Content-Type (curl's ``-d`` without a header
    sends a form: the message says which header to send), a non-object: 400."""
    r = server.post("/v1/completions", content=content, headers={"content-type": ctype})
    assert_error(r, 400)
    assert says in r.json()["error"]["message"], r.text
    assert server.get("/health").status_code == 200


def test_413_for_an_oversized_body(server):
    """A body over the limit is refused from its Content-Length, before it is read."""
    host, port = server.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 999999999\r\n\r\n{")
        reply = b""
        while b'"code"' not in reply:
            data = s.recv(65536)
            assert data, reply
            reply += data
    assert reply.startswith(b"HTTP/1.1 413") and b'"request_too_large"' in reply


def test_413_for_an_oversized_chunked_body(server):
    """Case 8: a chunked body (no Content-Length) is counted as it arrives: 413 past the limit."""
    import threading

    host, port = server.base_url.removeprefix("http://").split(":")
    frame = b"%x\r\n%s\r\n" % (2**20, b"x" * 2**20)
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")

        def send_body() -> None:
            try:
                for _ in range(40):  # 40 MiB, over the 32 MiB limit; the server stops reading at it
                    s.sendall(frame)
                s.sendall(b"0\r\n\r\n")
            except OSError:
                pass

        sender = threading.Thread(target=send_body, daemon=True)
        sender.start()
        reply = b""
        while b'"code"' not in reply:
            data = s.recv(65536)
            assert data, reply
            reply += data
        s.shutdown(socket.SHUT_RDWR)  # unblocks the sender
        sender.join(30)
    assert reply.startswith(b"HTTP/1.1 413") and b'"request_too_large"' in reply
    assert server.get("/health").status_code == 200


# -- E4: logit_bias ------------------------------------------------------------------------------------
@pytest.mark.parametrize("bias", [{"49152": 1}, {"999999": 1}, {"-1": 1}, {"abc": 1}, {"5": 1e9}, {"5_0": 1},
                                  {" 5": 1}, {"\u0665": 1}])
def test_e4_logit_bias_out_of_range(server, bias):
    """E4: an id equal to the vocab size, beyond it, negative, not a number (also what Python's
    int() would read: "5_0", " 5", an Arabic-Indic digit), a huge bias: 400."""
    assert_error(server.post("/v1/completions", {"prompt": STORY, "max_tokens": 2, "logit_bias": bias}), 400,
                 "logit_bias")


def test_e4_logit_bias_valid(server):
    """E4: -100 on the reference's first token removes it; +100 on another forces it each step."""
    ref = completion(server, prompt=STORY, max_tokens=4, return_token_ids=True)["choices"][0]["token_ids"]
    forced = 11  # any id other than the reference's tokens
    assert forced not in ref
    banned, pushed = parallel(lambda b: completion(server, prompt=STORY, max_tokens=4, return_token_ids=True,
                                                   logit_bias=b)["choices"][0]["token_ids"],
                              [({str(ref[0]): -100},), ({str(forced): 100},)])
    assert banned[0] != ref[0]
    assert pushed == [forced] * 4


# -- F2 and tokenize ------------------------------------------------------------------------------------
def test_f2_chat_equals_rendered_completion(server):
    """F2: a chat request and /v1/completions on its rendered prompt give the same token ids;
    add_generation_prompt ends the prompt with the assistant header."""
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    tok = server.post("/tokenize", {"messages": msgs}).json()
    rendered = server.post("/detokenize", {"tokens": tok["tokens"]}).json()["prompt"]
    assert rendered.endswith("<|im_start|>assistant\n")
    via_chat = chat(server, max_tokens=6, return_token_ids=True, messages=msgs)
    via_text = completion(server, prompt=rendered, max_tokens=6, return_token_ids=True)
    assert via_chat["prompt_token_ids"] == tok["tokens"] == via_text["choices"][0]["prompt_token_ids"]
    assert via_chat["choices"][0]["token_ids"] == via_text["choices"][0]["token_ids"]


def test_tokenize_and_detokenize_shapes(server):
    """vLLM's shapes (prompt, count, max_model_len, token_strs) and llama.cpp's (content, with_pieces)."""
    v = server.post("/tokenize", {"prompt": "Hello world", "return_token_strs": True}).json()
    assert v["count"] == len(v["tokens"]) and v["max_model_len"] == 512 and "".join(v["token_strs"]) == "Hello world"
    llama = server.post("/tokenize", {"content": "Hello world", "with_pieces": True}).json()
    assert [p["id"] for p in llama["tokens"]] == v["tokens"]
    assert "".join(p["piece"] for p in llama["tokens"]) == "Hello world"
    back = server.post("/detokenize", {"tokens": v["tokens"]}).json()
    assert back["prompt"] == back["content"] == "Hello world"
    pieces = server.post("/tokenize", {"content": "😀", "with_pieces": True}).json()["tokens"]
    assert any(isinstance(p["piece"], list) for p in pieces), "precondition: the emoji is split across tokens"
    assert b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode()
                    for p in pieces) == "😀".encode()  # llama.cpp: invalid UTF-8 pieces as byte lists


TOKENIZE_ERRORS = [
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"messages": {}}, 400, "messages"),
    ("/tokenize", {"messages": [{"role": "wizard", "content": "hi"}]}, 400, "messages[0].role"),
    ("/tokenize", {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "add_special_tokens": False}, 400,
     "add_special_tokens"),
    ("/tokenize", {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"messages": []}}, 400,
     "chat_template_kwargs"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"prompt": "a", "content": "b"}, 400, "prompt"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {"content": "a", "add_special": True, "add_special_tokens": False}, 400, "add_special"),
    ("/tokenize", {"prompt": "a", "model": "gpt-4"}, 404, "model"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens"),
    ("/detokenize", {"tokens": [99999999]}, 400, "tokens"),
    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
    ("/detokenize", {}, 400, "tokens"),
]


@pytest.mark.parametrize("path,body,status,param", TOKENIZE_ERRORS,
                         ids=[f"{p[1:]}-{i}" for i, (p, *_) in enumerate(TOKENIZE_ERRORS)])
def test_tokenize_and_detokenize_errors(server, path, body, status, param):
    """Case 2: every client mistake on /tokenize and /detokenize is an OpenAI-shaped 4xx."""
    assert_error(server.post(path, body), status, param)


def test_developer_role_is_the_system_role(server):
    """OpenAI's `developer` role renders as `system`."""
    ids = [server.post("/tokenize", {"messages": [{"role": role, "content": "Be brief."},
                                                  {"role": "user", "content": QUESTION}]}).json()["tokens"]
           for role in ("developer", "system")]
    assert ids[0] == ids[1]
    out = chat(server, max_tokens=2, messages=[{"role": "developer", "content": "Be brief."},
                                               {"role": "user", "content": QUESTION}])
    assert out["usage"]["prompt_tokens"] == len(ids[1])


# -- limits ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("body,param", [
    ({"prompt": [[7, 8]] * 40, "n": 100}, "prompt"),
    ({"prompt": ["a", "b", "c"], "n": 100}, "prompt"),
])
def test_too_many_sequences_in_one_request_is_400(server, body, param):
    """Case 3: prompts x n over the per-request limit (256) is a 400 at once, nothing queued."""
    assert_error(server.post("/v1/completions", {**body, "max_tokens": 1}), 400, param, "256")
    assert server.metrics()["monobatch_num_requests_waiting"] == 0


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {"prompt": "word " * 100_000}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "word " * 100_000}]}]}),
    ("/tokenize", {"prompt": "word " * 100_000}),
])
def test_prompt_text_that_cannot_fit_is_refused_before_tokenizing(server, path, body):
    """Case 4: more characters than the context's tokens can hold is a 400 without tokenizing."""
    err = assert_error(server.post(path, body), 400, "prompt" if "prompt" in body else "messages", "characters")
    assert err["code"] == "context_length_exceeded"


# -- greedy parity with `monobatch generate` --------------------------------------------------------------
@pytest.mark.parametrize("chat_mode", [False, True])
def test_greedy_ids_equal_generate(server, chat_mode):
    """Invariant 1: the same greedy request gives the same ids through the server as through
    `monobatch generate`."""
    args = ["--chat"] if chat_mode else []
    res = subprocess.run([sys.executable, "-m", "monobatch", "generate", "-p", QUESTION if chat_mode else STORY,
                          "-n", "10", "--temperature", "0", "--output-format", "json", "-t", "1", "--no-progress",
                          *args], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert res.returncode == 0, res.stderr
    ref = json.loads(res.stdout)
    if chat_mode:
        out = chat(server, max_tokens=10, return_token_ids=True)["choices"][0]
        text = out["message"]["content"]
    else:
        out = completion(server, prompt=STORY, max_tokens=10, return_token_ids=True)["choices"][0]
        text = out["text"]
    assert out["token_ids"] == ref["token_ids"] and text == ref["text"]


# -- /metrics ---------------------------------------------------------------------------------------------
def test_metrics_parse_and_count_what_was_sent(server):
    """/metrics parses with prometheus_client; token counters and histograms move by exactly
    what three requests reported in their usage."""
    server.wait_idle()
    before = server.metrics()
    outs = parallel(lambda p: completion(server, prompt=p, max_tokens=3),
                    [("The sky is",), ("Two plus two is",), ("My favourite colour is",)])
    after = server.wait_idle()
    delta = {k: after[k] - before.get(k, 0) for k in after}
    assert delta["monobatch_prompt_tokens_total"] == sum(o["usage"]["prompt_tokens"] for o in outs)
    assert delta["monobatch_generation_tokens_total"] == sum(o["usage"]["completion_tokens"] for o in outs)
    for reason in ("stop", "length"):
        sent = sum(o["choices"][0]["finish_reason"] == reason for o in outs)
        assert delta.get(f'monobatch_request_success_total{{finished_reason="{reason}"}}', 0) == sent
    assert delta["monobatch_time_to_first_token_seconds_count"] == 3
    assert delta["monobatch_e2e_request_latency_seconds_count"] == 3
    assert delta["monobatch_inter_token_latency_seconds_count"] == sum(o["usage"]["completion_tokens"] - 1 for o in outs)
    assert after["monobatch_kv_cache_total_blocks"] > 0
