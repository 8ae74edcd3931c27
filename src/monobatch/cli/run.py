"""`monobatch run`: one chat turn, the reply streamed to stdout (llama-cli's single-shot use).

An HTTP client of the server: without --server-base it starts the app `monobatch serve` builds
in this process (127.0.0.1, a free port), waits for /health and posts the prompt as one user
message to /v1/chat/completions over SSE; with --server-base URL it uses that server and loads no
model. stdout gets the reply only; the loading bar (on a terminal), a <think> block's text,
--stats and errors go to stderr.
"""

from __future__ import annotations

import argparse
import sys

from monobatch.cli.session import Reply, add_session_args, check_flags, open_session, opening_messages
from monobatch.errors import InvalidRequestError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``monobatch run`` and its flags."""
    p = sub.add_parser("run", help="one chat turn with the model, the reply streamed to stdout",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", nargs="?", help="the user message (default: -p, or read stdin)")
    p.add_argument("-p", "--prompt", dest="prompt_flag", metavar="PROMPT", help="the user message (as generate's -p)")
    add_session_args(p)
    p.set_defaults(func=run)


def read_prompt(ns: argparse.Namespace) -> str:
    """The positional prompt, ``-p`` or stdin (one trailing newline dropped, as generate does).

    Raises:
        InvalidRequestError: no prompt, both forms given, an empty or non-UTF-8 prompt.
    """
    if ns.prompt is not None and ns.prompt_flag is not None:
        raise InvalidRequestError("give the prompt once: as an argument or with -p, not both", "prompt")
    text = ns.prompt if ns.prompt is not None else ns.prompt_flag
    if text is None:
        if sys.stdin is None or sys.stdin.isatty():
            raise InvalidRequestError('no prompt: pass it as an argument (monobatch run "...") or pipe it on stdin',
                                      "prompt")
        text = sys.stdin.buffer.read().decode("utf-8", errors="surrogateescape")
        text = text.removesuffix("\n").removesuffix("\r")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequestError("the prompt is not valid UTF-8 text", "prompt") from None
    if not text.strip():
        raise InvalidRequestError("the prompt is empty", "prompt")
    return text


def run(ns: argparse.Namespace) -> int:
    """Ask once, stream the reply; returns the exit code."""
    prompt = read_prompt(ns)
    fields = check_flags(ns)
    with open_session(ns, fields) as session:
        reply = session.stream_reply(opening_messages(ns) + [{"role": "user", "content": prompt}], Reply())
        sys.stdout.write("\n")
        sys.stdout.flush()
        if ns.stats:
            print(reply.stats_line(), file=sys.stderr, flush=True)
    return 0
