"""Structured outputs: the grammar mask as the sampler's first stage, through every door.

Engine tests run the bundled model in-process; server tests use the real ``monobatch serve``
shared with test_server.py (``--deterministic``) and the official ``openai`` client. Every
constrained reply that ends with ``stop`` is validated with ``jsonschema``.
"""

from __future__ import annotations

import json
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
    ({"guided_regex": "[0-9"}, "guided_regex"),
    ({"grammar": "root ::= ("}, "grammar"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a{1000}{1000}"}, "guided_regex"),  # llguidance's lexer limit, hit at the first mask
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
    draws that were redrawn (``corrected``) and the steps that recomputed such a row (``void``)."""
    engine, seen = sched.engine, {"deferred": 0, "unchecked": 0, "corrected": 0, "void": 0}
    real_launch, real_deferred, real_resolve = engine.launch, engine.draw_deferred, engine.resolve

    def launch(batch, rows, *args, **kw):
        seen["unchecked"] += bool(kw.get("unchecked"))
        seen["void"] += len(kw.get("replace") or {})
        return real_launch(batch, rows, *args, **kw)

    def resolve(pending):
        out = real_resolve(pending)
        seen["corrected"] += len(pending.corrected)
        return out

    engine.launch, engine.resolve = launch, resolve
    engine.draw_deferred = lambda pending: (seen.__setitem__("deferred", seen["deferred"] + 1), real_deferred(pending))[1]
    return seen


@pytest.mark.parametrize("deterministic", [False, True])
def test_async_scheduling_with_greedy_constrained_rows_equals_sync(make_scheduler, prompt, loaded, deterministic):
    """Async scheduling keeps greedy constrained rows in the overlap without masks: each draws its
    raw argmax on the device, checked against its grammar once the previous token is accepted;
    a refused draw is redrawn under the mask and the step already launched on it recomputes that
    row. Same tokens as the synchronous loop, beside free rows; a row whose grammar ends mid-run
    drops out cleanly; refusals really happen (the bench's long schema forces them)."""
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
    assert seen["corrected"] > 0 and seen["void"] > 0, seen  # refusals, and rows recomputed after them
    for rid in sync:
        assert overlapped[rid] == sync[rid], rid
    assert sched.kv.usage().used_blocks == 0 and not sched.has_unfinished()


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
    """Greedy rows under grammars skip the stage tables (RowSampler._masked); their draws equal the
    argmax of the full chain's logits (RowSampler.transform), beside plain and sampled rows."""
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
    assert fast == sampler.transform(logits[:3], states).argmax(dim=-1).tolist()
    assert fast == sampler._masked(logits[:3], states).argmax(dim=-1).tolist()
    # a row whose best token the grammar allows: the check passes, no mask is computed
    allowed_best = logits[:1].clone()
    allowed_best[0, tok.encode("{", add_special_tokens=False)[0]] = 1e4
    assert sampler.draw(allowed_best, states[:1]).tolist() == [tok.encode("{", add_special_tokens=False)[0]]
    assert tok.decode([fast[0]]).startswith("{")
    mixed = states + [SamplerState(SamplingParams(temperature=0.7, seed=1), [1], 1, grammar=grammars.matcher(spec))]
    assert sampler.draw(logits, mixed).tolist()[:3] == fast  # the full chain (a sampled row present)


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
