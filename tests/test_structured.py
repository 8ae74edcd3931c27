"""Structured outputs: the grammar mask as the sampler's first stage, through every door.

Engine tests run the bundled model in-process; server tests use the real ``monobatch serve``
shared with test_server.py (``--deterministic``) and the official ``openai`` client. Every
constrained reply that ends with ``stop`` is validated with ``jsonschema``.
"""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pydantic
import pytest
import torch

jsonschema = pytest.importorskip("jsonschema")

from schemas import SCHEMAS
from server_util import assert_400_naming, shared_server
from test_server import MAIN_ARGS

pytestmark = pytest.mark.usefixtures("one_cpu_thread")

QUESTION = [{"role": "user", "content": "Describe the city of Paris."}]


@pytest.fixture(scope="module")
def prompt(loaded):
    return loaded.tokenizer.encode_chat(QUESTION)


@pytest.fixture(scope="module")
def server():
    return shared_server("main", *MAIN_ARGS)


def _run(scheduler, requests):
    """Every request's (text, token ids, finish_reason)."""
    texts, ids, reasons = {}, {}, {}
    for out in scheduler.run(requests):
        texts[out.request_id] = texts.get(out.request_id, "") + out.text
        ids.setdefault(out.request_id, []).extend(out.token_ids)
        if out.finished:
            reasons[out.request_id] = out.finish_reason.value
    return {r.request_id: (texts.get(r.request_id, ""), ids.get(r.request_id, []), reasons[r.request_id])
            for r in requests}


def _request(rid, prompt, structured=None, **fields):
    from monobatch.engine.params import SamplingParams
    from monobatch.engine.sequence import Request

    fields.setdefault("temperature", 0.0)
    return Request(rid, list(prompt), SamplingParams(structured=structured, **fields))


# -- the stage itself ----------------------------------------------------------------------------
def test_apply_bitmask_masks_exactly_the_cleared_bits():
    from monobatch.engine.constraint import apply_bitmask

    rng = np.random.default_rng(0)
    V = 70
    bits = rng.integers(0, 2, size=(2, 96)).astype(bool)
    words = np.zeros((2, 3), np.uint32)
    for r in range(2):
        for t in range(96):
            if bits[r, t]:
                words[r, t // 32] |= np.uint32(1 << (t % 32))
    x = torch.randn(4, V)
    before = x.clone()
    apply_bitmask(x, torch.tensor([1, 3]), torch.from_numpy(words.view(np.int32)))
    for r, row in ((0, 1), (1, 3)):
        allowed = torch.from_numpy(bits[r, :V])
        assert torch.equal(x[row][allowed], before[row][allowed])
        assert torch.isneginf(x[row][~allowed]).all()
    assert torch.equal(x[[0, 2]], before[[0, 2]])  # rows without a grammar untouched


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_apply_bitmask_cuda_equals_cpu():
    from monobatch.engine.constraint import apply_bitmask

    words = torch.randint(-2**31, 2**31 - 1, (3, 1536), dtype=torch.int32)
    x = torch.randn(5, 49152)
    rows = torch.tensor([0, 2, 4])
    want = apply_bitmask(x.clone(), rows, words)
    got = apply_bitmask(x.cuda(), rows.cuda(), words.cuda()).cpu()
    assert torch.equal(got, want)


def test_fill_bitmasks_matches_the_matcher_and_batch_does_not_change_a_row(loaded):
    """The one-row and the parallel (LLExecutor) paths give the same masks."""
    from monobatch.engine.constraint import GrammarCompiler, StructuredOutput, fill_bitmasks

    tok = loaded.tokenizer
    grammars = GrammarCompiler(tok, tok.vocab_size)
    specs = [StructuredOutput.json_schema(s) for s, _ in SCHEMAS[:6]]
    matchers = [grammars.matcher(s) for s in specs]
    for m, (_, inst) in zip(matchers, SCHEMAS[:6]):
        for t in tok.encode(json.dumps(inst)[:5], add_special_tokens=False):
            assert m.accept(t)
    together = fill_bitmasks(matchers, tok.vocab_size)
    for i, m in enumerate(matchers):
        assert np.array_equal(fill_bitmasks([m], tok.vocab_size)[0], together[i])
        allowed = np.unpackbits(together[i].view(np.uint8), bitorder="little")[:tok.vocab_size]
        assert 0 < allowed.sum() < tok.vocab_size


def test_compile_errors_name_the_field_and_are_cached_by_spec(loaded):
    from monobatch.engine.constraint import GrammarCompiler, StructuredOutput
    from monobatch.errors import InvalidRequestError

    grammars = GrammarCompiler(loaded.tokenizer, loaded.tokenizer.vocab_size)
    bad = [StructuredOutput.json_schema({"type": "strang"}, "response_format"),
           StructuredOutput.json_schema({"type": "string", "format": "no-such-format"}, "guided_json"),
           StructuredOutput("regex", "[0-9", "guided_regex"),
           StructuredOutput("grammar", "root ::= (", "grammar"),
           StructuredOutput("lark", "start: undefined_rule", "structured_outputs.grammar")]
    for spec in bad:
        with pytest.raises(InvalidRequestError) as info:
            grammars.compile(spec)
        assert info.value.param == spec.param and str(info.value).startswith(spec.param + ":")
        assert "\n" not in str(info.value)
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        StructuredOutput.json_schema("{nope", "json_schema")
    with pytest.raises(InvalidRequestError, match="limit"):
        StructuredOutput("regex", "a" * 70_000, "guided_regex")
    ok = StructuredOutput.json_schema(SCHEMAS[0][0])
    grammars.compile(ok)
    assert (ok.kind, ok.value) in grammars._cache
    assert grammars.matcher(ok).raw is not grammars.matcher(ok).raw  # each sequence its own matcher


def test_a_compile_past_the_timeout_is_refused(loaded):
    """A schema that is not cached yet cannot compile in a microsecond: refused, nothing hangs."""
    from monobatch.engine.constraint import GrammarCompiler, StructuredOutput
    from monobatch.errors import InvalidRequestError

    grammars = GrammarCompiler(loaded.tokenizer, loaded.tokenizer.vocab_size)
    grammars._ll_tokenizer()  # the one-off tokenizer build is not what is timed
    props = {f"f{i}": {"type": "string", "pattern": "^[a-z]{3}[0-9]+$"} for i in range(400)}  # ~25 ms to compile
    big = StructuredOutput.json_schema({"type": "object", "properties": props, "required": list(props)})
    with pytest.raises(InvalidRequestError, match="longer than"):
        grammars.compile(big, timeout=1e-4)
    grammars.compile(big)  # with the default limit it compiles (the late thread's result was not cached)


# -- the engine ----------------------------------------------------------------------------------
def test_twenty_schemas_all_replies_valid(make_scheduler, prompt):
    """The 20 schemas of tests/schemas.py in one batch: every reply ends with stop (the grammar
    terminated) and validates."""
    from monobatch.engine.constraint import StructuredOutput

    scheduler = make_scheduler(max_num_seqs=20)
    requests = [_request(f"s{i}", prompt, StructuredOutput.json_schema(s), max_tokens=160)
                for i, (s, _) in enumerate(SCHEMAS)]
    results = _run(scheduler, requests)
    for i, (schema, _) in enumerate(SCHEMAS):
        text, _, reason = results[f"s{i}"]
        assert reason == "stop", (i, text)
        jsonschema.validate(json.loads(text), schema)


def test_regex_choice_and_gbnf(make_scheduler, prompt, loaded):
    from monobatch.engine.constraint import StructuredOutput

    scheduler = make_scheduler()
    gbnf = 'root ::= "The answer is " ("yes" | "no") "."'
    results = _run(scheduler, [
        _request("re", prompt, StructuredOutput.regex(r"[A-Z][a-z]+ is [0-9]{2} years old\."), max_tokens=40),
        _request("ch", prompt, StructuredOutput.choice(["Paris", "London", "Rome"]), max_tokens=10),
        _request("gb", prompt, StructuredOutput.grammar(gbnf), max_tokens=20),
    ])
    assert re.fullmatch(r"[A-Z][a-z]+ is [0-9]{2} years old\.", results["re"][0]) and results["re"][2] == "stop"
    assert results["ch"][0] in ("Paris", "London", "Rome") and results["ch"][2] == "stop"
    assert re.fullmatch(r"The answer is (yes|no)\.", results["gb"][0]) and results["gb"][2] == "stop"
    # the end-of-generation token that closed the grammar adds no text; the grammar's own tokens do
    assert loaded.tokenizer.decode(results["ch"][1]) == results["ch"][0]


def test_max_tokens_inside_a_constrained_answer_ends_with_length(make_scheduler, prompt):
    from monobatch.engine.constraint import StructuredOutput

    text, ids, reason = _run(make_scheduler(), [
        _request("cut", prompt, StructuredOutput.json_schema(SCHEMAS[19][0]), max_tokens=5)])["cut"]
    assert reason == "length" and len(ids) == 5 and text.startswith("{")


def test_constrained_and_free_rows_share_steps_and_get_their_own_tokens(make_scheduler, prompt, loaded):
    """Deterministic mode: constrained (greedy and seeded) and free rows in one batch give each
    the tokens it gets alone; rows without a constraint are untouched by the others' masks."""
    from monobatch.engine.constraint import StructuredOutput

    other = loaded.tokenizer.encode_chat([{"role": "user", "content": "Name three colours."}])
    schema = StructuredOutput.json_schema(SCHEMAS[3][0])

    def requests():
        return [_request("free", other, max_tokens=12, ignore_eos=True),
                _request("json", prompt, schema, max_tokens=40),
                _request("seeded", prompt, StructuredOutput.json_schema(SCHEMAS[19][0]), temperature=0.9, seed=5,
                         max_tokens=40),
                _request("free-seeded", other, temperature=0.8, seed=3, max_tokens=12, ignore_eos=True)]

    alone = {}
    for r in requests():
        alone.update(_run(make_scheduler(deterministic=True), [r]))
    together = _run(make_scheduler(deterministic=True, prefill_chunk=16), requests())
    for rid in alone:
        assert together[rid][1] == alone[rid][1], rid
    assert json.loads(together["json"][0])["colour"] in ("red", "green", "blue")


def test_ignore_eos_and_min_tokens_do_not_outlast_the_grammar(make_scheduler, prompt):
    """Once the grammar is complete it allows only the end: a constrained row ends there (stop)
    even with ignore_eos / min_tokens (documented)."""
    from monobatch.engine.constraint import StructuredOutput

    spec = StructuredOutput.choice(["yes", "no"])
    res = _run(make_scheduler(), [_request("a", prompt, spec, max_tokens=20, ignore_eos=True),
                                  _request("b", prompt, spec, max_tokens=20, min_tokens=10)])
    for rid in "ab":
        assert res[rid][0] in ("yes", "no") and res[rid][2] == "stop"


def test_tiny_temperature_is_greedy(make_scheduler, prompt):
    """A temperature near the smallest double (logits / T overflows) draws what greedy draws."""
    greedy = _run(make_scheduler(), [_request("g", prompt, max_tokens=8, ignore_eos=True)])["g"][1]
    for t in (1e-308, 5e-324, 1e-31):
        tiny = _run(make_scheduler(), [_request("t", prompt, temperature=t, seed=1, max_tokens=8,
                                                ignore_eos=True)])["t"][1]
        assert tiny == greedy, t


# -- the server ----------------------------------------------------------------------------------
class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=20)
    country: str = pydantic.Field(max_length=20)
    population_millions: int = pydantic.Field(ge=0, le=50)


@pytest.fixture(scope="module")
def client(server):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused")


def test_openai_parse_with_a_pydantic_model(client):
    """``client.chat.completions.parse(response_format=Model)`` works unchanged, streamed and not."""
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": "Give me a city as JSON."}]
    done = client.chat.completions.parse(model=model, messages=messages, response_format=City, temperature=0,
                                         max_tokens=80)
    parsed = done.choices[0].message.parsed
    assert isinstance(parsed, City) and done.choices[0].finish_reason == "stop"
    with client.chat.completions.stream(model=model, messages=messages, response_format=City, temperature=0,
                                        max_tokens=80) as stream:
        final = stream.get_final_completion()
    assert final.choices[0].message.parsed == parsed
    assert final.choices[0].message.content == done.choices[0].message.content


@pytest.mark.parametrize("fields", [
    {"response_format": {"type": "json_object"}},
    {"response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMAS[11][0]}}},
    {"structured_outputs": {"json": SCHEMAS[4][0]}},
    {"guided_json": SCHEMAS[6][0]},
    {"json_schema": SCHEMAS[12][0]},
])
@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_json_fields_on_both_endpoints_streamed_and_not(server, fields, endpoint):
    schema = (fields.get("json_schema") or fields.get("guided_json") or fields.get("structured_outputs", {}).get("json")
              or fields["response_format"].get("json_schema", {}).get("schema") or {"type": "object"})
    body = {"temperature": 0, "max_tokens": 80, **fields}
    if endpoint == "chat":
        body["messages"], path = QUESTION, "/v1/chat/completions"
    else:
        body["prompt"], path = "A JSON description of Paris:", "/v1/completions"
    whole = server.post(path, body)
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    text = choice["message"]["content"] if endpoint == "chat" else choice["text"]
    assert choice["finish_reason"] == "stop", text
    jsonschema.validate(json.loads(text), schema)
    with httpx_stream(server, path, {**body, "stream": True}) as events:
        pieces = [c["choices"][0]["delta"].get("content", "") if endpoint == "chat" else c["choices"][0]["text"]
                  for c in events if c.get("choices")]
    assert "".join(pieces) == text


@pytest.mark.parametrize("json_schema", [{"name": "x"}, {"name": "x", "schema": None, "strict": True}])
def test_json_schema_without_a_schema_is_any_json_object(server, json_schema):
    """OpenAI's ``response_format.json_schema`` requires ``name``; ``schema`` is optional (its
    OpenAPI document, the ``openai`` client's types): without one the reply is a JSON object, as
    with ``json_object`` (this prompt's greedy reply to an empty schema is ``null``), streamed and not."""
    body = {"messages": [{"role": "user", "content": "Say hello."}], "temperature": 0, "max_tokens": 20,
            "response_format": {"type": "json_schema", "json_schema": json_schema}}
    whole = server.post("/v1/chat/completions", body)
    assert whole.status_code == 200, whole.text
    choice = whole.json()["choices"][0]
    text = choice["message"]["content"]
    assert choice["finish_reason"] == "stop" and isinstance(json.loads(text), dict), text
    with httpx_stream(server, "/v1/chat/completions", {**body, "stream": True}) as events:
        assert "".join(c["choices"][0]["delta"].get("content", "") for c in events if c.get("choices")) == text


def httpx_stream(server, path, body):
    """The SSE chunks of a streamed request (a context manager yielding the parsed events)."""
    import contextlib

    import httpx

    @contextlib.contextmanager
    def events():
        with httpx.stream("POST", server.base_url + path, json=body, timeout=120) as resp:
            assert resp.status_code == 200, resp.read()
            assert resp.headers["content-type"].startswith("text/event-stream")
            out = []
            for line in resp.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    out.append(json.loads(line[6:]))
            yield out

    return events()


@pytest.mark.parametrize("fields,check", [
    ({"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}}, lambda t: re.fullmatch(r"[0-9]{3}-[0-9]{4}", t)),
    ({"guided_regex": "(yes|no)"}, lambda t: t in ("yes", "no")),
    ({"structured_outputs": {"choice": ["north", "south"]}}, lambda t: t in ("north", "south")),
    ({"guided_choice": ["a", "b"]}, lambda t: t in ("a", "b")),
    ({"grammar": 'root ::= "It is " [0-9] "."'}, lambda t: re.fullmatch(r"It is [0-9]\.", t)),
    ({"guided_grammar": 'root ::= ("x" | "y")+ "!"'}, lambda t: re.fullmatch(r"[xy]+!", t)),
    ({"structured_outputs": {"grammar": 'root ::= "ok"'}}, lambda t: t == "ok"),
])
def test_regex_choice_and_grammar_fields(server, fields, check):
    resp = server.post("/v1/chat/completions", {"messages": QUESTION, "temperature": 0, "max_tokens": 30, **fields})
    assert resp.status_code == 200, resp.text
    text = resp.json()["choices"][0]["message"]["content"]
    assert check(text), text


@pytest.mark.parametrize("fields,param", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "response_format"),
    ({"grammar": 'root ::= "a"', "json_schema": {"type": "object"}}, "json_schema"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs.regex"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strang"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": "abc"}}},
     "response_format.json_schema.schema"),  # one clear line, not pydantic's per union member
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}},
     "response_format.json_schema.name"),  # OpenAI requires the name
    ({"guided_regex": "[0-9"}, "guided_regex"),
    ({"grammar": "root ::= ("}, "grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a{1000000}"}, "guided_regex"),  # the lexer limit, ~0.5 s (a{1000}{1000}: 1.5-5 s)
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_constraints_are_400s_naming_the_field_before_any_sse_byte(server, fields, param, stream):
    assert_400_naming(server, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 4, "stream": stream,
                                                       **fields}, param)


def test_constrained_length_stop_on_the_server(server):
    resp = server.post("/v1/chat/completions", {"messages": QUESTION, "max_tokens": 3,
                                                "json_schema": SCHEMAS[19][0]})
    assert resp.json()["choices"][0]["finish_reason"] == "length"


def _spy_async(sched):
    """Count the async paths a run takes: deferred draws, unchecked draws, the refused unchecked
    draws that were redrawn (``corrected``), the steps that recomputed such a row (``void``) and
    the rows redrawn at forced grammar positions before the next step read them (``forced``)."""
    engine, seen = sched.engine, {"deferred": 0, "unchecked": 0, "corrected": 0, "void": 0, "forced": 0,
                                  "forced_then_corrected": 0, "host_not_device": 0}
    real_launch, real_deferred, real_resolve = engine.launch, engine.draw_deferred, engine.resolve
    real_forced = engine.draw_forced

    def draw_forced(pending):
        real_forced(pending)
        seen["forced"] += len(pending.forced or ())

    engine.draw_forced = draw_forced

    def launch(batch, rows, *args, **kw):
        seen["unchecked"] += bool(kw.get("unchecked"))
        seen["void"] += len(kw.get("replace") or {})
        return real_launch(batch, rows, *args, **kw)

    def resolve(pending):
        out = real_resolve(pending)
        seen["corrected"] += len(pending.corrected)
        # a forced redraw is drawn among unchecked candidates, so the check may refuse and correct
        # it (counted); the host read the final draws (the copy queued after the redraws: on CUDA a
        # copy queued before them would read raw argmaxes)
        seen["forced_then_corrected"] += len(set(pending.corrected) & set(pending.forced or ()))
        if pending.host is not None and pending.tokens is not None:
            host, device = pending.host.tolist(), pending.tokens.cpu().tolist()
            seen["host_not_device"] += sum(a != b for r, (a, b) in enumerate(zip(host, device))
                                           if r not in pending.corrected)
        return out

    engine.launch, engine.resolve = launch, resolve
    engine.draw_deferred = lambda pending: (seen.__setitem__("deferred", seen["deferred"] + 1), real_deferred(pending))[1]
    return seen


@pytest.fixture
def unforced(monkeypatch):
    """Async scheduling without the forced-position redraws (Engine.draw_forced), so refusals of
    unchecked draws, and the void rows after them, happen at every forced grammar position: the
    tests of that path get many of them."""
    from monobatch.engine import engine

    monkeypatch.setattr(engine, "FORCED_DRAWS", False)


@pytest.mark.parametrize("forced", [True, False], ids=["forced", "unforced"])
@pytest.mark.parametrize("deterministic", [False, True])
def test_async_scheduling_with_greedy_constrained_rows_equals_sync(make_scheduler, prompt, loaded, deterministic,
                                                                   forced, monkeypatch):
    """Async scheduling keeps greedy constrained rows in the overlap without masks: each draws its
    raw argmax on the device, checked against its grammar once the previous token is accepted;
    a refused draw is redrawn under the mask and the step already launched on it recomputes that
    row; rows at forced grammar positions are redrawn among the tokens that can spell the forced
    bytes before the next step reads them (or, ``unforced``, left to the check). Same tokens as the synchronous loop,
    beside free rows; a row whose grammar ends mid-run drops out cleanly; refusals really happen
    (the bench's long schema forces them)."""
    from monobatch.engine import engine

    monkeypatch.setattr(engine, "FORCED_DRAWS", forced)
    from monobatch.bench import CONSTRAINED_SCHEMA
    from monobatch.engine.constraint import StructuredOutput

    other = loaded.tokenizer.encode_chat([{"role": "user", "content": "Name three colours."}])

    def requests():
        return [_request("json", prompt, StructuredOutput.json_schema(SCHEMAS[19][0]), max_tokens=40),
                _request("long", prompt, StructuredOutput.json_schema(CONSTRAINED_SCHEMA), max_tokens=48),
                _request("short", prompt, StructuredOutput.choice(["yes", "no"]), max_tokens=10),
                _request("free", other, max_tokens=20, ignore_eos=True)]

    sync = _run(make_scheduler(async_scheduling=False, deterministic=deterministic), requests())
    sched = make_scheduler(async_scheduling=True, deterministic=deterministic)
    seen = _spy_async(sched)
    overlapped = _run(sched, requests())
    assert seen["unchecked"] and not seen["deferred"], seen
    assert not seen["host_not_device"], seen
    if forced:
        assert seen["forced"] > 0, seen
    else:
        assert seen["corrected"] > 0 and seen["void"] > 0 and not seen["forced"], seen  # refusals, recomputed rows
    for rid in sync:
        assert overlapped[rid] == sync[rid], rid
    assert sched.kv.usage().used_blocks == 0 and not sched.has_unfinished()


def test_refused_forced_redraw_is_corrected_and_equals_sync(make_scheduler, loaded):
    """A forced position's early redraw picks among unchecked candidates (ADR 0004, "Early forced
    redraws over unchecked candidates"): here (SCHEMAS[9] after ``": [``) the pick is refused by
    the step's check, corrected to the best accepted token and the step launched on it recomputes
    that row; the tokens equal the synchronous loop's."""
    from monobatch.engine.constraint import StructuredOutput

    ask = loaded.tokenizer.encode_chat([{"role": "user", "content": "What is 2+2?"}])

    def requests():
        return [_request("r", ask, StructuredOutput.json_schema(SCHEMAS[9][0]), max_tokens=64)]

    sync = _run(make_scheduler(async_scheduling=False, deterministic=True), requests())
    sched = make_scheduler(async_scheduling=True, deterministic=True)
    seen = _spy_async(sched)
    overlapped = _run(sched, requests())
    assert seen["forced_then_corrected"] > 0 and seen["void"] > 0, seen
    assert overlapped == sync


def test_async_scheduling_with_sampled_constrained_rows_equals_sync(make_scheduler, prompt, loaded):
    """A sampled row under a grammar is not greedy-checked: the draw of N+1 is deferred until N's
    tokens are accepted (its masks computed while the forward runs). Same tokens as the
    synchronous loop, beside a greedy constrained row and a free row."""
    from monobatch.engine.constraint import StructuredOutput

    other = loaded.tokenizer.encode_chat([{"role": "user", "content": "Name three colours."}])

    def requests():
        return [_request("json", prompt, StructuredOutput.json_schema(SCHEMAS[19][0]), max_tokens=40,
                         temperature=0.8, seed=11),
                _request("short", prompt, StructuredOutput.choice(["yes", "no"]), max_tokens=10),
                _request("free", other, max_tokens=20, ignore_eos=True)]

    sync = _run(make_scheduler(async_scheduling=False), requests())
    sched = make_scheduler(async_scheduling=True)
    seen = _spy_async(sched)
    overlapped = _run(sched, requests())
    assert seen["deferred"] and not seen["unchecked"], seen
    for rid in sync:
        assert overlapped[rid] == sync[rid], rid
    assert sched.kv.usage().used_blocks == 0


def test_the_greedy_mask_path_equals_the_full_chain(loaded):
    """Greedy rows under grammars skip the stage tables: their draws are the best token the grammar
    accepts (a scan of llguidance's check over the vocabulary) and the argmax of the full chain's
    masked logits (RowSampler.transform), beside plain and sampled rows — a forced position's
    splits included (the mask alone leaves "{" out where '{"city": "' is forced)."""
    from monobatch.engine.constraint import GrammarCompiler, StructuredOutput
    from monobatch.engine.params import SamplingParams
    from monobatch.engine.sampler import RowSampler, SamplerState

    tok = loaded.tokenizer
    grammars = GrammarCompiler(tok, tok.vocab_size)
    spec = StructuredOutput.json_schema(SCHEMAS[19][0])
    torch.manual_seed(3)
    logits = torch.randn(4, tok.vocab_size) * 4
    states = [SamplerState(SamplingParams(temperature=0), [1], 0, grammar=grammars.matcher(spec)),
              SamplerState(SamplingParams(temperature=0), [1], 0),
              SamplerState(SamplingParams(temperature=0), [1], 0, grammar=grammars.matcher(spec))]
    for t in tok.encode('{"city": "Pa', add_special_tokens=False):
        assert states[2].grammar.accept(t)
    sampler = RowSampler(tok.vocab_size)
    fast = sampler.draw(logits[:3], states).tolist()
    assert fast == [_accepted_argmax(logits[r], states[r].grammar, tok.vocab_size) if states[r].grammar
                    else int(logits[r].argmax()) for r in range(3)]
    assert fast == sampler.transform(logits[:3], states).argmax(dim=-1).tolist()
    assert fast == sampler._masked(logits[:3], states).argmax(dim=-1).tolist()
    assert tok.decode([fast[0]]) == "{"  # row 0's forced '{"city": "' split where the check accepts it
    # a row whose best token the grammar allows: the check passes, no mask is computed
    allowed_best = logits[:1].clone()
    allowed_best[0, tok.encode("{", add_special_tokens=False)[0]] = 1e4
    assert sampler.draw(allowed_best, states[:1]).tolist() == [tok.encode("{", add_special_tokens=False)[0]]
    assert tok.decode([fast[0]]).startswith("{")
    mixed = states + [SamplerState(SamplingParams(temperature=0.7, seed=1), [1], 1, grammar=grammars.matcher(spec))]
    assert sampler.draw(logits, mixed).tolist()[:3] == fast  # the full chain (a sampled row present)


def _accepted(matcher, vocab_size):
    """Every token id llguidance's check accepts next (a scan of the vocabulary: the oracle)."""
    return [t for t in range(vocab_size) if matcher.allows(t)]


def _accepted_argmax(row, matcher, vocab_size):
    """The greedy draw's definition: the best token the grammar accepts (first maximum)."""
    masked = torch.full_like(row, float("-inf"))
    ids = torch.tensor(_accepted(matcher, vocab_size))
    masked[ids] = row[ids]
    return int(masked.argmax())


def test_forced_ids_are_every_token_the_check_accepts(loaded):
    """At a forced position (a key, a quote, a separator) GrammarMatcher.forced_ids enumerates the
    splits of the forced bytes and the tokens extending them: exactly the tokens llguidance's check
    accepts there (a scan of the whole vocabulary). llguidance's own mask leaves some splits out
    there; fill_bitmasks adds them (GrammarMatcher.splits), so the masks are the accepted set at
    every position, forced or not. Walked over the states of two schemas."""
    from monobatch.bench import CONSTRAINED_SCHEMA
    from monobatch.engine.constraint import GrammarCompiler, StructuredOutput, fill_bitmasks

    tok = loaded.tokenizer
    grammars = GrammarCompiler(tok, tok.vocab_size)
    rng = np.random.default_rng(0)

    def ids(bitmask):
        return np.flatnonzero(np.unpackbits(bitmask.view(np.uint8), bitorder="little")[:tok.vocab_size]).tolist()

    forced_seen = fewer_in_mask = 0
    for schema in (SCHEMAS[0][0], CONSTRAINED_SCHEMA):
        m = grammars.matcher(StructuredOutput.json_schema(schema))
        for _ in range(14):
            if m.is_stopped:  # (the engine never checks a token there: the sequence has ended)
                break
            accepted = _accepted(m, tok.vocab_size)
            llg = ids(np.frombuffer(m.raw.compute_bitmask(), np.uint8))
            assert ids(fill_bitmasks([m], tok.vocab_size)[0]) == accepted
            forced = m.forced_ids()
            if m.raw.compute_ff_bytes():
                forced_seen += 1
                assert forced is not None and forced.tolist() == accepted
                assert sorted(set(llg) | set(m.splits())) == accepted
                fewer_in_mask += len(llg) < len(accepted)
            else:
                assert forced is None and not m.splits() and llg == accepted
            assert m.accept(int(rng.choice(accepted)))
    assert forced_seen >= 6 and fewer_in_mask >= 2, (forced_seen, fewer_in_mask)


def test_forced_draws_are_the_best_accepted_tokens(loaded):
    """RowSampler.forced_draws draws forced rows among the tokens their grammar may accept there (the
    unchecked candidates): where the grammar accepts the pick it is the greedy draw's definition
    (first maximum: ties go to the lowest id), on the device by a gather where a row has several
    candidates, on the host where each has one; rows not forced, or not asked for, left out; a
    refused pick is corrected by RowSampler.correct."""
    from monobatch.bench import CONSTRAINED_SCHEMA
    from monobatch.engine.constraint import GrammarCompiler, StructuredOutput
    from monobatch.engine.params import SamplingParams
    from monobatch.engine.sampler import RowSampler, SamplerState

    tok = loaded.tokenizer
    grammars = GrammarCompiler(tok, tok.vocab_size)

    def state(schema, text):
        s = SamplerState(SamplingParams(temperature=0), [1], 0, grammar=grammars.matcher(StructuredOutput.json_schema(schema)))
        for t in tok.encode(text, add_special_tokens=False):
            assert s.grammar.accept(t)
        return s

    states = [state(CONSTRAINED_SCHEMA, ""),  # forced '[{"name": "': one accepted token, '['
              state(CONSTRAINED_SCHEMA, '[{"name": "ab'),  # inside a string: not forced
              state(SCHEMAS[2][0], '{"tags":'),  # forced ' ["': ' ', ' [' and ' ["'
              state(CONSTRAINED_SCHEMA, ""),
              state(SCHEMAS[0][0], '{"name":')]  # forced ' "': many accepted (' ', ' "', ' ""', ...)
    widths = [None if s.grammar.forced_ids() is None else len(s.grammar.forced_ids()) for s in states]
    assert widths[0] == widths[3] == 1 and widths[1] is None and widths[2] > 1 and widths[4] > 4, widths
    sampler = RowSampler(tok.vocab_size)
    torch.manual_seed(5)
    logits = torch.randn(5, tok.vocab_size)
    tied = states[4].grammar.forced_ids()[1:].tolist()  # (the array is shared and read-only)
    logits[4, tied] = 9.0  # tied accepted tokens: the lowest id of them wins
    want = [_accepted_argmax(logits[r], states[r].grammar, tok.vocab_size) for r in range(5)]
    assert want[4] == int(tied[0])
    rows, at, ids = sampler.forced_draws(logits, states, [0, 1, 2, 3, 4], only={0, 1, 2, 4})
    assert rows == [0, 2, 4] and at.tolist() == rows
    assert ids.tolist() == [want[0], want[2], want[4]]
    # rows with one accepted token each: their draws are known on the host (uploaded, no gather)
    rows, at, ids = sampler.forced_draws(logits, states, [0, 1, 2, 3, 4], only={0, 1, 3})
    assert rows == [0, 3] and ids.tolist() == [want[0], want[3]] and at.tolist() == rows
    # a refused pick at a forced position is redrawn the same way (RowSampler.correct)
    assert sampler.correct(logits, states, [t + 1 for t in want], only={2, 4}) == {2: want[2], 4: want[4]}
    # the draws are over the unchecked candidates (every split and extension of the forced bytes, a
    # superset of the accepted tokens): a refused candidate above the accepted ones is drawn, and the
    # check corrects it to the best accepted token, as it corrects a refused raw argmax
    cands = states[4].grammar.forced_candidates()
    accepted = set(states[4].grammar.forced_ids().tolist())
    assert accepted < set(cands.tolist())
    refused = min(set(cands.tolist()) - accepted)
    logits[4, refused] = 20.0
    rows, at, ids = sampler.forced_draws(logits, states, [0, 1, 2, 3, 4], only={4})
    assert rows == [4] and ids.tolist() == [refused]
    assert sampler.correct(logits, states, [refused if r == 4 else 0 for r in range(5)], only={4}) == {4: want[4]}


def test_forced_redraws_leave_fewer_void_rows(make_scheduler, prompt, loaded, monkeypatch):
    """With the forced-position redraws on, async scheduling's unchecked draws are refused far
    less often, so far fewer rows are recomputed (void) — and the tokens stay the synchronous
    loop's (deterministic mode; two long constrained answers beside a free row)."""
    from monobatch.bench import CONSTRAINED_SCHEMA
    from monobatch.engine import engine
    from monobatch.engine.constraint import StructuredOutput

    other = loaded.tokenizer.encode_chat([{"role": "user", "content": "Name three colours."}])

    def requests():
        return [_req("a", prompt, StructuredOutput.json_schema(CONSTRAINED_SCHEMA), max_tokens=48),
                _req("b", other, StructuredOutput.json_schema(CONSTRAINED_SCHEMA), max_tokens=48),
                _req("free", other, max_tokens=24, ignore_eos=True)]

    ref = _run(make_scheduler(async_scheduling=False, deterministic=True), requests())
    seen = {}
    for forced in (False, True):
        monkeypatch.setattr(engine, "FORCED_DRAWS", forced)
        sched = make_scheduler(async_scheduling=True, deterministic=True)
        seen[forced] = _spy_async(sched)
        assert _run(sched, requests()) == ref, forced
        _pool_is_whole(sched)
    assert seen[True]["forced"] > 10 and seen[False]["void"] >= 5, seen
    assert seen[True]["void"] * 4 <= seen[False]["void"], seen


def test_a_schema_over_the_size_limit_says_so():
    """A schema whose JSON text is over MAX_SPEC_CHARS is refused with the limit in the message
    (it was reported as "cannot be serialized as JSON": the size check's error was caught as one)."""
    from monobatch.engine.constraint import MAX_SPEC_CHARS, StructuredOutput
    from monobatch.errors import InvalidRequestError

    schema = {"type": "object", "description": "x" * (MAX_SPEC_CHARS + 10)}
    for given in (schema, json.dumps(schema)):
        with pytest.raises(InvalidRequestError) as info:
            StructuredOutput.json_schema(given, "response_format")
        assert info.value.param == "response_format" and f"the limit of {MAX_SPEC_CHARS}" in str(info.value)


@pytest.mark.parametrize("schema", [{"const": 12345678901234567891}, {"enum": [1, 9007199254740993]},
                                    {"type": "integer", "minimum": -(2**60)},
                                    {"type": "object", "properties": {"n": {"maximum": 10**29}}},
                                    {"type": "object", "properties": {"title": {"const": 2**53 + 1}}},  # a name, not
                                    {"$defs": {"default": {"enum": [-(2**60)]}}},                     # an annotation
                                    {"anyOf": [{"allOf": [{"not": {"const": 2**54}}]}] * 2}])
def test_an_integer_the_grammar_would_round_is_refused(schema):
    """llguidance reads a schema's numbers as float64: an integer past 2**53 in a constraint would
    be rounded (the reply would break the schema with finish_reason stop), so it is a 400 naming the
    field; in annotations (description, default, examples) it is only text and is accepted."""
    from monobatch.engine.constraint import StructuredOutput
    from monobatch.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match=r"cannot be constrained exactly .*2\*\*53") as info:
        StructuredOutput.json_schema(schema, "response_format")
    assert info.value.param == "response_format"
    StructuredOutput.json_schema({"type": "integer", "maximum": 2**53, "default": 2**60, "examples": [10**30]})


def test_a_schema_nested_too_deep_is_an_invalid_request():
    from monobatch.engine.constraint import StructuredOutput
    from monobatch.errors import InvalidRequestError

    schema: dict = {"type": "object"}
    for _ in range(5000):
        schema = {"type": "object", "properties": {"a": schema}}
    with pytest.raises(InvalidRequestError) as info:
        StructuredOutput.json_schema(schema, "response_format")
    assert info.value.param == "response_format"


def test_padded_logit_columns_and_a_grammar(loaded):
    """A model whose lm_head has more columns than the tokenizer has tokens (HF exports pad it):
    the mask covers the tokenizer's ids, the padded columns stay -inf, nothing crashes."""
    from monobatch.engine.constraint import GrammarCompiler, StructuredOutput
    from monobatch.engine.params import SamplingParams
    from monobatch.engine.sampler import RowSampler, SamplerState

    tok = loaded.tokenizer
    grammars = GrammarCompiler(tok, tok.vocab_size)
    spec = StructuredOutput.choice(["yes", "no"])
    logits = torch.randn(2, tok.vocab_size + 200)
    logits[:, tok.vocab_size:] = 1e6  # a padded column must never win
    states = [SamplerState(SamplingParams(temperature=0), [1], 0, grammar=grammars.matcher(spec)),
              SamplerState(SamplingParams(temperature=0.8, seed=2), [1], 2, grammar=grammars.matcher(spec))]
    sampler = RowSampler(tok.vocab_size)
    for token in sampler.draw(logits, states).tolist():
        assert token < tok.vocab_size and tok.decode([token]) in ("y", "n", "yes", "no", "ye")
    assert sampler.sample(logits, states).token_ids[0] < tok.vocab_size


# -- async scheduling: void rows meet aborts, preemption, a finish on the corrected token ------------
def _req(rid, prompt, structured=None, **fields):
    """:func:`_request` that computes its whole prompt (no prefix-cache sharing between rows, so
    a sequence's KV blocks are its own and their count is exact)."""
    req = _request(rid, prompt, structured, **fields)
    req.bypass_prefix_cache = True
    return req


def _void_seqs(sched):
    """After a step: the running sequences whose row in the step in flight is void."""
    p = sched._pending
    return [] if p is None else [p.rows[r] for r in sorted(p.void) if not p.rows[r].is_finished]


def _held_blocks(sched, seq):
    return sum(b is not None for b in sched.kv.block_table(seq.seq_id))


def _step_until_void(sched, outs, seen):
    """Step until the step in flight has a void row; returns its sequence."""
    while sched.has_unfinished():
        for o in sched.step():
            outs.setdefault(o.request_id, []).append(o)
        void = _void_seqs(sched)
        if void:
            assert seen["corrected"], seen  # a refused draw was redrawn; the row launched on it is void
            return void[0]
    raise AssertionError(f"no void row in the whole run: {seen}")


def _drain(sched, outs):
    while sched.has_unfinished():
        for o in sched.step():
            outs.setdefault(o.request_id, []).append(o)


def _tokens(outs, rid):
    return [t for o in outs[rid] for t in o.token_ids]


def _pool_is_whole(sched):
    pool = sched.kv.blocks.pool
    assert sched.kv.usage().used_blocks == 0 and pool.num_available == pool.num_blocks
    assert sched.kv.num_sequences() == 0 and not sched.has_unfinished()


@pytest.fixture(scope="module")
def void_requests(prompt, loaded):
    from monobatch.bench import CONSTRAINED_SCHEMA
    from monobatch.engine.constraint import StructuredOutput

    other = loaded.tokenizer.encode_chat([{"role": "user", "content": "Name three colours."}])

    def requests():
        return [_req("long", prompt, StructuredOutput.json_schema(CONSTRAINED_SCHEMA), max_tokens=40),
                _req("long2", other, StructuredOutput.json_schema(CONSTRAINED_SCHEMA), max_tokens=40),
                _req("json", prompt, StructuredOutput.json_schema(SCHEMAS[19][0]), max_tokens=30),
                _req("free", other, max_tokens=24, ignore_eos=True)]
    return requests


def _async_until_void(make_scheduler, void_requests):
    """An async deterministic scheduler holding ``void_requests()``, stepped until the step in
    flight holds a void row: ``(scheduler, outputs so far by request id, that row's sequence)``."""
    sched = make_scheduler(async_scheduling=True, deterministic=True)
    seen = _spy_async(sched)
    for req in void_requests():
        sched.add_request(req)
    outs: dict = {}
    return sched, outs, _step_until_void(sched, outs, seen)


def test_abort_of_a_sequence_whose_ahead_row_is_void(make_scheduler, void_requests, unforced):
    """A request aborted while the step in flight holds a void row for it: its KV blocks are freed
    at once, its last output is the abort (nothing after), the other rows' tokens are unchanged
    (deterministic mode: a row's tokens do not depend on its neighbours), nothing leaks."""
    sched, outs, victim = _async_until_void(make_scheduler, void_requests)
    others = [r.request_id for r in void_requests() if r.request_id != victim.request_id]
    ref = _run(make_scheduler(async_scheduling=False, deterministic=True),
               [r for r in void_requests() if r.request_id in others])
    full = _run(make_scheduler(async_scheduling=False, deterministic=True),
                [r for r in void_requests() if r.request_id == victim.request_id])[victim.request_id]
    used, held = sched.kv.usage().used_blocks, _held_blocks(sched, victim)
    assert held > 0 and sched.abort(victim.request_id)
    assert sched.kv.block_table(victim.seq_id) == [] and sched.kv.usage().used_blocks == used - held
    before = len(outs.get(victim.request_id, []))
    _drain(sched, outs)
    mine = outs[victim.request_id]
    assert [o.finish_reason.value if o.finished else None for o in mine[before:]] == ["abort"]
    assert not mine[-1].token_ids and _tokens(outs, victim.request_id) == full[1][:len(_tokens(outs, victim.request_id))]
    for rid in others:
        assert (_tokens(outs, rid), outs[rid][-1].finish_reason.value) == ref[rid][1:], rid
    _pool_is_whole(sched)


def test_preempting_a_sequence_whose_ahead_row_is_void(make_scheduler, void_requests, unforced):
    """Preempted (recompute) while its row in the step in flight is void: the pending step is
    resolved first, the sequence's KV is freed, and once re-admitted it continues where it was:
    every request's tokens equal the synchronous loop's."""
    ref = _run(make_scheduler(async_scheduling=False, deterministic=True), void_requests())
    sched, outs, victim = _async_until_void(make_scheduler, void_requests)
    assert sched.preempt(victim.request_id)
    assert sched.kv.block_table(victim.seq_id) == [] and victim in sched.waiting and victim.num_computed == 0
    _drain(sched, outs)
    assert sched.stats().num_preemptions == 1
    for rid in ref:
        assert (_tokens(outs, rid), outs[rid][-1].finish_reason.value) == ref[rid][1:], rid
    _pool_is_whole(sched)


def test_kv_pressure_preempts_through_void_rows(make_scheduler, void_requests, unforced):
    """A pool too small for every request: the ahead step cannot reserve, the planned step
    preempts the newest sequence, while refusals keep voiding rows. Same tokens as the
    synchronous loop on the same pool; every block comes back."""
    small = dict(deterministic=True, max_model_len=128, block_size=16)
    probe = make_scheduler(**small)
    small["kv_cache_memory"] = 12 * probe.kv.block_bytes  # 192 tokens for four answers of ~80
    ref_sched = make_scheduler(async_scheduling=False, **small)
    ref = _run(ref_sched, void_requests())
    sched = make_scheduler(async_scheduling=True, **small)
    seen = _spy_async(sched)
    preempted = []
    real_preempt = sched.preempt

    def preempt(rid):
        seq = sched._find(rid)
        preempted.append((rid, seq.num_computed < seq.num_tokens))
        return real_preempt(rid)

    sched.preempt = preempt
    got = _run(sched, void_requests())
    assert sched.stats().num_preemptions > 0 and seen["corrected"] and seen["void"], (preempted, seen)
    assert got == ref
    _pool_is_whole(sched)


def test_a_corrected_token_that_ends_the_sequence(make_scheduler, prompt, unforced):
    """The redrawn (corrected) token ends its sequence — the grammar's end, a stop string, or
    max_tokens — while the step launched on the refused draw is in flight (its row is void):
    nothing is emitted after the finish, and the tokens equal the synchronous loop's."""
    from monobatch.engine.constraint import StructuredOutput

    schema = StructuredOutput.json_schema(SCHEMAS[19][0])

    def requests():
        return [_request("choice", prompt, StructuredOutput.choice(["yes", "no"]), max_tokens=10),
                _request("stop", prompt, schema, max_tokens=40, stop=["country"]),
                _request("length", prompt, schema, max_tokens=6),
                _request("json", prompt, schema, max_tokens=30)]

    sync = _run(make_scheduler(async_scheduling=False), requests())
    sched = make_scheduler(async_scheduling=True)
    seen = _spy_async(sched)
    ended = []
    real_finish = sched._finish_pending

    def finish_pending(pending, ahead=None):
        out = real_finish(pending, ahead)
        for r in pending.corrected:
            seq = pending.rows[r]
            if seq.is_finished:
                ended.append((seq.request_id, seq.finish_reason.value, ahead is not None and r in ahead.void))
        return out

    sched._finish_pending = finish_pending
    outs: dict = {}
    for req in requests():
        sched.add_request(req)
    _drain(sched, outs)
    # the choice's "no" and the stop string's token were redraws, each with the ahead step in flight;
    # max_tokens on a redraw launches no step ahead (the pending step is the sequence's last)
    assert ("choice", "stop", True) in ended and ("stop", "stop", True) in ended, (ended, seen)
    assert ("length", "length", False) in ended, (ended, seen)
    for rid, (text, ids, reason) in sync.items():
        mine = outs[rid]
        assert [o.finished for o in mine].index(True) == len(mine) - 1, rid  # the finish is the last output
        assert ("".join(o.text for o in mine), _tokens(outs, rid), mine[-1].finish_reason.value) == (text, ids, reason)
    assert sync["stop"][2] == "stop" and "country" not in sync["stop"][0]
    _pool_is_whole(sched)


def test_void_recomputes_are_not_counted_as_steps(make_scheduler, prompt, unforced):
    """Batch evidence (``shared_steps``) counts a request's steps: its prompt chunks and one decode
    per token after the first. A void row is recomputed the step after: counted once, so two
    identical requests sharing every step report exactly their steps, as the synchronous loop
    does, and the tokens generated are the tokens delivered."""
    from monobatch.bench import CONSTRAINED_SCHEMA
    from monobatch.engine.constraint import StructuredOutput

    def requests():
        return [_req(rid, prompt, StructuredOutput.json_schema(CONSTRAINED_SCHEMA), max_tokens=32) for rid in "ab"]

    metrics = {}
    for mode in (False, True):
        sched = make_scheduler(async_scheduling=mode)
        seen = _spy_async(sched)
        sched.add_finish_observer(lambda rec: metrics.__setitem__((mode, rec.request_id), rec.metrics))
        got = _run(sched, requests())
        assert sched.stats().generation_tokens_total == sum(len(ids) for _, ids, _ in got.values())
    assert seen["void"] > 0, seen
    for rid in "ab":
        sync, overlapped = metrics[(False, rid)], metrics[(True, rid)]
        steps = len(sync.prefill_chunks) + sync.num_output_tokens - 1
        assert sync.shared_steps == steps and sync.max_batch_seqs == 2
        assert (overlapped.shared_steps, overlapped.max_batch_seqs) == (steps, 2), rid


def test_a_refused_draw_is_redrawn_from_its_best_candidates_exactly(loaded, monkeypatch):
    """RowSampler.correct finds a refused pick's masked argmax among the row's best tokens (grammar
    checks, no mask) and masks only rows whose candidates are all refused (at a forced position, the
    few accepted tokens instead: no mask either); either way the result is the full mask's argmax,
    ties included (the first id of the maximum)."""
    from monobatch.engine import sampler as sampler_mod
    from monobatch.engine.constraint import GrammarCompiler, StructuredOutput
    from monobatch.engine.params import SamplingParams
    from monobatch.engine.sampler import RowSampler, SamplerState

    tok = loaded.tokenizer
    grammars = GrammarCompiler(tok, tok.vocab_size)
    spec = StructuredOutput.json_schema(SCHEMAS[19][0])
    # row 0: an enum's value (free: E..., A..., O...); rows 1 and 3 at forced keys; row 2 inside a string
    prefixes = ['{"city": "Paris", "country": {"name": "France", "continent": "', '{"', '{"city": "Pa',
                '{"city": "Paris", "coun']
    states = []
    for text in prefixes:
        state = SamplerState(SamplingParams(temperature=0), [1], 0, grammar=grammars.matcher(spec))
        for t in tok.encode(text, add_special_tokens=False):
            assert state.grammar.accept(t)
        states.append(state)
    assert [s.grammar.forced_ids() is not None for s in states] == [False, True, False, True]
    sampler = RowSampler(tok.vocab_size)
    masks = []
    real_masked = sampler._masked
    monkeypatch.setattr(sampler, "_masked", lambda x, st: (masks.append(x.shape[0]), real_masked(x, st))[1])
    gen = torch.Generator().manual_seed(5)
    for trial in range(6):
        logits = torch.randn(len(states), tok.vocab_size, generator=gen) * 3
        if trial in (1, 3):  # ties at the top: more ids than candidates (masks), or a few (sorted by id)
            top = logits.max(dim=-1, keepdim=True).values + 1
            logits[:, ::97 if trial == 1 else 9001] = top
        if trial == 5:  # row 0's few allowed tokens rank low: every candidate is refused, only a mask finds it
            logits[0, :] = torch.arange(tok.vocab_size, dtype=torch.float32) % 1000
        if trial >= 4:  # each row's masked argmax just below its raw best: the candidates serve it
            best = real_masked(logits, states).argmax(-1)
            served = torch.arange(trial - 4, len(states))  # (trial 5: not row 0)
            logits[served, best[served]] = logits[served].max(dim=-1).values - 1e-3
        picks = logits.argmax(-1).tolist()
        want = real_masked(logits, states).argmax(-1).tolist()
        masks.clear()
        fixed = sampler.correct(logits, states, picks)
        assert [fixed.get(r, p) for r, p in enumerate(picks)] == want, trial
        assert fixed, trial  # random logits: the grammars refuse the raw argmax
        if trial == 5:
            assert masks == [1], masks  # the one row the candidates could not serve
        elif trial == 4:
            assert not masks and len(fixed) >= 2, (masks, fixed)  # redraws, and no mask at all
    # fewer candidates than a row needs: the mask, and still the same answer
    monkeypatch.setattr(sampler_mod, "REDRAW_CANDIDATES", 1)
    logits = torch.randn(len(states), tok.vocab_size, generator=gen) * 3
    picks = logits.argmax(-1).tolist()
    fixed = sampler.correct(logits, states, picks)
    assert [fixed.get(r, p) for r, p in enumerate(picks)] == real_masked(logits, states).argmax(-1).tolist()


def test_a_long_forced_literal_costs_no_more_than_the_longest_token(loaded):
    """A schema's const (or a regex literal) forces up to 64 KiB of text at once; the split lookups
    at that position are bounded by the vocabulary's longest token, not the literal's length, and
    the forced position still draws from the accepted set. A position with more accepted splits
    and extensions than FORCED_MAX_TOKENS is left to the check (forced_ids None), its mask still
    the accepted set."""
    from monobatch.engine import constraint
    from monobatch.engine.constraint import GrammarCompiler, StructuredOutput, fill_bitmasks

    tok = loaded.tokenizer
    grammars = GrammarCompiler(tok, tok.vocab_size)
    literal = "abc " * 8000  # 32,000 forced characters
    m = grammars.matcher(StructuredOutput.json_schema({"const": literal}))
    index = grammars._token_index()
    forced = m.raw.compute_ff_bytes()
    assert len(forced) > 30000
    calls = []
    real_get = index._by_bytes.get
    index._by_bytes = type("Counted", (dict,), {"get": lambda self, k, d=None: (calls.append(len(k)), real_get(k, d))[1]})(index._by_bytes)
    ids = m.forced_ids()
    assert ids is not None and len(calls) <= index._longest and max(calls) <= index._longest
    assert ids.tolist() == _accepted(m, tok.vocab_size)
    # the remembered candidates: the same lists as the lookups, keyed by at most longest + 1
    # bytes however long the literal (it stays forced for thousands of positions)
    index._by_bytes = dict(index._by_bytes)
    for t in tok.encode('"' + literal[:400], add_special_tokens=False):
        assert m.accept(t)
        assert m.forced_ids() is not None
    for text in (forced, forced[:5], b'"', b"", literal.encode()[:index._longest + 3]):
        assert index.candidates(text) == (index.splits(text), index.extensions(text, constraint.FORCED_MAX_TOKENS))
    assert max(map(len, index._candidates)) <= index._longest + 1
    m2 = grammars.matcher(StructuredOutput.json_schema(SCHEMAS[0][0]))
    for t in tok.encode('{"name":', add_special_tokens=False):  # a forced ' "' with ~29 accepted tokens
        assert m2.accept(t)
    old = constraint.FORCED_MAX_TOKENS
    try:
        constraint.FORCED_MAX_TOKENS = 2
        assert m2.forced_ids() is None
        bits = np.unpackbits(fill_bitmasks([m2], tok.vocab_size)[0].view(np.uint8), bitorder="little")
        assert np.flatnonzero(bits[:tok.vocab_size]).tolist() == _accepted(m2, tok.vocab_size)
    finally:
        constraint.FORCED_MAX_TOKENS = old


def test_a_forced_position_asks_for_its_forced_bytes_once(loaded):
    """The early redraw's candidates (forced_candidates) and a refused pick's checked set
    (forced_ids) at one forced position share one llguidance forced-bytes call; the matcher asks
    again once it moves. The checked set is within the candidates."""
    from monobatch.engine.constraint import GrammarCompiler, StructuredOutput

    class Counting:  # the llguidance matcher, its calls counted
        def __init__(self, real) -> None:
            self.real, self.calls = real, []

        def __getattr__(self, name):
            def call(*args):
                self.calls.append(name)
                return getattr(self.real, name)(*args)
            return call

    tok = loaded.tokenizer
    m = GrammarCompiler(tok, tok.vocab_size).matcher(StructuredOutput.json_schema(SCHEMAS[0][0]))
    for t in tok.encode('{"name":', add_special_tokens=False):  # then a forced ' "'
        assert m.accept(t)
    m._m = counted = Counting(m._m)
    cands, ids = m.forced_candidates(), m.forced_ids()
    assert cands is not None and ids is not None and set(ids.tolist()) <= set(cands.tolist())
    assert ids.tolist() == _accepted(m, tok.vocab_size)
    assert counted.calls.count("compute_ff_bytes") == 1, counted.calls
    assert m.accept(int(ids[0]))
    m.forced_candidates()
    assert counted.calls.count("compute_ff_bytes") == 2, counted.calls


def test_accepting_another_token_than_the_one_advanced_past_rolls_it_back(loaded):
    """GrammarMatcher.accept of a token other than the one advance_if_allowed consumed (a draw
    replaced after the check) rolls that one back first: the matcher ends where a matcher that
    accepted the second token alone ends (same allowed set, same forced ids), and it can go on."""
    from monobatch.engine.constraint import GrammarCompiler, StructuredOutput, fill_bitmasks

    tok = loaded.tokenizer
    grammars = GrammarCompiler(tok, tok.vocab_size)
    spec = StructuredOutput.json_schema(SCHEMAS[19][0])
    a, b = grammars.matcher(spec), grammars.matcher(spec)
    for m in (a, b):
        for t in tok.encode('{"city": "Pa', add_special_tokens=False):
            assert m.accept(t)
    first, second = tok.encode("ris", add_special_tokens=False)[0], tok.encode("lo", add_special_tokens=False)[0]
    assert a.advance_if_allowed(first) and a.accept(second)
    assert b.accept(second)
    assert (fill_bitmasks([a], tok.vocab_size) == fill_bitmasks([b], tok.vocab_size)).all()
    assert a.forced_ids() is None and b.forced_ids() is None
    for t in tok.encode('", "country": {"name": "', add_special_tokens=False):
        assert a.accept(t) and b.accept(t)
    assert (fill_bitmasks([a], tok.vocab_size) == fill_bitmasks([b], tok.vocab_size)).all()


def test_is_stopped_is_asked_again_after_a_mask_or_a_lookup(loaded):
    """GrammarMatcher.is_stopped is remembered for a position, but llguidance's mask (and its
    forced-bytes and token-check lookups) can end the matcher in an error state at that same
    position (a resource limit: here a lexer fuel of 100): after fill_bitmasks, on one matcher and
    on the executor's path for several, the answer is llguidance's, not the remembered one."""
    import llguidance

    from monobatch.engine.constraint import GrammarCompiler, GrammarMatcher, StructuredOutput, fill_bitmasks

    tok = loaded.tokenizer
    grammars = GrammarCompiler(tok, tok.vocab_size)
    spec = StructuredOutput.regex("(a|b|c|d|e|f|g|h)*[a-z]{3}[0-9]{2}")

    def starved() -> GrammarMatcher:
        raw = llguidance.LLMatcher(grammars._ll_tokenizer(), spec.grammar_text(), log_level=0,
                                   limits=llguidance.LLParserLimits(step_lexer_fuel=100, initial_lexer_fuel=100))
        return GrammarMatcher(raw, grammars._token_index())

    for matchers in ([starved()], [starved(), starved()]):
        assert not any(m.is_stopped for m in matchers)  # remembered for this position
        fill_bitmasks(matchers, tok.vocab_size)
        for m in matchers:
            assert m.raw.is_error()  # the limit hit inside the mask
            assert m.is_stopped and m.failed


@pytest.mark.parametrize("pattern,cause", [("[0-9", "unclosed character class"), ("ab\\", "backslash at the end"),
                                           ("a{1000000}", "too large")])
def test_the_grammar_compiler_itself_refuses_a_bad_regex_in_one_line(loaded, pattern, cause):
    """Every path to a matcher (the doors, the scheduler's callers, bench, parity) goes through
    GrammarCompiler.compile, which checks a regex's syntax first: llguidance alone would take
    'ab\\' as 'ab'. Refused before it is cached."""
    from monobatch.engine.constraint import GrammarCompiler, StructuredOutput
    from monobatch.errors import InvalidRequestError

    grammars = GrammarCompiler(loaded.tokenizer, loaded.tokenizer.vocab_size)
    spec = StructuredOutput.regex(pattern, "regex")
    for call in (grammars.compile, grammars.matcher):
        with pytest.raises(InvalidRequestError, match=f"^regex: the regular expression .* does not compile: .*{cause}"):
            call(spec)


@pytest.mark.parametrize("penalty", [5e-324, 1e300])
def test_a_penalty_past_float32_keeps_the_grammar_in_charge(server, penalty):
    """A repeat penalty that rounds to 0 or inf in float32 (the fuzzer's 5e-324) once put inf into
    the logits: the softmax went NaN, the draw left the grammar's mask, the matcher failed and the
    reply was a 500. The penalty's results are kept finite, so the constrained reply is a JSON
    prefix (finish_reason length at 12 tokens) or whole JSON, never an error."""
    body = {"messages": QUESTION, "repeat_penalty": penalty, "max_tokens": 12, "logprobs": True,
            "response_format": {"type": "json_object"}}
    got = server.post("/v1/chat/completions", body)
    assert got.status_code == 200, got.text
    choice = got.json()["choices"][0]
    assert choice["finish_reason"] in ("length", "stop") and choice["message"]["content"].startswith("{")
    assert all(math.isfinite(t["logprob"]) or t["logprob"] == float("-inf") for t in choice["logprobs"]["content"])


def test_gbnf_unicode_escapes_mean_their_characters(loaded):
    """llguidance's GBNF converter drops a \\u escape's leading zeros (\\u00e9ab became \\ue9ab,
    another character, with no error): they reach it as \\xNN or the character itself, so the
    grammar allows what the escape means; an escaped backslash before a u is left alone."""
    import llguidance

    from monobatch.engine.constraint import GrammarCompiler, StructuredOutput, _gbnf_escapes

    assert _gbnf_escapes('root ::= "\\u00e9ab" [\\u0041-\\u005a] "\\U0001F600"') == \
        'root ::= "\\xe9ab" [\\x41-\\x5a] "\U0001F600"'
    assert _gbnf_escapes('root ::= "\\\\u0041"') == 'root ::= "\\\\u0041"'  # a backslash, then the letters
    assert _gbnf_escapes('start: "\\u00e9"') == 'start: "\\u00e9"'  # Lark is not converted
    compiler = GrammarCompiler(loaded.tokenizer, loaded.tokenizer.vocab_size)
    for grammar, text, other in (('root ::= "\\u00e9ab"', "éab", "\ue9ab"), ("root ::= [\\u0041-\\u005a]+", "QZ", "a")):
        spec = StructuredOutput.grammar(grammar, "grammar")
        compiler.compile(spec)
        m = llguidance.LLMatcher(compiler._ll_tokenizer(), spec.grammar_text())
        assert m.validate_tokens(loaded.tokenizer.encode(text, add_special_tokens=False)) > 0
        assert m.validate_tokens(loaded.tokenizer.encode(other, add_special_tokens=False)) == 0
