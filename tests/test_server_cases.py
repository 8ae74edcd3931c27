"""Field cases over HTTP on a real `monobatch serve` (deterministic, paged KV): stop strings (S1,
S2), multibyte text over SSE (T1), penalties (P1), concurrency (C1, 32 streaming clients) and
client disconnects (C2). Concrete strings come from a first greedy run; every precondition a test
relies on is asserted. Requests of one test are sent concurrently: under --deterministic a
request's tokens do not depend on its neighbours, and that is itself checked (C1).
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from server_util import Server, assert_400_naming, sse_events
from test_server import MAIN_ARGS, QUESTION, STORY, parallel, server  # noqa: F401  (the session's server)

NEVER = "@#"  # a suffix the model never writes (asserted)
FFFD = "\ufffd"
ENDPOINTS = ("completions", "chat")


def body_for(endpoint: str, prompt: str, **kw) -> tuple[str, dict]:
    if endpoint == "chat":
        return "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], "temperature": 0, **kw}
    return "/v1/completions", {"prompt": prompt, "temperature": 0, **kw}


def run(server: Server, endpoint: str, prompt: str, streamed: bool, **kw) -> dict:
    """One request, streamed or not: its text, finish_reason, token ids and (streamed) deltas."""
    path, body = body_for(endpoint, prompt, return_token_ids=True, **kw)
    if not streamed:
        r = server.post(path, body)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        return {"text": c["message"]["content"] if endpoint == "chat" else c["text"], "finish": c["finish_reason"],
                "ids": c["token_ids"], "deltas": None, "raw": c}
    with httpx.stream("POST", server.base_url + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    choices = [e["choices"][0] for e in events[:-1] if e["choices"]]
    deltas = [c["delta"].get("content", "") if endpoint == "chat" else c["text"] for c in choices]
    return {"text": "".join(deltas), "finish": choices[-1]["finish_reason"], "deltas": deltas,
            "ids": [t for c in choices for t in c.get("token_ids", [])], "raw": choices}


# -- S1, S2 ----------------------------------------------------------------------------------------
PROMPTS = {"completions": STORY, "chat": "Tell me a short story about a cat."}
REF_TOKENS = 24


@pytest.fixture(scope="module")
def references(server):
    """Greedy reference per endpoint: text, and each token's text (from logprobs)."""
    refs = {}
    for endpoint in ENDPOINTS:
        lp = {"logprobs": 0} if endpoint == "completions" else {"logprobs": True}
        out = run(server, endpoint, PROMPTS[endpoint], False, max_tokens=REF_TOKENS, **lp)
        raw = out["raw"]["logprobs"]
        tokens = raw["tokens"] if endpoint == "completions" else [t["token"] for t in raw["content"]]
        assert "".join(tokens) == out["text"] and out["finish"] == "length" and NEVER not in out["text"]
        assert all(FFFD not in t for t in tokens), "the reference must be plain text"
        refs[endpoint] = (out["text"], tokens)
    return refs


def stop_strings(text: str, tokens: list[str]) -> dict[str, str]:
    """Three stop strings whose first occurrence is: inside one token, across 2-3 tokens, and
    starting mid-token; each checked against the reference's token offsets."""
    starts = [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]

    def token_at(pos: int) -> int:
        return max(i for i, s in enumerate(starts) if s <= pos)

    found = {}
    for i in range(1, len(tokens) - 2):
        t, nxt = tokens[i], tokens[i + 1]
        candidates = {}
        if len(t) >= 4:
            candidates["inside"] = t[1:3]
        if len(t) >= 2 and len(nxt) >= 2:
            candidates["across"] = t[-2:] + nxt[:2]
            candidates["mid"] = t[1:] + nxt
        for kind, stop in candidates.items():
            at = text.find(stop)
            if kind in found or at < 0:
                continue
            first, last = token_at(at), token_at(at + len(stop) - 1)
            ok = {"inside": first == last and at > starts[first] and at + len(stop) < starts[first] + len(tokens[first]),
                  "across": 2 <= last - first + 1 <= 3,
                  "mid": at > starts[first] and last > first}[kind]
            if ok:
                found[kind] = stop
    assert set(found) == {"inside", "across", "mid"}, found
    return found


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_s1_stop_strings_held_across_tokens(server, references, endpoint):
    """S1: streamed and non-streamed text are equal, end just before the stop string, contain no
    part of it, finish_reason "stop" — for a stop inside a token, across tokens, from mid-token."""
    text, tokens = references[endpoint]
    stops = stop_strings(text, tokens)
    jobs = [(stop, streamed) for stop in stops.values() for streamed in (False, True)]
    outs = parallel(lambda stop, streamed: run(server, endpoint, PROMPTS[endpoint], streamed, max_tokens=REF_TOKENS,
                                               stop=[stop]), jobs)
    for (stop, streamed), out in zip(jobs, outs):
        assert out["text"] == text[:text.find(stop)], (stop, streamed)
        assert out["finish"] == "stop"


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_s2_held_prefix_released_once(server, references, endpoint):
    """S2: a stop string whose prefix occurs but whose whole never does: the held text comes out
    exactly once — mid-stream, and when max_tokens ends the sequence while it is held."""
    text, tokens = references[endpoint]
    mid = next(i for i in range(len(text) // 2, len(text) - 3) if text[i:i + 2].strip() == text[i:i + 2])
    stops = [text[mid:mid + 2] + NEVER, text[-2:] + NEVER]  # prefix mid-text; prefix held at the end
    assert all(s not in text and s[:2] in text for s in stops)
    jobs = [(stop, streamed) for stop in stops for streamed in (False, True)]
    outs = parallel(lambda stop, streamed: run(server, endpoint, PROMPTS[endpoint], streamed, max_tokens=REF_TOKENS,
                                               stop=[stop]), jobs)
    for out in outs:
        assert out["text"] == text and out["finish"] == "length"


def test_s2_held_prefix_released_at_eos(server):
    """S2: the reply ends by EOS while a stop prefix is held: released once, finish "stop"."""
    ref = run(server, "chat", QUESTION, False, max_tokens=32)
    assert ref["finish"] == "stop" and len(ref["ids"]) < 32  # ended by EOS
    stop = ref["text"][-2:] + NEVER
    for out in parallel(lambda streamed: run(server, "chat", QUESTION, streamed, max_tokens=32, stop=[stop]),
                        [(False,), (True,)]):
        assert out["text"] == ref["text"] and out["finish"] == "stop"


# -- T1 ----------------------------------------------------------------------------------------------
T1_PROMPTS = {"completions": "Emoji: 😀😃😄", "chat": "Reply only with emoji: 😀😃😄"}


@pytest.mark.parametrize("max_tokens", [15, 16])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_t1_multibyte_over_sse(server, endpoint, max_tokens):
    """T1: characters split across tokens (emoji, ZWJ sequences) stream whole: the SSE deltas
    joined equal the non-streamed text and the decoding of all ids at once; U+FFFD only for
    bytes left incomplete at the end."""
    plain, streamed = parallel(lambda s: run(server, endpoint, T1_PROMPTS[endpoint], s, max_tokens=max_tokens),
                               [(False,), (True,)])
    ids = plain["ids"]
    whole = server.post("/detokenize", {"tokens": ids}).json()["prompt"]
    singles = [server.post("/detokenize", {"tokens": [t]}).json()["prompt"] for t in ids]
    assert any(FFFD in s for s in singles), "precondition: a character split across tokens"
    assert any(ord(ch) > 0xFFFF for ch in whole), "precondition: astral-plane characters"
    assert streamed["ids"] == ids
    assert plain["text"] == streamed["text"] == whole
    assert FFFD not in whole.rstrip(FFFD)
    assert all(FFFD not in d for d in streamed["deltas"][:-1])


def test_text_offset_streamed_equals_non_streamed(server):
    """Case 12 (legacy logprobs): with characters split across tokens and text held back for a
    possible stop string, the streamed text_offset equals the non-streamed one."""
    prompt = T1_PROMPTS["completions"]
    first = run(server, "completions", prompt, False, max_tokens=16)["text"]
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "logprobs": 0, "stop": [first[:1] + NEVER]}

    def streamed_events() -> list:
        with httpx.stream("POST", server.base_url + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
            return sse_events(r.iter_lines())

    plain, events = parallel(lambda f: f(), [(lambda: server.post("/v1/completions", body).json()["choices"][0],),
                                             (streamed_events,)])
    chunks = [e["choices"][0] for e in events[:-1] if e["choices"]]
    streamed = {k: [v for c in chunks if c["logprobs"] for v in c["logprobs"][k]] for k in ("tokens", "text_offset")}
    lp = plain["logprobs"]
    assert any(FFFD in t for t in lp["tokens"]), "precondition: a character split across tokens"
    assert any(not c["text"] for c in chunks[:-1]), "precondition: some output's text was held back"
    assert plain["text"] == "".join(c["text"] for c in chunks) == first
    assert streamed == {"tokens": lp["tokens"], "text_offset": lp["text_offset"]}
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][-1] <= len(first)


# -- P1 ----------------------------------------------------------------------------------------------
#: The word the reference answers with occurs once, at the start: more than 64 tokens back.
P1_FAR_PROMPT = ("The secret word is zebra. Then we walked along the quiet river, counted seven boats, talked about "
                 "old books, drank some tea, watched the sunset over distant hills, and finally went home tired but "
                 "happy after a long and pleasant day outside in the fresh air. The next morning we woke early, "
                 "cooked eggs for breakfast, fed the neighbour's cat, wrote two letters to friends abroad, and "
                 "planned another trip. The secret word is")


def test_p1_which_tokens_each_penalty_counts(server):
    """P1: presence/frequency penalties count generated tokens only (the first draw is the
    unpenalised one); the repetition penalty counts the prompt within repeat_last_n (0 = off,
    default 64, -1 = whole context: a word only further back than 64 tokens is penalised by -1
    alone). Fields and llama.cpp's alias reach the engine."""
    prompt = "1 1 1 1 1 1 1 1 1 1 1 1"
    variants = [(prompt, {}), (prompt, {"presence_penalty": 2.0}), (prompt, {"frequency_penalty": 2.0}),
                (prompt, {"repetition_penalty": 3.0}), (prompt, {"repeat_penalty": 3.0}),
                (prompt, {"repetition_penalty": 3.0, "repeat_last_n": 0}),
                (P1_FAR_PROMPT, {}), (P1_FAR_PROMPT, {"repetition_penalty": 3.0}),
                (P1_FAR_PROMPT, {"repetition_penalty": 3.0, "repeat_last_n": -1})]
    outs = parallel(lambda text, kw: completion_ids(server, text, **kw), variants)
    (ref, prompt_ids), presence, frequency, rep, rep_alias, rep_off, (far, far_ids), far_64, far_all = outs
    assert ref[0] in prompt_ids and len(set(ref)) < len(ref), "precondition: the reference repeats the prompt"
    assert presence[0][0] == frequency[0][0] == ref[0]  # the first draw sees no generated token
    assert frequency[0] != ref  # later draws see the generated repeats
    assert rep[0][0] != ref[0]  # the prompt counts
    assert rep_alias[0] == rep[0]
    assert rep_off[0] == ref
    at = [i for i, t in enumerate(far_ids) if t == far[0]]
    assert at and max(at) < len(far_ids) - 64, "precondition: the answer occurs only beyond the last 64 tokens"
    assert far_64[0][0] == far[0]  # the default window does not reach it
    assert far_all[0][0] != far[0]  # -1: the whole context does


def completion_ids(server: Server, prompt: str, **kw) -> tuple[list[int], list[int]]:
    r = server.post("/v1/completions", {"prompt": prompt, "temperature": 0, "max_tokens": 8,
                                        "return_token_ids": True, **kw})
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return c["token_ids"], c["prompt_token_ids"]


# -- C1: concurrency ---------------------------------------------------------------------------------
TOPICS = ["the sea", "mountains", "bread", "music", "winter", "cats", "rivers", "books", "trains", "gardens",
          "the moon", "coffee", "rain", "bicycles", "forests", "cities"]
C1_PROMPTS = [f"Item {i}: the best thing about {TOPICS[i % 16]} is" for i in range(32)]


async def _stream_ids(client: httpx.AsyncClient, base: str, i: int, delay: float) -> tuple[list[int], str]:
    await asyncio.sleep(delay)
    endpoint = ENDPOINTS[i % 2]
    path, body = body_for(endpoint, C1_PROMPTS[i], max_tokens=5, return_token_ids=True, stream=True)
    ids, text = [], []
    async with client.stream("POST", base + path, json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                for c in json.loads(line[6:])["choices"]:
                    ids += c.get("token_ids", [])
                    text.append(c["delta"].get("content", "") if endpoint == "chat" else c["text"])
    return ids, "".join(text)


def test_c1_32_concurrent_streams_equal_solo(server):
    """C1: 32 streaming clients at once, then 8 staggered, each get exactly the tokens and text
    they get alone (one at a time), on the deterministic server."""
    solo = [run(server, ENDPOINTS[i % 2], C1_PROMPTS[i], False, max_tokens=5) for i in range(32)]

    async def together(delays):
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=64)) as client:
            return await asyncio.gather(*(_stream_ids(client, server.base_url, i, d) for i, d in delays))

    at_once = asyncio.run(together([(i, 0.0) for i in range(32)]))
    rng = random.Random(5)
    staggered = asyncio.run(together([(i, rng.uniform(0, 0.6)) for i in range(0, 32, 4)]))
    for i, (ids, text) in enumerate(at_once):
        assert (ids, text) == (solo[i]["ids"], solo[i]["text"]), i
    for k, i in enumerate(range(0, 32, 4)):
        assert staggered[k] == (solo[i]["ids"], solo[i]["text"]), i


# -- C2: disconnects ---------------------------------------------------------------------------------
#: Tokens a sequence may still get after its client closed: the steps in flight while the close
#: travels (the read of the chunk, the send that fails, the abort before the next step).
C2_SLACK_TOKENS = 8


def _aborts(metrics: dict) -> float:
    return metrics.get('monobatch_request_success_total{finished_reason="abort"}', 0.0)


def _delta(after: dict, before: dict, name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def _read_then_close(server: Server, path: str, body: dict, chunks: int, headers=None) -> None:
    with httpx.stream("POST", server.base_url + path, json={**body, "stream": True}, timeout=120,
                      headers=headers) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(chunks):
            while not next(lines):
                pass


def assert_aborted_promptly(before: dict, after: dict, sequences: int, chunks_read: int) -> None:
    """The sequences were aborted within a couple of steps of their client leaving: they got
    about the tokens their client read (not the 500 they asked for), and an aborted sequence
    is counted as such, not in the end-to-end latency histogram."""
    assert _aborts(after) - _aborts(before) == sequences
    generated = _delta(after, before, "monobatch_generation_tokens_total")
    assert generated <= sequences * (chunks_read + C2_SLACK_TOKENS), generated
    assert _delta(after, before, "monobatch_e2e_request_latency_seconds_count") == 0
    assert after["monobatch_kv_cache_used_blocks"] == 0 and after["monobatch_kv_cache_used_bytes"] == 0


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_c2_disconnect_mid_stream_frees_everything(server, endpoint):
    """C2: read 3 chunks of a long stream (n=1 and n=2), close: the sequences are aborted within
    a couple of steps and no KV block stays referenced."""
    for n in (1, 2):
        base = server.wait_idle()
        path, body = body_for(endpoint, STORY, max_tokens=500, ignore_eos=True, n=n)
        _read_then_close(server, path, body, chunks=3)
        assert_aborted_promptly(base, server.wait_idle(timeout=5), n, chunks_read=3)


def test_c2_non_streaming_client_gone(server):
    """C2: a non-streaming client that gives up (read timeout) frees its sequence at once."""
    base = server.wait_idle()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", json={"prompt": STORY, "max_tokens": 500, "ignore_eos": True},
                   timeout=httpx.Timeout(120, read=1.0))
    after = server.wait_idle(timeout=5)
    assert _aborts(after) - _aborts(base) == 1
    assert _delta(after, base, "monobatch_generation_tokens_total") < 500


def test_c2_fifty_disconnects_leak_nothing(server):
    """C2, the cheap variant 50 times: open a chat stream, read its first chunk, close."""
    base = server.wait_idle()
    path, body = body_for("chat", QUESTION, max_tokens=200, ignore_eos=True)
    for _ in range(50):
        _read_then_close(server, path, body, chunks=1)
    assert_aborted_promptly(base, server.wait_idle(timeout=10), 50, chunks_read=1)


# -- a regex constraint that does not compile ------------------------------------------------------
BAD_REGEXES = [("[0-9", "unclosed character class"), ("(ab", "unclosed group"),
               ("ab\\", "incomplete escape sequence (a backslash at the end)"), ("\\d+[a-", "unclosed character class")]


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("field", ["structured_outputs", "guided_regex"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_regex_that_does_not_compile_is_a_400_saying_so(server, endpoint, field, stream):
    """vLLM's structured_outputs.regex and guided_regex: the 400 names the field, says the regular
    expression does not compile and gives the short cause (not llguidance's "at 1(8): invalid regex
    ... (in regex): regex parse error", a position in the Lark grammar the pattern is wrapped in).
    ``ab\\`` is Rust regex's error too; llguidance alone would drop the backslash and constrain to "ab"."""
    param = "structured_outputs.regex" if field == "structured_outputs" else "guided_regex"
    for pattern, cause in BAD_REGEXES:
        constraint = {"structured_outputs": {"regex": pattern}} if field == "structured_outputs" else {field: pattern}
        path, body = body_for(endpoint, "Hi", max_tokens=4, stream=stream, **constraint)
        err = assert_400_naming(server, path, body, param)
        assert err["param"] == param, err
        # the pattern as typed: "\\d+[a-", as the CLI's --regex and the Python API show it (not JSON-quoted)
        assert err["message"].startswith(f'{param}: the regular expression "{pattern}" does not compile: '), err
        assert err["message"].endswith(cause) and "\n" not in err["message"], err["message"]
        assert "at 1(" not in err["message"] and "(in regex)" not in err["message"], err["message"]
