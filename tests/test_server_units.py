"""Server parts without a server: the reasoning split (chat_output), request validation
messages, n>1 seeds and usage, text offsets, /tokenize's special-token defaults, the Gate
middleware (chunked bodies, API key on the docs, CORS) through an ASGI transport, and how the
request log reads a response's end (EventStream and respond driven through ASGI)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from monobatch.chat_output import ReasoningSplitter, prompt_opens_reasoning, split_reasoning
from monobatch.engine.params import SamplingParams
from monobatch.server.errors import LOGGED_MESSAGE_CHARS, log_error_response, validation_message
from monobatch.server.generation import Choice, TextOffsets, build_requests, usage
from monobatch.server.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest


# -- reasoning split -----------------------------------------------------------------------------------
@pytest.mark.parametrize("text,in_reasoning,content,reasoning", [
    ("<think>\nplan it</think>\n\nThe answer.", False, "The answer.", "plan it"),
    ("  <think>a</think>b", False, "b", "a"),
    ("plan it\n</think>\nAnswer", True, "Answer", "plan it\n"),
    ("still thinking", True, "", "still thinking"),
    ("No reasoning here.", False, "No reasoning here.", ""),
    ("<thinking> is not the tag", False, "<thinking> is not the tag", ""),
    ("x </think> y", False, "x </think> y", ""),  # a close tag outside a block is text
    ("<thin", False, "<thin", ""),  # an unfinished tag at the end is text
    ("a</thi", True, "", "a</thi"),
])
def test_split_reasoning(text, in_reasoning, content, reasoning):
    out = split_reasoning(text, "separate", in_reasoning)
    assert (out.content, out.reasoning) == (content, reasoning)
    assert split_reasoning(text, "none", in_reasoning).content == text


@given(st.lists(st.sampled_from(["<", "think", ">", "</", "</think>", "<think>", "a", " ", "\n", "é", "t"]),
                max_size=20), st.booleans(), st.data())
def test_streamed_split_equals_whole_split(pieces, in_reasoning, data):
    """However the text is cut into pieces, the streamed deltas join to the whole-text split."""
    text = "".join(pieces)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    chunks = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    splitter = ReasoningSplitter("separate", in_reasoning)
    content, reasoning = "", ""
    for chunk in chunks:
        d = splitter.feed(chunk)
        content, reasoning = content + d.content, reasoning + d.reasoning
    d = splitter.flush()
    whole = split_reasoning(text, "separate", in_reasoning)
    assert (content + d.content, reasoning + d.reasoning) == (whole.content, whole.reasoning)


def test_prompt_opens_reasoning():
    assert prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not prompt_opens_reasoning("<|im_start|>assistant\n")


# -- validation messages ----------------------------------------------------------------------------------
@pytest.mark.parametrize("model,body,param,needle", [
    (CompletionRequest, {"prompt": 7}, "prompt", "prompt: invalid value"),
    (CompletionRequest, {"prompt": "x", "best_of": 3}, "best_of", "not supported"),
    (CompletionRequest, {"prompt": "x", "frob": 1}, "frob", "unknown field"),
    (CompletionRequest, {"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "stream is true"),
    (CompletionRequest, {"prompt": "x", "logit_bias": {"1": "a"}}, "logit_bias.1", "logit_bias.1"),
    (CompletionRequest, {}, "prompt", "prompt: Field required"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "functions": []}, "functions",
     "not supported"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "store": True}, "store",
     "only false is supported"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "store": 0}, "store", "got 0"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "service_tier": "priority"},
     "service_tier", "one service tier"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "modalities": ["text", "audio"]},
     "modalities", "no audio"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "modalities": []}, "modalities",
     "got []"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "metadata": {"k" * 65: "v"}},
     "metadata", "OpenAI's limits"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}],
                             "metadata": {str(i): "v" for i in range(17)}}, "metadata", "at most 16 pairs"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "metadata": {"k": 1}}, "metadata",
     "string values"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "safety_identifier": "u" * 129},
     "safety_identifier", "at most 128"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "verbosity": "low"}, "verbosity",
     "no verbosity control"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "none"},
     "reasoning_effort", "not supported"),
    (CompletionRequest, {"prompt": "x", "metadata": {}}, "metadata", "unknown field"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "repetition_penalty": 1.1,
                             "repeat_penalty": 1.2}, "repeat_penalty", "conflicts"),
    # an integer out of its range: the field, the whole range and the value given (as the engine's
    # range errors read), not pydantic's "Input should be greater than or equal to 0"
    (CompletionRequest, {"prompt": "x", "max_tokens": -1}, "max_tokens", "max_tokens: must be >= 0, got -1"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": -1},
     "max_completion_tokens", "max_completion_tokens: must be >= 0, got -1"),
    (CompletionRequest, {"prompt": "x", "n": 0}, "n", "n: must be in [1, 128], got 0"),
    (CompletionRequest, {"prompt": "x", "n": 129.0}, "n", "n: must be in [1, 128], got 129.0"),
    (CompletionRequest, {"prompt": "x", "logprobs": 21}, "logprobs", "logprobs: must be in [0, 20], got 21"),
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": -1},
     "top_logprobs", "top_logprobs: must be in [0, 20], got -1"),
    (CompletionRequest, {"prompt": "x", "max_tokens": "10"}, "max_tokens",
     'max_tokens: must be an integer >= 0, got "10"'),
    (CompletionRequest, {"prompt": "x", "max_tokens": 1.5}, "max_tokens",
     "max_tokens: must be an integer >= 0, got 1.5"),
    # a huge refused value is cut, not echoed whole
    (CompletionRequest, {"prompt": "x", "max_tokens": "9" * 5000}, "max_tokens", '"' + "9" * 79 + "..."),
    # the HTTP API's temperature range, both ends in the same words
    (ChatCompletionRequest, {"messages": [{"role": "user", "content": "x"}], "temperature": -2}, "temperature",
     "temperature: must be in [0, 2] (OpenAI's range), got -2"),
    (CompletionRequest, {"prompt": "x", "temperature": 2.5}, "temperature",
     "temperature: must be in [0, 2] (OpenAI's range), got 2.5"),
    # a list's length, in the range errors' words (not pydantic's "List should have at least 1 item after validation")
    (TokenizeRequest, {"messages": []}, "messages", "messages: must have at least 1 item, got 0"),
    (ChatCompletionRequest, {"messages": []}, "messages", "messages: must have at least 1 item, got 0"),
    (TokenizeRequest, {"content": "x", "add_special": True, "add_special_tokens": False}, "add_special", "conflicts"),
    (TokenizeRequest, {"messages": [{"role": "user", "content": "x"}], "add_special_tokens": False},
     "add_special_tokens", "cannot be false"),
])
def test_validation_messages_name_the_field(model, body, param, needle):
    with pytest.raises(ValidationError) as info:
        model.model_validate(body)
    message, got = validation_message(info.value.errors())
    assert got == param and needle in message and len(message) < 300


def test_a_refused_request_logs_one_bounded_line(caplog):
    """The log line of a refusal: the whole of a short message; a long one (it may quote the
    client's text) cut to LOGGED_MESSAGE_CHARS, and line breaks escaped (one record, one line)."""
    import logging

    caplog.set_level(logging.INFO, logger="monobatch.server")
    log_error_response("POST", "/v1/chat/completions", 400, "top_p: must be in [0, 1], got 1.5")
    quoted = "messages[0]: the text 'x\nINFO forged line" + "y" * 10_000 + "' cannot be tokenized"
    log_error_response("POST", "/v1/chat/completions", 400, quoted)
    short, long = (r.getMessage() for r in caplog.records)
    assert short == "POST /v1/chat/completions 400: top_p: must be in [0, 1], got 1.5"
    assert "\n" not in long and "x\\nINFO forged" in long and long.endswith(f"... ({len(quoted)} characters)")
    assert len(long) < LOGGED_MESSAGE_CHARS + 80


def test_health_polls_while_loading_are_not_logged_at_info(caplog):
    """A load balancer polls /health while the model loads: its 503s stay out of the INFO log
    (DEBUG), while any other refusal, /health's own included at another status, is logged."""
    import logging

    caplog.set_level(logging.INFO, logger="monobatch.server")
    log_error_response("GET", "/health", 503, "the model is loading")
    assert not caplog.records
    log_error_response("GET", "/v1/models", 503, "the model is loading")
    log_error_response("GET", "/health", 401, "missing API key")
    assert [r.levelno for r in caplog.records] == [logging.INFO, logging.INFO]
    caplog.set_level(logging.DEBUG, logger="monobatch.server")
    log_error_response("GET", "/health", 503, "the model is loading")
    assert caplog.records[-1].levelno == logging.DEBUG


def test_nulls_are_absent():
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}], "tools": None,
                                                "temperature": None, "stream": None})
    assert req.temperature is None and req.stream is False


def test_no_op_openai_fields_are_accepted_and_reach_nothing():
    """The OpenAI fields whose values ask for nothing this server would do differently validate
    and add nothing to what the engine gets (the sampling request is the bare request's)."""
    bare = {"messages": [{"role": "user", "content": "x"}], "temperature": 0}
    metadata = {"k" * 64: "v" * 512, **{str(i): "" for i in range(15)}}  # OpenAI's limits, exactly
    for extra in ({"store": False, "metadata": metadata, "service_tier": "auto", "prompt_cache_key": "k",
                   "safety_identifier": "u" * 128, "modalities": ["text"]},
                  {"service_tier": "default", "metadata": {}, "prompt_cache_key": ""},
                  {name: None for name in ("store", "metadata", "service_tier", "prompt_cache_key",
                                           "safety_identifier", "modalities", "verbosity", "reasoning_effort")}):
        req = ChatCompletionRequest.model_validate({**bare, **extra})
        assert req.sampling_request() == ChatCompletionRequest.model_validate(bare).sampling_request()


# -- n > 1 and usage ---------------------------------------------------------------------------------------
def test_choices_get_consecutive_seeds():
    reqs = build_requests("cmpl-x", [[1, 2], [3]], SamplingParams(seed=7), 2, arrival_time=1.5)
    assert [r.request_id for r in reqs] == ["cmpl-x-0", "cmpl-x-1", "cmpl-x-2", "cmpl-x-3"]
    assert [r.params.seed for r in reqs] == [7, 8, 7, 8]
    top = build_requests("c", [[1]], SamplingParams(seed=2**63 - 1), 3, arrival_time=0.0)
    assert [r.params.seed for r in top] == [2**63 - 1, 0, 1]  # modulo 2**63: in range
    assert all(r.arrival_time == 1.5 for r in reqs)  # TTFT and e2e are timed from the HTTP arrival
    assert all(r.params.seed is None for r in build_requests("c", [[1]], SamplingParams(), 3, arrival_time=0.0))


def test_usage_counts_each_prompt_once():
    choices = [Choice(i, num_prompt_tokens=p, num_output_tokens=o, num_cached_tokens=c)
               for i, (p, o, c) in enumerate([(5, 3, 0), (5, 4, 4), (2, 1, 0), (2, 1, 0)])]
    assert usage(choices, 2) == {"prompt_tokens": 7, "completion_tokens": 9, "total_tokens": 16,
                                 "prompt_tokens_details": {"cached_tokens": 4}}


# -- text_offset -------------------------------------------------------------------------------------------
class _ByteTok:
    """A tokenizer stand-in whose token i is the bytes ``VOCAB[i]``."""

    VOCAB = [b"a", "😀".encode()[:2], "😀".encode()[2:], b"bc", "é".encode()[:1], "é".encode()[1:]]

    def token_bytes(self, token_id: int) -> bytes:
        return self.VOCAB[token_id]


def test_text_offsets_count_whole_characters_the_same_way_in_pieces():
    """Case 12: a token's offset is the characters its predecessors completed; a character split
    across tokens counts once (both halves start at it); fed in pieces (streamed) or at once,
    the offsets agree."""
    ids = [0, 1, 2, 3, 4, 5, 0]
    whole = TextOffsets(_ByteTok(), 5)
    at_once = [whole.take(t) for t in ids]
    assert at_once == [5, 6, 6, 7, 9, 9, 10]
    pieces, streamed = TextOffsets(_ByteTok(), 5), []
    for chunk in ([0, 1], [2], [3, 4], [5, 0]):
        streamed += [pieces.take(t) for t in chunk]
    assert streamed == at_once


# -- /tokenize -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("body,expected", [
    ({"prompt": "x"}, True),  # vLLM's add_special_tokens defaults to true
    ({"content": "x"}, False),  # llama.cpp's add_special defaults to false
    ({"content": "x", "add_special_tokens": True}, True),
    ({"prompt": "x", "add_special": False}, False),
    ({"content": "x", "add_special": True, "add_special_tokens": True}, True),
])
def test_tokenize_special_tokens_follow_the_field_used(body, expected):
    assert TokenizeRequest.model_validate(body).add_specials is expected


# -- the Gate middleware, CORS, docs -----------------------------------------------------------------------------
def _app(**settings):
    from monobatch.server import ServerSettings, create_app

    def never():  # the ASGI transport runs no lifespan: the model never loads
        raise AssertionError("not loaded in these tests")

    return create_app(ServerSettings(**settings), never)


def _request(app, method: str, path: str, **kw):
    import asyncio

    import httpx

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as client:
            return await client.request(method, path, **kw)

    return asyncio.run(go())


def test_chunked_body_over_the_limit_is_413():
    """Case 8: a body without Content-Length is counted as it arrives: over the limit, a 413."""
    app = _app(max_body_bytes=1000)

    async def chunks(*parts):  # an async iterable: httpx sends it chunked, with no Content-Length
        for part in parts:
            yield part

    r = _request(app, "POST", "/v1/completions", content=chunks(*[b"x" * 300] * 4),
                 headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = _request(app, "POST", "/v1/completions", content=chunks(b'{"prompt": ', b'"hi"}'),
                 headers={"content-type": "application/json"})
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"  # under it: read and routed


def test_docs_follow_the_api_key_and_cors_is_opt_in():
    """Case 15: /docs and /openapi.json need the key when one is set; CORS headers only for
    --allowed-origins (a preflight is answered without the key)."""
    locked = _app(api_key="k")
    for path in ("/docs", "/openapi.json"):
        assert _request(locked, "GET", path).status_code == 401
        assert _request(locked, "GET", path, headers={"Authorization": "Bearer k"}).status_code == 200
    assert _request(_app(), "GET", "/openapi.json").status_code == 200
    preflight = {"Origin": "http://ui.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    assert "access-control-allow-origin" not in _request(_app(), "OPTIONS", "/v1/completions",
                                                          headers=preflight).headers
    cors = _app(api_key="k", allowed_origins=("http://ui.example",))
    r = _request(cors, "OPTIONS", "/v1/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ui.example"
    r = _request(cors, "GET", "/v1/models", headers={"Origin": "http://ui.example"})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "http://ui.example"
    r = _request(cors, "OPTIONS", "/v1/completions", headers={**preflight, "Origin": "http://evil.example"})
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


@pytest.mark.parametrize("key", ["clé", "two words", "tab\tkey"])
def test_api_key_must_be_printable_ascii(key):
    """Case 16: a key an HTTP header cannot carry as-is is refused at startup."""
    from monobatch.errors import InvalidRequestError
    from monobatch.server import ServerSettings

    with pytest.raises(InvalidRequestError, match="ASCII"):
        ServerSettings(api_key=key)


# -- the request log's ending of a response ------------------------------------------------------------
class _Reader:
    """The one thing EventStream and respond ask of a ResponseReader: close it."""

    closed = False

    def close(self) -> None:
        self.closed = True


def _record(stream: bool):
    import time

    from monobatch.server.generation import RequestLog

    return RequestLog("chatcmpl-x", "/v1/chat/completions", time.perf_counter(), stream, 1)


def _server_lines(caplog) -> list:
    return [r for r in caplog.records if r.name == "monobatch.server"]


def _run_stream(events, spec_version="2.3", send_fails=False, disconnect_after=None):
    """Send an EventStream of ``events`` through ASGI: the client disconnects once
    ``disconnect_after`` body chunks arrived (None: never); ``send_fails``: sending a body chunk
    raises OSError (an ASGI 2.4 server whose client left). Returns (reader, the exception raised)."""
    import asyncio

    from monobatch.server.generation import EventStream

    async def go():
        sent, arrived = [], asyncio.Event()

        async def send(message):
            if message["type"] == "http.response.body" and message["body"]:
                if send_fails:
                    raise OSError("connection reset")
                sent.append(message)
                if disconnect_after is not None and len(sent) >= disconnect_after:
                    arrived.set()

        async def receive():
            await arrived.wait()
            return {"type": "http.disconnect"}

        reader = _Reader()
        scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}}
        try:
            await EventStream(events(), reader, _record(True), [Choice(0)])(scope, receive, send)
        except Exception as exc:  # noqa: BLE001 (what the server would see)
            return reader, exc
        return reader, None

    return asyncio.run(go())


def test_a_stream_a_bug_ends_is_logged_failed_not_aborted(caplog):
    """A failure mid-stream that is no disconnect is logged as failed: one WARNING line with 500
    and the exception's type, not its message (it may quote the prompt); the exception still
    reaches the server, and the reader is closed."""
    import logging

    caplog.set_level(logging.INFO, logger="monobatch.server")

    async def events():
        yield "data: {}\n\n"
        raise KeyError("the user's secret prompt")

    reader, exc = _run_stream(events)
    assert isinstance(exc, KeyError) and reader.closed
    [line] = _server_lines(caplog)
    assert line.levelno == logging.WARNING and "\n" not in line.getMessage()
    assert "chatcmpl-x /v1/chat/completions failed: 500 KeyError (stream=true" in line.getMessage()
    assert "secret" not in line.getMessage()


@pytest.mark.parametrize("spec_version,send_fails", [("2.3", False), ("2.4", True)])
def test_a_stream_its_client_left_is_logged_aborted(caplog, spec_version, send_fails):
    """A client that leaves mid-stream, as Starlette reports it: under ASGI 2.3 (uvicorn) the
    disconnect message cancels the stream, under 2.4 a failed send is its ClientDisconnect. Either
    way the request is logged aborted, at INFO."""
    import asyncio
    import logging

    caplog.set_level(logging.INFO, logger="monobatch.server")

    async def events():
        while True:
            yield "data: {}\n\n"
            await asyncio.sleep(0.001)

    reader, exc = _run_stream(events, spec_version, send_fails, disconnect_after=1)
    assert reader.closed and (type(exc).__name__ == "ClientDisconnect" if send_fails else exc is None)
    [line] = _server_lines(caplog)
    assert line.levelno == logging.INFO and "aborted (client disconnected): stream=true" in line.getMessage()


def test_respond_logs_finished_only_once_the_answer_is_shaped(caplog):
    """The non-streamed answer: "finished" is logged after shaping succeeded (never before a 500);
    a shaping bug is logged as failed (500 and its type only) and raised to the handlers."""
    import asyncio
    import logging

    from fastapi import Request

    from monobatch.server.generation import respond

    caplog.set_level(logging.INFO, logger="monobatch.server")

    async def receive():  # a client that stays
        await asyncio.Event().wait()

    async def collect():
        return [Choice(0, finish_reason="stop")]

    def shaped(choices):
        assert not _server_lines(caplog), "logged before the answer was shaped"
        return {"choices": len(choices)}

    def broken(choices):
        raise ValueError("the reply's text")

    async def go(shape):
        reader = _Reader()
        try:
            return await respond(Request({"type": "http"}, receive), reader, collect(), shape, _record(False))
        finally:
            assert reader.closed

    assert asyncio.run(go(shaped)).body == b'{"choices":1}'
    [line] = _server_lines(caplog)
    assert "finished: stream=false" in line.getMessage() and "finish_reason=stop" in line.getMessage()
    caplog.clear()
    with pytest.raises(ValueError):
        asyncio.run(go(broken))
    [line] = _server_lines(caplog)
    assert line.levelno == logging.WARNING and "failed: 500 ValueError (stream=false" in line.getMessage()
    assert "text" not in line.getMessage()


def test_uvicorn_lines_pass_only_while_the_model_is_ready():
    """serve's filter on uvicorn's logger: its INFO lines ("Started server process", "Shutting
    down") only while the model is ready and loaded; warnings and errors always."""
    import logging

    from monobatch.server.runner import _WhileReady
    from monobatch.server.state import ServerSettings, ServerState

    state = ServerState(ServerSettings(), lambda: None)
    quiet = _WhileReady(state)

    def passes(level: int) -> bool:
        return quiet.filter(logging.LogRecord("uvicorn.error", level, __file__, 1, "Shutting down", None, None))

    assert not passes(logging.INFO) and passes(logging.WARNING) and passes(logging.ERROR)  # loading
    state.ready.set()
    assert passes(logging.INFO)  # ready: start-up and shutdown lines as uvicorn prints them
    state.load_error = RuntimeError("no KV blocks")
    assert not passes(logging.INFO) and passes(logging.ERROR)  # failed: the caller's one line says it
