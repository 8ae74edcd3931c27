"""`monobatch chat`, driven as a user drives it: through a pty (pexpect), against a separately
started `monobatch serve` (with an API key) and in-process.

The module's server runs `--deterministic` with its key from $MONOBATCH_API_KEY, so a greedy
reply is the same bit for bit whatever the prefix cache holds: the REPL's replies are compared with
the server's own answers to the conversation the REPL should have sent, and the prompt sizes
its --stats lines report with `/tokenize` of those messages (the history, exactly). The
conversation logic (/regen, Ctrl-C, refused turns, multi-line input) is also unit-tested with a
scripted session.
"""

from __future__ import annotations

import signal
import sys
import time

import pexpect
import pytest

from cli_util import STATS_RE, assert_one_line_error, clean, cli_env, monobatch
from monobatch.cli import chat
from monobatch.cli.http_client import ClientError
from monobatch.cli.session import Reply
from server_util import start_server

KEY = "test-key-6"
AUTH = {"Authorization": f"Bearer {KEY}"}
N = 12  # reply length in the pty tests
DETERMINISTIC = ("-t", "1", "-c", "1024", "--deterministic")


@pytest.fixture(scope="module")
def server():
    s = start_server(*DETERMINISTIC, env={"MONOBATCH_API_KEY": KEY})
    yield s
    s.stop()


def server_reply(server, messages: list[dict], max_tokens: int = N) -> str:
    r = server.post("/v1/chat/completions", {"messages": messages, "temperature": 0, "max_tokens": max_tokens},
                    headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["message"]["content"]


def prompt_tokens(server, messages: list[dict]) -> int:
    r = server.post("/tokenize", {"messages": messages}, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()["count"]


def interactive_signals() -> None:
    """In the child before it runs: SIGINT back to its default, as in a terminal's shell. A suite
    started in the background (``cmd &`` without job control, ``nohup``) inherits SIGINT ignored,
    and Python then installs no KeyboardInterrupt handler: every ^C sent would be lost (the Ctrl-C
    test then waited out its timeouts while the reply streamed in full)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def spawn(*args: str, env: dict | None = None):
    child = pexpect.spawn(sys.executable, ["-m", "monobatch", "chat", *args], env=env or cli_env(TERM="dumb"),
                          encoding="utf-8", timeout=120, dimensions=(24, 400), preexec_fn=interactive_signals)
    child.expect_exact("/help lists the commands", timeout=240)
    child.expect_exact(chat.PROMPT)
    return child


def say(child, *lines: str) -> tuple[str, int, int]:
    """Type ``lines`` (one message), wait for its --stats line and the next prompt; returns the
    reply as shown and the prompt / generated token counts."""
    for line in lines:
        child.sendline(line)
    child.expect(STATS_RE)
    prompt, generated = int(child.match.group(1)), int(child.match.group(2))
    shown = clean(child.before)
    child.expect_exact(chat.PROMPT)
    return shown, prompt, generated


def assert_said(shown: str, reply: str) -> None:
    assert reply.strip() and shown.endswith(reply + "\n"), (shown, reply)


def test_two_turns_regen_clear_multiline_exit(server):
    """History across turns, /regen (same history without the last reply), /clear, both
    multi-line forms, /help, /exit — with --api-key."""
    child = spawn("--server-base", server.base_url, "--api-key", KEY, "--temperature", "0", "-n", str(N), "--stats")
    u1, u2 = "Name a colour.", "Name another one."
    shown, prompt, _ = say(child, u1)
    a1 = server_reply(server, [{"role": "user", "content": u1}])
    assert_said(shown, a1)
    assert prompt == prompt_tokens(server, [{"role": "user", "content": u1}])

    history = [{"role": "user", "content": u1}, {"role": "assistant", "content": a1}, {"role": "user", "content": u2}]
    shown, prompt, _ = say(child, u2)
    a2 = server_reply(server, history)
    assert_said(shown, a2)
    assert prompt == prompt_tokens(server, history)

    shown, prompt_again, _ = say(child, "/regen")
    assert_said(shown, a2)  # greedy: the same reply again, from the same history
    assert prompt_again == prompt

    child.sendline("/clear")
    child.expect_exact("(conversation cleared)")
    child.expect_exact(chat.PROMPT)
    shown, prompt, _ = say(child, u1)
    assert_said(shown, a1)
    assert prompt == prompt_tokens(server, [{"role": "user", "content": u1}])

    child.sendline("/clear")
    child.expect_exact(chat.PROMPT)
    block = [{"role": "user", "content": "Say hi\nin French."}]
    shown, prompt, _ = say(child, '"""Say hi', 'in French."""')
    a_block = server_reply(server, block)
    assert_said(shown, a_block)
    assert prompt == prompt_tokens(server, block)
    child.sendline("/clear")
    child.expect_exact(chat.PROMPT)
    shown, prompt, _ = say(child, "Say hi\\", "in French.")
    assert_said(shown, a_block)
    assert prompt == prompt_tokens(server, block)

    child.sendline("/help")
    child.expect_exact("/regen")
    child.expect_exact(chat.PROMPT)
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_ctrl_c_stops_the_reply_not_the_session(server):
    """Ctrl-C during a long reply: the stream closes, the server aborts the request (nothing left
    running, no KV block held), the REPL asks again and the next turn streams in full (the session
    and its HTTP client survive a KeyboardInterrupt mid-read); Ctrl-C at the prompt too; Ctrl-D
    ends it. The API key comes from $MONOBATCH_API_KEY."""
    long = 160  # every reply's length (--ignore-eos): the interrupted one stops long before it
    server.wait_idle(headers=AUTH)
    before = server.metrics()
    child = spawn("--server-base", server.base_url, "--temperature", "0", "-n", str(long), "--ignore-eos", "--stats",
                  env=cli_env(TERM="dumb", MONOBATCH_API_KEY=KEY))
    child.sendline("Count to one hundred.")
    deadline = time.monotonic() + 120
    while server.metrics()["monobatch_generation_tokens_total"] < before["monobatch_generation_tokens_total"] + 4:
        assert time.monotonic() < deadline, clean(child.before or "")
        time.sleep(0.1)
    # ... and the client has shown reply text, so the ^C lands in its stream loop, not in readline's
    # hand-back of the typed line (once, in a full suite on the loaded 2-core machine, the ^C sent
    # on the server's count alone was never acted on and the reply streamed in full)
    child.expect_exact("Count to one hundred.")
    child.expect(r"\w", timeout=120)
    child.sendintr()
    child.expect_exact("[interrupted]")
    child.expect_exact(chat.PROMPT)
    after = server.wait_idle(timeout=10)  # long before 400 tokens: the request was aborted
    assert after["monobatch_generation_tokens_total"] - before["monobatch_generation_tokens_total"] < long
    aborts = 'monobatch_request_success_total{finished_reason="abort"}'
    deadline = time.monotonic() + 10
    while server.metrics().get(aborts, 0) != before.get(aborts, 0) + 1:
        assert time.monotonic() < deadline, "the reply was not counted as aborted"
        time.sleep(0.1)

    child.sendline("Now count backwards.")  # a real turn after the interrupted one: it streams in full
    child.expect(STATS_RE, timeout=240)
    assert (int(child.match.group(2)), child.match.group(3)) == (long, "length")
    assert "monobatch chat: error" not in clean(child.before)
    child.expect_exact(chat.PROMPT)

    child.send("half a line")
    # Wait for readline's echo first: a SIGINT that lands while readline is still handling the
    # typed keys (not blocked in select) is only acted on at the next key press (CPython's
    # readline loop), so a ^C sent 50 ms after the keys can wait for ever on a loaded machine.
    child.expect_exact("half a line")
    time.sleep(0.2)
    child.sendintr()  # at the prompt: the line is dropped, the session goes on
    child.expect_exact(chat.PROMPT)
    child.sendline("/help")
    child.expect_exact("/clear")
    child.expect_exact(chat.PROMPT)
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_in_process_chat_with_progress_bar(server):
    """No --server-base: the model loads in the chat process (a progress bar on the terminal)
    and its greedy reply equals the separately started server's."""
    child = pexpect.spawn(sys.executable, ["-m", "monobatch", "chat", *DETERMINISTIC, "--temperature", "0", "-n",
                                           "8", "--stats"], env=cli_env(TERM="dumb"), encoding="utf-8", timeout=240,
                          dimensions=(24, 120))
    child.expect_exact("loading weights")
    child.expect_exact("in this process")
    child.expect_exact(chat.PROMPT)
    shown, prompt, generated = say(child, "Hi!")
    messages = [{"role": "user", "content": "Hi!"}]
    assert_said(shown, server_reply(server, messages, max_tokens=8))
    assert prompt == prompt_tokens(server, messages) and generated <= 8
    child.sendline("/exit")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


def test_piped_chat_and_api_key_errors(server):
    """stdin not a terminal: one message per line, replies alone on stdout. A missing or wrong
    key is one line on stderr."""
    res = monobatch("chat", "--server-base", server.base_url, "--api-key", KEY, "--temperature", "0", "-n", "6",
                    stdin="Hi!\n/clear\nHello!\n")
    assert res.returncode == 0 and res.stderr == "(conversation cleared)\n", res.stderr
    assert res.stdout == "".join(server_reply(server, [{"role": "user", "content": u}], 6) + "\n"
                                 for u in ("Hi!", "Hello!"))
    refused = monobatch("chat", "--server-base", server.base_url, "--api-key", KEY, "--logit-bias", "999999=1",
                        stdin="Hi!\n/clear\nHello!\n")  # the server refuses every turn (400)
    assert refused.returncode == 1 and refused.stdout == "", refused
    assert refused.stderr.count("monobatch chat: error:") == 2 and "vocabulary" in refused.stderr, refused.stderr
    assert_one_line_error(monobatch("chat", "--server-base", server.base_url, stdin="Hi!\n"),
                          "needs an API key", "--api-key")
    assert_one_line_error(monobatch("run", "--server-base", server.base_url, "--api-key", "wrong", "Hi!"),
                          "refused the API key")


# -- the conversation logic, with a scripted session -----------------------------------------------------
class ScriptedSession:
    """Stands in for Session: each turn plays the next script item (a reply text, or a
    ``(partial text, exception)`` pair) and records the messages it was sent."""

    def __init__(self, *script) -> None:
        self.script, self.sent = list(script), []

    def stream_reply(self, messages, reply: Reply, out=None, err=None) -> Reply:
        self.sent.append([dict(m) for m in messages])
        item = self.script.pop(0)
        text, exc = item if isinstance(item, tuple) else (item, None)
        if text:
            reply.content.append(text)
        if exc is not None:
            raise exc
        reply.finish_reason, reply.usage = "stop", {"prompt_tokens": 1, "completion_tokens": 1}
        return reply


def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


def test_history_regen_and_clear(capsys):
    session = ScriptedSession("A1", "A2", "A2b", "A3")
    convo = chat.Conversation([{"role": "system", "content": "S"}])
    chat.ask(session, convo, "U1", stats=True)
    chat.ask(session, convo, "U2", stats=False)
    chat.regenerate(session, convo, stats=False)
    assert session.sent[1] == session.sent[2] == [{"role": "system", "content": "S"}, user("U1"), assistant("A1"),
                                                  user("U2")]
    assert convo.turns[-1] == assistant("A2b")
    convo.clear()
    chat.ask(session, convo, "U3", stats=False)
    assert session.sent[3] == [{"role": "system", "content": "S"}, user("U3")]
    out, err = capsys.readouterr()
    assert out == "\n" * 4  # the scripted session prints nothing itself; each reply ends a line
    assert err.count("prompt + 1 generated tokens") == 1  # --stats for the first turn only


def test_interrupted_and_refused_turns(capsys):
    session = ScriptedSession(("partial", KeyboardInterrupt()), ("", KeyboardInterrupt()),
                              ("", ClientError("prompt too long", 400, "context_length_exceeded")),
                              "fresh", ("", ClientError("gone")))
    convo = chat.Conversation([])
    chat.ask(session, convo, "U1", stats=True)  # Ctrl-C after some text: what was shown stays
    assert convo.turns == [user("U1"), assistant("partial")]
    chat.ask(session, convo, "U2", stats=True)  # Ctrl-C before any text: the turn is undone
    chat.ask(session, convo, "U3", stats=True)  # refused: undone, the error on stderr
    assert convo.turns == [user("U1"), assistant("partial")]
    chat.regenerate(session, convo, stats=False)
    assert convo.turns == [user("U1"), assistant("fresh")]
    chat.regenerate(session, convo, stats=False)  # fails: the old reply comes back
    assert convo.turns == [user("U1"), assistant("fresh")]
    err = capsys.readouterr().err
    assert err.count("[interrupted]") == 2 and "generated tokens" not in err
    assert "error: prompt too long (/clear starts a new conversation)" in err
    assert "error: gone" in err
    assert convo.failures == 2  # refused turns are counted (a piped chat exits 1); Ctrl-C is none


def test_regen_with_nothing_to_regenerate(capsys):
    chat.regenerate(ScriptedSession(), chat.Conversation([]), stats=False)
    assert "nothing to regenerate" in capsys.readouterr().err


def lines(*typed: str):
    """An input() stand-in that returns ``typed`` then raises EOFError; records the prompts."""
    queue, prompts = list(typed), []

    def read_line(prompt: str) -> str:
        prompts.append(prompt)
        if not queue:
            raise EOFError
        return queue.pop(0)

    read_line.prompts = prompts
    return read_line


@pytest.mark.parametrize("typed,message", [
    (["one line"], "one line"),
    (["first \\", "second\\", "third"], "first \nsecond\nthird"),
    (['"""', "a", "", "b", '"""'], "a\n\nb"),
    (['"""a', 'b"""'], "a\nb"),
    (['  """inline"""'], "inline"),
    (['"""', "  indented", 'end """'], "  indented\nend "),
])
def test_multi_line_input(typed, message):
    read_line = lines(*typed)
    assert chat.read_message(read_line) == message
    assert read_line.prompts == [chat.PROMPT] + [chat.CONTINUATION] * (len(typed) - 1)


@pytest.mark.parametrize("typed", [['"""', "never closed"], ['"""never closed'], ["continued \\"],
                                   ["first \\", "second \\"]])
def test_end_of_input_inside_a_message(typed, capsys):
    """The partial message is not sent: one line on stderr, and the turn counts as failed (a
    piped chat exits 1)."""
    with pytest.raises(chat.UnfinishedMessage):
        chat.read_message(lines(*typed))
    session, convo = ScriptedSession(), chat.Conversation([])
    assert chat.repl(session, convo, lines(*typed), stats=False) is True
    assert session.sent == [] and convo.failures == 1
    assert capsys.readouterr().err == "monobatch chat: error: the input ended inside a message; it was not sent\n"


def test_piped_chat_ending_inside_a_message_exits_1(server):
    """A real piped chat against the module's server: the unsent message is one line on stderr,
    nothing on stdout, exit 1 (no request is made, so nothing is generated)."""
    for stdin in ('"""\nnever closed\n', "continued \\\n"):
        res = monobatch("chat", "--server-base", server.base_url, "--api-key", KEY, stdin=stdin)
        assert res.returncode == 1, res
        assert_one_line_error(res, "monobatch chat: error: the input ended inside a message; it was not sent")


def test_a_message_that_is_not_utf8_is_refused_and_the_session_goes_on(capsys):
    """A line holding bytes that are not UTF-8 (read as lone surrogates) is not sent: one line on
    stderr, the turn counts as failed (a piped chat exits 1, as `run` does for such a prompt), and
    the next message is sent as usual."""
    session, convo = ScriptedSession("A1"), chat.Conversation([])
    assert chat.repl(session, convo, lines("hello \udcff world", "U1"), stats=False) is True
    assert session.sent == [[user("U1")]] and convo.failures == 1
    assert capsys.readouterr().err == ("monobatch chat: error: the message is not valid UTF-8 text (byte 0xFF at "
                                       "character 6); it was not sent\n")


@pytest.mark.parametrize("io_encoding", [None, "utf-8:strict"])
def test_piped_chat_with_bytes_that_are_not_utf8(server, io_encoding):
    """Real stdin bytes (0xFF): whatever the locale's error handler (a strict one raised in
    input()), the line is refused in one line, the next one is answered, and the exit status is 1."""
    import subprocess

    env = cli_env(**({"PYTHONIOENCODING": io_encoding} if io_encoding else {}))
    res = subprocess.run([sys.executable, "-m", "monobatch", "chat", "--server-base", server.base_url, "--api-key",
                          KEY, "--temperature", "0", "-n", "6"], input=b"hello \xff world\nHi!\n",
                         capture_output=True, timeout=120, env=env)
    err = res.stderr.decode()
    assert res.returncode == 1, err
    assert err == ("monobatch chat: error: the message is not valid UTF-8 text (byte 0xFF at character 6); it was "
                   "not sent\n"), err
    assert res.stdout.decode() == server_reply(server, [user("Hi!")], 6) + "\n"


def test_repl_commands(capsys):
    session = ScriptedSession("A1", "A2")
    convo = chat.Conversation([])
    assert chat.repl(session, convo, lines("", "/help", "U1", "/bogus", " /not a command", "/exit", "never read"),
                     stats=False) is False
    assert session.sent == [[user("U1")], [user("U1"), assistant("A1"), user(" /not a command")]]
    err = capsys.readouterr().err
    assert "/regen" in err and "unknown command /bogus" in err
    assert chat.repl(ScriptedSession(), chat.Conversation([]), lines(), stats=False) is True  # EOF
