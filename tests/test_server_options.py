"""Server options on a second real `monobatch serve`: --api-key, --served-model-name, --max-queue
(429, and a 400 for what can never fit), a server-level sampling flag, --chat-template-file with a
template that opens a ``<think>`` block (the reasoning split, shared with `generate --chat`) and
raises on bad input (F2), dense KV storage for C1, and a small --prefill-chunk for C2 during a
prefill.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import pytest

from server_util import ROOT, Server, shared_server, sse_events
from test_server import assert_error
from test_server_cases import _aborts, _delta

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
#: ChatML (as SmolLM2's own) whose generation prompt opens a reasoning block, DeepSeek-R1 style.
THINK_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] == 'assistant' %}"
    "{{ raise_exception('a conversation cannot start with an assistant message') }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n<think>\\n' }}{% endif %}")
QUESTION = "Why is the sky blue?"
#: Prompt tokens per step: a long prompt takes many steps to prefill (C2 during a prefill).
PREFILL_CHUNK = "16"


@pytest.fixture(scope="session")
def template_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("templates") / "think.jinja"
    path.write_text(THINK_TEMPLATE)
    return path


@pytest.fixture(scope="session")
def server(template_file) -> Server:
    return shared_server("options", "-t", "1", "-c", "512", "--kv-storage", "dense", "--deterministic",
                         "--chat-template-file", str(template_file), "--api-key", KEY, "--max-num-seqs", "4",
                         "--max-queue", "2", "--served-model-name", "smol", "smol-alias", "--temperature", "0",
                         "--prefill-chunk", PREFILL_CHUNK)


def post(server: Server, path: str, body: dict, **kw) -> httpx.Response:
    return server.post(path, body, headers=AUTH, **kw)


def chat(server: Server, **kw) -> dict:
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 12,
                                              **kw})
    assert r.status_code == 200, r.text
    return r.json()


# -- API key and names ---------------------------------------------------------------------------------
def test_api_key_guards_the_api_but_not_health_or_metrics(server):
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/tokenize", {"prompt": "hi"}),
                       ("/detokenize", {"tokens": [1]})):
        assert_error(server.post(path, body), 401)
        assert_error(server.post(path, body, headers={"Authorization": "Bearer wrong"}), 401)
        assert server.post(path, {**body, "max_tokens": 1} if "compl" in path else body, headers=AUTH).status_code == 200
    assert_error(server.get("/v1/models"), 401)
    assert server.get("/health").status_code == 200
    assert server.get("/metrics").status_code == 200


def test_openai_client_with_key_and_served_names(server):
    import openai

    good = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in good.models.list().data] == ["smol", "smol-alias"]
    reply = good.chat.completions.create(model="smol-alias", messages=[{"role": "user", "content": QUESTION}],
                                         max_tokens=4)
    assert reply.model == "smol-alias"
    with pytest.raises(openai.NotFoundError):
        good.chat.completions.create(model="SmolLM2", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_server_sampling_flag_is_below_the_request(server):
    """--temperature 0 on the server: a request naming none is greedy; a request's own
    temperature wins (precedence: request > server flag > model > table)."""
    from concurrent.futures import ThreadPoolExecutor

    variants = [{"seed": 1}, {"seed": 2}, {"temperature": 0}] + [{"temperature": 1.5, "seed": s} for s in (1, 2, 3)]
    with ThreadPoolExecutor(len(variants)) as pool:
        texts = list(pool.map(lambda kw: chat(server, **kw)["choices"][0]["message"]["reasoning_content"], variants))
    assert texts[0] == texts[1] == texts[2]
    assert set(texts[3:]) - {texts[0]}


# -- reasoning split -------------------------------------------------------------------------------------
def test_reasoning_split_streamed_and_not(server):
    """A template that opens <think>: the reply goes to reasoning_content (streamed as
    delta.reasoning_content); per request reasoning_format "none" makes it all content."""
    separate = chat(server)["choices"][0]["message"]
    plain = chat(server, reasoning_format="none")["choices"][0]["message"]
    assert plain["content"] and "reasoning_content" not in plain
    assert separate["content"] == "" and separate["reasoning_content"] == plain["content"].lstrip()
    body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 12, "stream": True}
    with httpx.stream("POST", server.base_url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120) as r:
        events = sse_events(r.iter_lines())
    deltas = [e["choices"][0]["delta"] for e in events[:-1]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == separate["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == ""


def test_generate_chat_shares_the_reasoning_split(server, template_file):
    """`generate --chat` splits the same way (one chat-output module): its JSON has the
    server's reasoning_content for the same greedy request."""
    res = subprocess.run([sys.executable, "-m", "monobatch", "generate", "--chat", "-p", QUESTION, "-n", "12",
                          "--temperature", "0", "--output-format", "json", "-t", "1", "--no-progress", "-c", "512",
                          "--chat-template-file", str(template_file), "--deterministic", "--kv-storage", "dense",
                          "--prefill-chunk", PREFILL_CHUNK],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    message = chat(server)["choices"][0]["message"]
    assert out["reasoning_content"] == message["reasoning_content"] and out["content"] == message["content"]


# -- F2: template errors ------------------------------------------------------------------------------------
@pytest.mark.parametrize("stream_", [False, True])
def test_f2_template_raise_is_a_400_with_its_message(server, stream_):
    body = {"messages": [{"role": "assistant", "content": "x"}], "stream": stream_}
    assert_error(post(server, "/v1/chat/completions", body), 400, "messages", "cannot start with an assistant message")
    assert server.get("/health").status_code == 200


def test_f2_generation_prompt_ends_with_the_assistant_header(server):
    ids = post(server, "/tokenize", {"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
    assert post(server, "/detokenize", {"tokens": ids}).json()["prompt"].endswith("<|im_start|>assistant\n<think>\n")


# -- --max-queue ---------------------------------------------------------------------------------------------
def test_max_queue_429(server):
    """4 running + 2 queued fill the server; the next request (and an n=2 one) gets a 429
    before any SSE byte; once they are gone the server takes requests again."""
    body = {"messages": [{"role": "user", "content": QUESTION}], "max_tokens": 400, "ignore_eos": True,
            "stream": True}

    async def scenario():
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=120) as client:
            streams = []
            for _ in range(6):
                cm = client.stream("POST", "/v1/chat/completions", json=body)
                r = await cm.__aenter__()
                assert r.status_code == 200
                lines = r.aiter_lines()
                assert (await lines.__anext__()).startswith("data: ")  # the role chunk: submitted
                streams.append((cm, lines))  # a dropped line iterator would close its connection
            full = [await client.post("/v1/chat/completions", json=b) for b in (body, {**body, "n": 2, "stream": False})]
            for cm, _ in streams:
                await cm.__aexit__(None, None, None)
            return full

    for r in asyncio.run(scenario()):
        err = assert_error(r, 429)
        assert err["code"] == "rate_limit_exceeded" and err["type"] == "rate_limit_error"
    server.wait_idle(timeout=30)
    assert chat(server, max_tokens=2)["choices"][0]["finish_reason"] == "length"


def test_more_than_the_server_can_ever_hold_is_400_not_429(server):
    """Case 6: n over --max-num-seqs + --max-queue (4 + 2) can never fit: a 400, not a 429."""
    err = assert_error(post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                             "max_tokens": 1, "n": 7}), 400, "n", "limit is 6")
    assert err["type"] == "invalid_request_error"
    assert chat(server, max_tokens=1, n=6)["usage"]["completion_tokens"] == 6  # the limit itself fits


# -- C2 during a prefill ---------------------------------------------------------------------------------------
def test_c2_disconnect_during_prefill(server):
    """C2: a client gone while its long prompt is prefilled (16 tokens a step, ~30 steps) frees
    the sequence at the end of the chunk in flight: it never gets a token."""
    prompt = " ".join(["word"] * 470)
    base = server.wait_idle()
    body = {"prompt": prompt, "max_tokens": 20, "ignore_eos": True, "stream": True, "return_token_ids": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200
        deadline = time.monotonic() + 30
        while True:  # admitted: the prefill runs
            m = server.metrics()
            assert m["monobatch_generation_tokens_total"] == base["monobatch_generation_tokens_total"], \
                "precondition: the client leaves before the prefill ends"
            if m["monobatch_num_requests_running"] >= 1 and m["monobatch_prompt_tokens_total"] > \
                    base["monobatch_prompt_tokens_total"]:
                break
            assert time.monotonic() < deadline
    after = server.wait_idle(timeout=5)
    assert _aborts(after) - _aborts(base) == 1
    assert _delta(after, base, "monobatch_prompt_tokens_total") > 400, "precondition: the long prompt was admitted"
    assert _delta(after, base, "monobatch_generation_tokens_total") == 0  # aborted mid-prefill


# -- C1 on dense storage ----------------------------------------------------------------------------------------
def test_c1_dense_concurrent_equals_sequential(server):
    """C1 with --kv-storage dense: 4 prompts one at a time, then at once: identical tokens."""
    prompts = [f"Fact {i}: the {w} is" for i, w in enumerate(["sun", "river", "castle", "violin"])]

    def one(p):
        r = post(server, "/v1/completions", {"prompt": p, "max_tokens": 6, "return_token_ids": True})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    alone = [one(p) for p in prompts]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        assert list(pool.map(one, prompts)) == alone
