'''`monobatch chat`: a multi-turn chat REPL, each reply streamed as it is generated.

The same HTTP client as `monobatch run` (the server in this process, or --server-base URL): the
whole conversation is sent with every turn. Commands:

  /help    list the commands          /clear   forget the conversation (--system stays)
  /regen   a new reply to the last message           /exit    quit (Ctrl-D too)

Multi-line input: end a line with \\ to continue it on the next, or put the message between lines
that start and end with """. A line starting with / is a command (start it with a space to send
it as text). Ctrl-C stops the reply being streamed (the server aborts it; what was shown stays in
the conversation) and keeps the session; at the prompt it discards the line. Line editing and
history (readline) when stdin is a terminal. Replies go to stdout; everything else to stderr.
'''

from __future__ import annotations

import argparse
import importlib
import io
import sys
from typing import Callable

from monobatch.cli.http_client import ClientError
from monobatch.cli.args import opening_messages
from monobatch.cli.session import Reply, Session, add_session_args, check_flags, open_session
from monobatch.errors import InvalidRequestError, require_utf8

PROMPT = "> "
CONTINUATION = "... "
BLOCK = '"""'
COMMANDS = {
    "/help": "list the commands",
    "/clear": "forget the conversation (the --system message stays)",
    "/regen": "discard the last reply and generate a new one",
    "/exit": "quit (Ctrl-D too)",
}
HELP = "\n".join([*(f"  {name:<7} {what}" for name, what in COMMANDS.items()),
                  "  multi-line: end a line with \\ to continue it, or write the message between \"\"\" lines",
                  "  Ctrl-C stops a reply (what was shown stays in the conversation); at the prompt it drops "
                  "the line"])


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``monobatch chat`` and its flags."""
    p = sub.add_parser("chat", help="interactive multi-turn chat with the model (a REPL)", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_session_args(p)
    p.set_defaults(func=run)


class Conversation:
    """The messages sent with every turn: the opening (system) messages, then user/assistant turns.

    Args:
        opening: messages that ``/clear`` keeps (the ``--system`` message).

    Attributes:
        failures: how many turns the server refused or failed (a piped chat then exits 1).
    """

    def __init__(self, opening: list[dict[str, str]]) -> None:
        self.opening = opening
        self.turns: list[dict[str, str]] = []
        self.failures = 0

    def messages(self) -> list[dict[str, str]]:
        """What the next request sends."""
        return self.opening + self.turns

    def clear(self) -> None:
        """Forget every turn."""
        self.turns = []

    def add(self, role: str, content: str) -> None:
        """Append a message."""
        self.turns.append({"role": role, "content": content})

    def pop(self, role: str) -> str | None:
        """Remove and return the last message's content if it has ``role``, else None."""
        if self.turns and self.turns[-1]["role"] == role:
            return self.turns.pop()["content"]
        return None


class UnfinishedMessage(EOFError):
    """The input ended inside a multi-line message (an open triple-quote block, or a last line
    ending in a backslash): the partial message is not sent."""


def read_message(read_line: Callable[[str], str]) -> str:
    """One message from the user, over several lines when asked.

    A line ending with a backslash continues on the next (the backslash becomes a newline); a
    first line starting with triple quotes opens a block that ends at a line ending with them.

    Args:
        read_line: ``input``-like: takes a prompt, returns a line without its newline, raises
            EOFError at the end of input.

    Raises:
        EOFError: the input ended before a message began.
        UnfinishedMessage: the input ended inside a message (an EOFError too).
    """
    first = read_line(PROMPT)

    def more() -> str:
        try:
            return read_line(CONTINUATION)
        except EOFError:
            raise UnfinishedMessage from None

    if first.lstrip().startswith(BLOCK):
        rest = first.lstrip()[len(BLOCK):]
        if rest.rstrip().endswith(BLOCK):  # """all on one line"""
            return rest.rstrip()[:-len(BLOCK)]
        lines = [rest] if rest.strip() else []
        while True:
            line = more()
            if line.rstrip().endswith(BLOCK):
                tail = line.rstrip()[:-len(BLOCK)]
                return "\n".join(lines + ([tail] if tail.strip() else []))
            lines.append(line)
    lines, line = [], first
    while line.endswith("\\"):
        lines.append(line[:-1])
        line = more()
    return "\n".join(lines + [line])


def answer(session: Session, conversation: Conversation, stats: bool) -> Reply | None:
    """Stream the reply to the conversation so far; returns it, or None when the server refused.

    Ctrl-C stops the stream (closing the connection aborts the request on the server) and the
    reply keeps what had arrived.
    """
    reply = Reply()
    try:
        session.stream_reply(conversation.messages(), reply)
    except KeyboardInterrupt:
        reply.interrupted = True
    except ClientError as exc:
        conversation.failures += 1
        if reply.content:
            sys.stdout.write("\n")
        hint = " (/clear starts a new conversation)" if exc.code == "context_length_exceeded" else ""
        print(f"monobatch chat: error: {exc}{hint}", file=sys.stderr, flush=True)
        return None
    sys.stdout.write("\n")
    sys.stdout.flush()
    if reply.interrupted:
        print("[interrupted]", file=sys.stderr, flush=True)
    elif stats:
        print(reply.stats_line(), file=sys.stderr, flush=True)
    return reply


def _kept(reply: Reply | None) -> str | None:
    """The text a reply leaves in the conversation: None when the server refused it or Ctrl-C
    stopped it before any text (the turn is then undone)."""
    if reply is None or (reply.interrupted and not reply.text):
        return None
    return reply.text


def ask(session: Session, conversation: Conversation, text: str, stats: bool) -> None:
    """One turn: the user's message, then the reply."""
    conversation.add("user", text)
    kept = _kept(answer(session, conversation, stats))
    if kept is None:
        conversation.pop("user")
    else:
        conversation.add("assistant", kept)


def regenerate(session: Session, conversation: Conversation, stats: bool) -> None:
    """``/regen``: replace the last reply with a new one (the old one comes back if that fails)."""
    old = conversation.pop("assistant")
    if old is None:
        print("monobatch chat: nothing to regenerate yet", file=sys.stderr, flush=True)
        return
    kept = _kept(answer(session, conversation, stats))
    conversation.add("assistant", old if kept is None else kept)


def command(session: Session, conversation: Conversation, line: str, stats: bool) -> bool:
    """Run a ``/command``; returns False when the session should end."""
    name = line.split()[0]
    if name == "/exit":
        return False
    if name == "/help":
        print(HELP, file=sys.stderr, flush=True)
    elif name == "/clear":
        conversation.clear()
        print("(conversation cleared)", file=sys.stderr, flush=True)
    elif name == "/regen":
        regenerate(session, conversation, stats)
    else:
        print(f"monobatch chat: unknown command {name}; /help lists them (start a line with a space to send it "
              "as text)", file=sys.stderr, flush=True)
    return True


def repl(session: Session, conversation: Conversation, read_line: Callable[[str], str], stats: bool) -> bool:
    """Read messages and commands until /exit (returns False) or the end of input (True)."""
    while True:
        try:
            text = read_message(read_line)
        except KeyboardInterrupt:  # Ctrl-C at the prompt: drop the line, ask again
            print(file=sys.stderr, flush=True)
            continue
        except UnfinishedMessage:  # not sent: a piped chat exits 1, as for a failed turn
            print("monobatch chat: error: the input ended inside a message; it was not sent", file=sys.stderr, flush=True)
            conversation.failures += 1
            return True
        except EOFError:
            return True
        if not text.strip():
            continue
        try:
            require_utf8(text, "prompt", "the message", escaped_bytes=True)
        except InvalidRequestError as exc:  # refused as run refuses such a prompt: not sent, the turn failed
            print(f"monobatch chat: error: {exc}; it was not sent", file=sys.stderr, flush=True)
            conversation.failures += 1
            continue
        if text.startswith("/") and "\n" not in text:
            if not command(session, conversation, text.strip(), stats):
                return False
            continue
        ask(session, conversation, text, stats)


def _prompted_input(prompt: str) -> str:
    """``input`` with its prompt on stderr when stdout is redirected (stdout holds replies only)."""
    if sys.stdout.isatty():
        return input(prompt)
    sys.stderr.write(prompt)
    sys.stderr.flush()
    return input()


def run(ns: argparse.Namespace) -> int:
    """Chat until /exit or EOF; returns the exit code."""
    fields = check_flags(ns)
    interactive = sys.stdin is not None and sys.stdin.isatty()
    if isinstance(sys.stdin, io.TextIOWrapper):  # bytes that are not UTF-8 reach repl() as lone surrogates,
        sys.stdin.reconfigure(errors="surrogateescape")  # whatever the locale (a strict one would raise in input())
    if interactive:
        importlib.import_module("readline")  # line editing and history for input()
    with open_session(ns, fields) as session:
        if interactive:
            where = session.client.base_url if ns.server_base is not None else "in this process"
            print(f"monobatch chat: {session.model or 'the server model'} ({where}). /help lists the commands; "
                  "Ctrl-C stops a reply; /exit or Ctrl-D quits.", file=sys.stderr, flush=True)
        read_line = _prompted_input if interactive else (lambda prompt: input())  # no prompts when piped
        conversation = Conversation(opening_messages(ns))
        if repl(session, conversation, read_line, ns.stats) and interactive:
            print(file=sys.stderr)  # Ctrl-D left the cursor after the prompt
    # Piped (a script): a refused or failed turn makes the exit status 1, as with run. At a
    # terminal the user saw each error and the session went on.
    return 1 if conversation.failures and not interactive else 0
