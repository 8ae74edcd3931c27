"""`monobatch run`: one chat turn through the server, in-process or with --server-base.

Invariant 1 for this door: greedy `run` prints exactly the server's reply to the same chat
request and exactly what `generate --chat` prints. The module's server uses dense KV storage (no
prefix cache), so every request computes its prompt cold, as `run` and `generate` do in their own
processes. It is started with `-n 5`: a server default that `run` must leave alone unless `-n` is
given (flags the user did not set are not sent).
"""

from __future__ import annotations

import io
import json
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from cli_util import STATS_RE, assert_one_line_error, cli_env, monobatch
from server_util import start_server

QUESTION = "What is the capital of France?"
GREEDY = ("--temperature", "0", "-n", "24")


@pytest.fixture(scope="module")
def server():
    s = start_server("-t", "1", "-c", "1024", "--kv-storage", "dense", "-n", "5")
    yield s
    s.stop()


def chat_reply(server, messages: list[dict], **fields) -> dict:
    r = server.post("/v1/chat/completions", {"messages": messages, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def stats_of(stderr: str) -> tuple[int, int, str]:
    """(prompt tokens, generated tokens, finish_reason) of the one --stats line on stderr."""
    lines = [ln for ln in stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    m = STATS_RE.fullmatch(lines[0])
    assert m, lines[0]
    return int(m.group(1)), int(m.group(2)), m.group(3)


def test_greedy_run_prints_the_server_reply_and_generate_output(server):
    """In-process `run`, `run --server-base`, the server's own answer and `generate --chat` agree
    to the character; stdout holds the reply alone, --stats goes to stderr."""
    py = [sys.executable, "-m", "monobatch"]
    local = subprocess.Popen([*py, "run", "-t", "1", "--no-progress", "--stats", *GREEDY, QUESTION], text=True,
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env())
    gen = subprocess.Popen([*py, "generate", "--chat", "-t", "1", "--no-progress", *GREEDY, "-p", QUESTION], text=True,
                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env())
    remote = monobatch("run", "--server-base", server.base_url, *GREEDY, QUESTION)
    body = chat_reply(server, [{"role": "user", "content": QUESTION}], temperature=0, max_tokens=24)
    local_out, local_err = local.communicate(timeout=300)
    gen_out, gen_err = gen.communicate(timeout=300)
    assert local.returncode == 0 and gen.returncode == 0 and remote.returncode == 0, (local_err, gen_err, remote.stderr)

    content = body["choices"][0]["message"]["content"]
    assert content.strip()
    assert local_out == remote.stdout == content + "\n" == gen_out
    assert remote.stderr == ""
    prompt, generated, finish = stats_of(local_err)
    usage = body["usage"]
    assert (prompt, generated, finish) == (usage["prompt_tokens"], usage["completion_tokens"],
                                           body["choices"][0]["finish_reason"])


def test_flags_not_given_leave_the_server_defaults(server):
    """The server runs with -n 5: `run` without -n gets 5 tokens, with -n 7 gets 7 (request >
    server flag); --system and a prompt on stdin reach the server as messages."""
    base = ("run", "--server-base", server.base_url, "--temperature", "0", "--ignore-eos", "--stats")
    res = monobatch(*base, "Tell me a story.")
    assert res.returncode == 0, res.stderr
    assert stats_of(res.stderr)[1:] == (5, "length")

    res = monobatch(*base, "-n", "7", "--system", "You are terse.", stdin="Tell me a story.\n")
    assert res.returncode == 0, res.stderr
    prompt, generated, finish = stats_of(res.stderr)
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Tell me a story."}]
    count = server.post("/tokenize", {"messages": messages}).json()["count"]
    assert (prompt, generated, finish) == (count, 7, "length")
    assert res.stdout == chat_reply(server, messages, temperature=0, ignore_eos=True, max_tokens=7)[
        "choices"][0]["message"]["content"] + "\n"


def test_an_empty_system_flag_is_an_empty_system_message_through_every_door(server):
    """`--system ''` is an empty system message, as the server and LLM.chat take one (left out, the
    template adds its default system prompt): generate --chat, run and chat build the prompt the
    server builds for those messages (generate once dropped it: 31 prompt tokens, not 15)."""
    messages = [{"role": "system", "content": ""}, {"role": "user", "content": "Hi!"}]
    count = server.post("/tokenize", {"messages": messages}).json()["count"]
    assert count != server.post("/tokenize", {"messages": messages[1:]}).json()["count"]
    assert chat_reply(server, messages, max_tokens=1)["usage"]["prompt_tokens"] == count
    gen = subprocess.Popen([sys.executable, "-m", "monobatch", "generate", "--chat", "--system", "", "-p", "Hi!",
                            "-n", "1", "-t", "1", "--no-progress", "--output-format", "json"], text=True,
                           stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env())
    remote = ("--server-base", server.base_url, "--system", "", "-n", "1", "--stats")
    run = monobatch("run", *remote, "Hi!")
    chat = monobatch("chat", *remote, stdin="Hi!\n")
    gen_out, gen_err = gen.communicate(timeout=300)
    assert run.returncode == chat.returncode == gen.returncode == 0, (run.stderr, chat.stderr, gen_err)
    assert stats_of(run.stderr)[0] == stats_of(chat.stderr)[0] == json.loads(gen_out)["usage"]["prompt_tokens"] == count


def test_only_given_flags_become_request_fields():
    """Sampling flags map onto request fields the server accepts; unset flags are not sent."""
    from monobatch.cli.main import build_parser
    from monobatch.cli.session import Session, check_flags
    from monobatch.server.protocol import ChatCompletionRequest

    parse = build_parser().parse_args
    ns = parse(["run", "--server-base", "http://127.0.0.1:1", "hi"])
    assert check_flags(ns) == {}
    assert Session(None, None, {}).body([{"role": "user", "content": "hi"}]) == {
        "messages": [{"role": "user", "content": "hi"}], "stream": True, "stream_options": {"include_usage": True}}

    every = ["--temperature", "0.5", "--seed", "3", "--top-k", "4", "--top-p", "0.9", "--min-p", "0.1",
             "--typical-p", "0.95", "--repeat-penalty", "1.1", "--repeat-last-n", "32", "--presence-penalty", "0.2",
             "--frequency-penalty", "0.3", "--dry-multiplier", "0.8", "--dry-base", "1.5", "--dry-allowed-length", "3",
             "--dry-penalty-last-n", "16", "--dry-sequence-breaker", "\n", "--logit-bias", "5=-1.5", "--stop", "END",
             "--stop", "FIN", "--ignore-eos", "--min-tokens", "2", "--reasoning-format", "none"]
    fields = check_flags(parse(["run", "--server-base", "http://127.0.0.1:1", *every, "hi"]))
    assert "max_tokens" not in fields
    assert fields["stop"] == ["END", "FIN"] and fields["logit_bias"] == {5: -1.5}
    wire = json.loads(json.dumps(Session(None, "m", fields).body([{"role": "user", "content": "hi"}])))
    request = ChatCompletionRequest.model_validate(wire)  # strict: every field known and well typed
    sent = request.sampling_request()
    assert sent["repeat_penalty"] == 1.1 and sent["logit_bias"] == {"5": -1.5} and sent["seed"] == 3
    assert request.reasoning_format == "none" and request.model == "m"
    assert set(fields) - {"reasoning_format"} <= set(sent)


def test_seed_minus_1_is_left_out_for_a_remote_server():
    """--seed -1 (llama.cpp's "random") has no API value: OpenAI reads any integer as a fixed seed,
    so /regen would repeat itself. With --server-base the request has no seed (random there); in
    process -1 is sent, which this server reads as random even when it runs with --seed."""
    from monobatch.cli.main import build_parser
    from monobatch.cli.session import check_flags, request_fields
    from monobatch.engine.params import resolve_sampling

    remote = check_flags(build_parser().parse_args(["run", "--server-base", "http://127.0.0.1:1", "--seed", "-1",
                                                    "hi"]))
    assert "seed" not in remote
    assert check_flags(build_parser().parse_args(["run", "--server-base", "http://127.0.0.1:1", "--seed", "7",
                                                  "hi"]))["seed"] == 7
    local = request_fields(build_parser().parse_args(["chat", "--seed", "-1"]))
    assert local == {"seed": -1}
    assert resolve_sampling(local, {"seed": 42}).seed is None


@pytest.mark.parametrize("n", ["-1", "-2"])
def test_no_limit_is_refused_for_a_remote_server_only(n, capsys):
    """-n -1/-2 (no limit) has no API value: refused with --server-base (not silently dropped, which
    would apply the remote server's default); in process the field is left out, as before."""
    from monobatch.cli.main import build_parser, main
    from monobatch.cli.session import request_fields

    rc = main(["run", "--server-base", f"http://127.0.0.1:{free_port()}", "-n", n, "hi"])
    out, err = capsys.readouterr()
    assert_one_line_error(subprocess.CompletedProcess([], rc, out, err),
                          "-n -1 cannot be sent to a remote server (the API has no 'no limit' value); leave -n out "
                          "to use the server's default")
    assert rc == 1
    assert request_fields(build_parser().parse_args(["run", "-n", n, "--temperature", "0", "hi"])) == {
        "temperature": 0.0}


def test_a_temperature_over_the_apis_range_applies_in_process():
    """`run --temperature 3` (llama.cpp's knob, over OpenAI's 0-2 that the HTTP API holds to): in
    process the field is left out (the server there was built from the flags: its default is 3);
    to a remote server it is sent, and that server's answer (ours: a 400) is the one line."""
    from monobatch.cli.main import build_parser
    from monobatch.cli.session import request_fields

    parse = build_parser().parse_args
    assert request_fields(parse(["run", "--temperature", "3", "hi"])) == {}
    assert request_fields(parse(["run", "--temperature", "2", "hi"])) == {"temperature": 2.0}
    assert request_fields(parse(["run", "--server-base", "http://127.0.0.1:1", "--temperature", "3", "hi"])) == {
        "temperature": 3.0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("args,needles", [
    (["--server-base", "localhost:8080", "hi"], ["--server-base", "http://"]),
    (["--server-base", "http://127.0.0.1:{port}", "-m", "x.gguf", "hi"], ["-m/--model", "--server-base"]),
    (["--server-base", "http://127.0.0.1:{port}", "--loop-window", "8", "hi"], ["--loop-window", "server setting"]),
    (["--api-key", "k", "hi"], ["--api-key needs --server-base"]),
    (["--top-p", "2", "hi"], ["--top-p"]),
    (["--logprobs", "2", "hi"], ["unrecognized arguments: --logprobs"]),  # run prints text only
    (["-m", "/nowhere/model.gguf", "hi"], ["model not found"]),
    (["-p", "a", "b"], ["the prompt was given as an argument and with -p/--prompt: give it once"]),
    (["-ngl", "99", "hi"], ["-ngl", "no layer offload", "--device cuda"]),  # llama.cpp's flag, not "-n gl"
    ([""], ["prompt is empty"]),
    (["--frobnicate", "hi"], ["unrecognized"]),
])
def test_bad_input_is_one_line(args, needles, capsys):
    """Refused before anything loads or connects (in-process: main() is what a user runs)."""
    from monobatch.cli.main import main

    port = str(free_port())
    try:
        rc = main(["run", *[a.replace("{port}", port) for a in args]])
    except SystemExit as exc:  # argparse
        rc = exc.code
    out, err = capsys.readouterr()
    assert_one_line_error(subprocess.CompletedProcess(args, rc, out, err), *needles)


@pytest.mark.parametrize("command", ["run", "chat", "bench-serve"])
@pytest.mark.parametrize("key,from_env,needle", [
    ("clé", False, "--api-key must be printable ASCII without spaces"),
    ("two words", False, "--api-key must be printable ASCII without spaces"),
    ("", False, "--api-key must not be empty"),
    ("clé", True, "$MONOBATCH_API_KEY must be printable ASCII without spaces"),
])
def test_a_clients_api_key_is_checked_as_serve_checks_it(command, key, from_env, needle, monkeypatch, capsys):
    """A key no Authorization header can carry (it once raised httpx's "'ascii' codec can't
    encode" traceback) is refused before connecting by serve's own check, naming where the key
    came from; an empty $MONOBATCH_API_KEY is no key, as for serve."""
    from monobatch.cli.main import main

    url = f"http://127.0.0.1:{free_port()}"
    argv = [command, "--base-url" if command == "bench-serve" else "--server-base", url]
    argv += [] if from_env else ["--api-key", key]
    argv += ["hi"] if command == "run" else []
    if from_env:
        monkeypatch.setenv("MONOBATCH_API_KEY", key)
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    rc = main(argv)
    out, err = capsys.readouterr()
    assert_one_line_error(subprocess.CompletedProcess(argv, rc, out, err), f"monobatch {command}: error: {needle}")
    assert rc == 1


@pytest.mark.parametrize("command", ["run", "chat", "bench-serve"])
@pytest.mark.parametrize("url,why", [
    ("http://[::1", "(Invalid port: ':1')"),
    ("http://127.0.0.1:abc", "(Invalid port: 'abc')"),
    ("http://ex_ample..com", "(the host name 'ex_ample..com' has an empty or overlong label)"),
    ("http://xn--a.com:8080", "(Codepoint U+0080 at position 1 of '\\x80' not allowed)"),
    ("http://:8080", "(no host)"),
    ("http://127.0.0.1:70000", "(port 70000 is not in 1..65535)"),
    ("http://127.0.0.1:0", "(port 0 is not in 1..65535)"),
])
def test_a_server_url_no_request_could_use_is_one_line(command, url, why, monkeypatch, capsys):
    """A malformed --server-base / --base-url (once httpx's InvalidURL or the resolver's
    UnicodeError as a traceback) or a port outside 1..65535 (once "connection refused") is refused
    before any request, one line naming the flag and the URL."""
    from monobatch.cli.main import main

    flag = "--base-url" if command == "bench-serve" else "--server-base"
    argv = [command, flag, url, *(["hi"] if command == "run" else [])]
    monkeypatch.setattr("sys.stdin", io.StringIO("hi\n"))
    rc = main(argv)
    out, err = capsys.readouterr()
    assert_one_line_error(subprocess.CompletedProcess(argv, rc, out, err),
                          f"monobatch {command}: error: {flag}: not a usable http(s) URL: {url!r} {why}")
    assert rc == 1


def test_unreachable_server_is_one_line():
    assert_one_line_error(monobatch("run", "--server-base", f"http://127.0.0.1:{free_port()}", "hi", timeout=120),
                          "cannot connect", "Connection refused")


@pytest.mark.parametrize("remote", [False, True])
def test_constraint_errors_name_the_flag(server, tmp_path, remote):
    """A bad --grammar-file or --json-schema is refused by the server's request check (run sends
    them as request fields): the line names the flag, as generate's does, not the field."""
    bad = tmp_path / "bad.gbnf"
    bad.write_text("root ::= foo\n")
    where = ["--server-base", server.base_url] if remote else ["-t", "1", "-c", "256"]
    res = monobatch("run", *where, "--grammar-file", str(bad), "-n", "2", "hi")
    assert_one_line_error(res, "--grammar-file: ", "does not parse")
    res = monobatch("run", *where, "--json-schema", '{"type": "frobnicate"}', "-n", "2", "hi")
    assert_one_line_error(res, "--json-schema: ")
    # a regex that parses but is too large for the lexer: refused by the server (structured_outputs.regex),
    # the line worded as generate's --regex line
    res = monobatch("run", *where, "--regex", "a{1000000}", "-n", "2", "hi")
    assert_one_line_error(res, '--regex: the regular expression "a{1000000}" does not compile: ', "too large")


def test_a_regex_that_does_not_parse_is_refused_before_connecting():
    """--regex's syntax is checked here, as generate checks it, before the server is asked (none
    listens on the port: the line is the regex's, not "cannot connect"), in generate's words."""
    res = monobatch("run", "--server-base", f"http://127.0.0.1:{free_port()}", "--regex", "\\d+[a-", "hi", timeout=120)
    assert_one_line_error(res, 'monobatch run: error: --regex: the regular expression "\\d+[a-" does not compile: '
                               "unclosed character class")


def test_server_error_is_one_line(server):
    """A request the server refuses (400): its message, named by the CLI flag, on one line."""
    res = monobatch("run", "--server-base", server.base_url, "--logit-bias", "999999=1", "hi")
    assert_one_line_error(res, "--logit-bias", "vocabulary")


@pytest.mark.parametrize("command", ["run", "chat"])
def test_help(command):
    res = monobatch(command, "--help", timeout=60)
    assert res.returncode == 0 and "--server-base" in res.stdout and "--stats" in res.stdout


# -- the HTTP client against a scripted server (no model) -------------------------------------------------
RAW_STREAMS = {
    "bad-choice": ['data: {"choices": ["x"]}'],
    "bad-delta": ['data: {"choices": [{"index": 0, "delta": "x", "finish_reason": null}]}'],
    "bad-usage": ['data: {"choices": [], "usage": "x"}'],
    "bad-content": ['data: {"choices": [{"index": 0, "delta": {"content": 5}, "finish_reason": null}]}'],
    "llama-error": ['data: {"choices": [{"index": 0, "delta": {"content": "Par"}, "finish_reason": null}]}',
                    'error: {"code": 500, "message": "slot\\nfailed", "type": "server_error"}'],
}


class ScriptedServer(BaseHTTPRequestHandler):
    """/health answers 503 twice (loading), then 200; the chat endpoint plays the script named by
    the user's message."""

    health_calls = 0
    health_error: dict | None = None  # set: /health answers 503 with this OpenAI error body, always

    def log_message(self, *args) -> None:
        pass

    def _send(self, status: int, body: bytes, kind: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health":
            type(self).health_calls += 1
            if self.health_error is not None:
                self._send(503, json.dumps({"error": self.health_error}).encode())
            else:
                self._send(503 if self.health_calls <= 2 else 200, b"{}")
        else:
            self._send(200, json.dumps({"object": "list", "data": [{"id": "scripted"}]}).encode())

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert body["model"] == "scripted" and body["stream"] is True
        script = body["messages"][-1]["content"]
        if script == "plain-500":
            return self._send(500, b"oops", "text/plain")
        if script in RAW_STREAMS:  # a non-conforming server: these lines, then the connection closes
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            self.wfile.write(b"".join(line.encode() + b"\n\n" for line in RAW_STREAMS[script]))
            self.close_connection = True
            return
        events = {
            "think": [{"reasoning_content": "hmm "}, {"reasoning_content": "ok"}, {"content": "Yes."}],
            "error-event": [{"error": {"message": "engine\nfailed"}}],
            "cut": [{"content": "Par"}],
        }[script]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        self.wfile.write(b": keep-alive\n\n")
        for delta in events:
            event = delta if "error" in delta else {"choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
        if script == "think":
            usage = {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
            self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        if script != "cut":
            self.wfile.write(b"data: [DONE]\n\n")
        self.close_connection = True


@pytest.fixture(scope="module")
def scripted():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), ScriptedServer)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()


def run_main(*args: str) -> int:
    from monobatch.cli.main import main

    return main(["run", *args])


def test_waits_for_a_loading_server_and_splits_reasoning(scripted, capsys):
    """503 from /health: one waiting line, then the reply; reasoning to stderr, content to stdout."""
    ScriptedServer.health_calls = 0
    assert run_main("--server-base", scripted, "--stats", "think") == 0
    out, err = capsys.readouterr()
    assert out == "Yes.\n"
    assert err.count("is loading its model") == 1 and "hmm ok" in err
    assert "[3 prompt + 4 generated tokens, finish_reason=None, TTFT" in err


@pytest.mark.parametrize("script,needle", [
    ("error-event", "the server failed during the reply: engine failed"),
    ("plain-500", "the server answered HTTP 500: oops"),
])
def test_server_failures_are_one_line(scripted, capsys, script, needle):
    ScriptedServer.health_calls = 2
    rc = run_main("--server-base", scripted, script)
    out, err = capsys.readouterr()
    assert_one_line_error(subprocess.CompletedProcess([], rc, out, err), needle)


@pytest.mark.parametrize("script", ["bad-choice", "bad-delta", "bad-usage", "bad-content"])
def test_malformed_chunks_are_one_line(scripted, capsys, script):
    """Chunks whose choices / delta / usage are not objects: one line, no AttributeError."""
    ScriptedServer.health_calls = 2
    rc = run_main("--server-base", scripted, script)
    out, err = capsys.readouterr()
    assert_one_line_error(subprocess.CompletedProcess([], rc, out, err), "malformed chat chunk")


def test_llama_cpp_error_line(scripted, capsys):
    """llama.cpp's mid-stream ``error: {...}`` line: the server's message, after the text so far."""
    ScriptedServer.health_calls = 2
    assert run_main("--server-base", scripted, "llama-error") == 1
    out, err = capsys.readouterr()
    assert out == "Par" and err.strip().endswith("the server failed during the reply: slot failed"), err


def test_stream_cut_short(scripted, capsys):
    ScriptedServer.health_calls = 2
    assert run_main("--server-base", scripted, "cut") == 1
    out, err = capsys.readouterr()
    assert out == "Par" and err.strip().endswith("closed the stream before the reply ended")


def test_a_server_that_will_not_become_healthy_fails_at_once(scripted, capsys):
    """/health 503 with a code other than model_loading (engine_stopped): the server's message on
    one line, at once, not a wait for LOAD_WAIT seconds."""
    ScriptedServer.health_calls = 0
    ScriptedServer.health_error = {"message": "the engine has stopped", "type": "server_error", "param": None,
                                   "code": "engine_stopped"}
    try:
        start = time.monotonic()
        rc = run_main("--server-base", scripted, "think")
        elapsed = time.monotonic() - start
    finally:
        ScriptedServer.health_error = None
    out, err = capsys.readouterr()
    assert_one_line_error(subprocess.CompletedProcess([], rc, out, err), "HTTP 503", "the engine has stopped")
    assert "loading" not in err and ScriptedServer.health_calls == 1 and elapsed < 5


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("tty", [True, False])
def test_reasoning_ends_its_line_on_a_terminal(tty):
    """--reasoning-format separate: on a terminal, a newline on stderr when the content follows
    the reasoning text (once); redirected, stderr holds the reasoning text alone."""
    from monobatch.cli.http_client import ChatChunk
    from monobatch.cli.session import Reply, Session

    class Client:
        def stream_chat(self, body):
            yield from [ChatChunk(reasoning="hmm "), ChatChunk(reasoning="ok"), ChatChunk(content="Yes"),
                        ChatChunk(content="."), ChatChunk(finish_reason="stop")]

    out, err = io.StringIO(), (_Tty() if tty else io.StringIO())
    Session(Client(), None, {}).stream_reply([{"role": "user", "content": "hi"}], Reply(), out, err)
    assert out.getvalue() == "Yes."
    assert err.getvalue() == ("hmm ok\n" if tty else "hmm ok")
