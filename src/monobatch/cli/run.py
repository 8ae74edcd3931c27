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

from monobatch.cli.args import opening_messages, read_prompt
from monobatch.cli.session import Reply, add_session_args, check_flags, open_session
from monobatch.errors import InvalidRequestError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``monobatch run`` and its flags."""
    p = sub.add_parser("run", help="one chat turn with the model, the reply streamed to stdout",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", nargs="?", help="the user message (default: -p, or read stdin)")
    p.add_argument("-p", "--prompt", dest="prompt_flag", metavar="PROMPT", help="the user message (as generate's -p)")
    add_session_args(p)
    p.set_defaults(func=run)


def user_message(ns: argparse.Namespace) -> str:
    """The positional prompt, ``-p`` or stdin (see :func:`monobatch.cli.args.read_prompt`).

    Raises:
        InvalidRequestError: no prompt, both forms given, an empty or non-UTF-8 prompt.
    """
    text = read_prompt(ns.prompt, ns.prompt_flag, 'pass it as an argument (monobatch run "...") or pipe it on stdin')
    if not text.strip():
        raise InvalidRequestError("the prompt is empty", "prompt")
    return text


def run(ns: argparse.Namespace) -> int:
    """Ask once, stream the reply; returns the exit code."""
    prompt = user_message(ns)
    fields = check_flags(ns)
    with open_session(ns, fields) as session:
        reply = session.stream_reply(opening_messages(ns) + [{"role": "user", "content": prompt}], Reply())
        sys.stdout.write("\n")
        sys.stdout.flush()
        if ns.stats:
            print(reply.stats_line(), file=sys.stderr, flush=True)
    return 0
