"""What ``monobatch run`` and ``chat`` share: their flags, the server they talk to, one streamed reply.

Without ``--server-base`` they build the very app ``monobatch serve`` builds (``app_from_args``)
and serve it on a background thread on 127.0.0.1 and a free port (llama-cli's design: the CLI is
an HTTP client of an in-process llama-server); with ``--server-base URL`` they use a running
server and load nothing. Either way they wait for ``/health`` and every reply is a streamed POST
to ``/v1/chat/completions``: the CLI holds no decode logic, so it cannot drift from the server.

Sampling flags become request fields, and only the flags the user set are sent, so the
precedence request > server flag > model config > defaults table is the server's, unchanged.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, TextIO

from monobatch.chat_output import REASONING_FORMATS
from monobatch.cli.args import (add_constraint_args, add_model_args, add_sampling_args, constraint_flag, engine_settings,
                                sampling_flags)
from monobatch.cli.http_client import ChatClient, check_base_url
from monobatch.cli.serve import API_KEY_ENV, api_key_of
from monobatch.errors import InvalidRequestError

#: Seconds to wait for a ``--server-base`` server that is still loading its model.
LOAD_WAIT = 600.0


def add_session_args(p: argparse.ArgumentParser) -> None:
    """The flags of ``run`` and ``chat``: client options, then ``generate``'s model and sampling flags."""
    g = p.add_argument_group("chat")
    g.add_argument("--system", help="a system message before the conversation")
    g.add_argument("--reasoning-format", choices=REASONING_FORMATS,
                   help="separate: a <think> block's text goes to stderr; none: all text is the reply "
                        "(default: the server's, separate)")
    g.add_argument("--stats", action="store_true",
                   help="after each reply, print on stderr: tokens, finish_reason, TTFT (ms) and decode tok/s")
    s = p.add_argument_group("server")
    s.add_argument("--server-base", metavar="URL",
                   help="use a running OpenAI-compatible server (e.g. http://127.0.0.1:8080) instead of loading "
                        "the model in this process; the model and engine flags then do not apply")
    s.add_argument("--api-key", help=f"with --server-base: the server's API key (default: ${API_KEY_ENV} if set)")
    first = len(p._actions)
    add_model_args(p)
    # Flags that configure a model loaded here: refused with --server-base (the server's own apply).
    local = [(a.dest, a.default, "/".join(a.option_strings)) for a in p._actions[first:] if a.dest != "no_progress"]
    add_sampling_args(p, logprobs=False)
    add_constraint_args(p)
    p.set_defaults(local_only_flags=local)


def request_fields(ns: argparse.Namespace) -> dict[str, Any]:
    """The request fields the flags set: sampling flags the user gave (and ``reasoning_format``).

    Raises:
        InvalidRequestError: a bad value, or a flag that is no request field here.
    """
    from monobatch.engine.params import resolve_sampling

    flags = sampling_flags(ns)
    resolve_sampling(None, flags, entry_point="chat")  # bad values fail now, before loading or connecting
    if flags.pop("loop_window", None) is not None and ns.server_base is not None:
        raise InvalidRequestError("--loop-window is a server setting, not a request field: start the server "
                                  "with it", "loop_window")
    if flags.get("max_tokens") == -1:  # llama.cpp's "no limit" (-n -1/-2): the API has no such value
        if ns.server_base is not None:
            raise InvalidRequestError("-n -1 cannot be sent to a remote server (the API has no 'no limit' value); "
                                      "leave -n out to use the server's default", "max_tokens")
        del flags["max_tokens"]  # in process: the field left out (the server here was built from these flags)
    if flags.get("seed") == -1 and ns.server_base is not None:  # llama.cpp's "random": the API has no such
        del flags["seed"]  # value (OpenAI reads -1 as a fixed seed); no seed is random there. In process,
        # -1 is sent: that server reads it as random, as it reads a request without one.
    if ns.server_base is None and "temperature" in flags:
        from monobatch.server.protocol import MAX_TEMPERATURE

        if flags["temperature"] > MAX_TEMPERATURE:  # llama.cpp's knob, over the HTTP API's (OpenAI's) range:
            del flags["temperature"]  # in process it is the server's own default (built from these flags)
    if ns.reasoning_format is not None:
        flags["reasoning_format"] = ns.reasoning_format
    structured = constraint_flag(ns)  # sent as the API's fields: response_format, structured_outputs, grammar
    if structured is not None and structured.kind == "json_schema":
        flags["response_format"] = {"type": "json_schema",
                                    "json_schema": {"name": "cli", "schema": json.loads(structured.value), "strict": True}}
    elif structured is not None and structured.kind == "regex":
        flags["structured_outputs"] = {"regex": structured.value}
    elif structured is not None:
        flags["grammar"] = structured.value
    return flags


def check_flags(ns: argparse.Namespace) -> dict[str, Any]:
    """Refuse bad flags before loading or connecting; returns the request fields.

    Raises:
        MonobatchError: a bad value, a missing model, a flag that does not apply.
    """
    fields = request_fields(ns)
    if ns.server_base is not None:
        check_base_url(ns.server_base, "--server-base")
        given = [flag for dest, default, flag in ns.local_only_flags if getattr(ns, dest) != default]
        if given:
            raise InvalidRequestError(f"{given[0]} does not apply with --server-base (the server's model and "
                                      "settings answer)", "server_base")
        ns.api_key = api_key_of(ns.api_key)
    else:
        from monobatch.loader import resolve_model_path
        from monobatch.tokenizer.chat_template import load_chat_template

        if ns.api_key is not None:
            raise InvalidRequestError("--api-key needs --server-base (the in-process server needs no key)", "api_key")
        engine_settings(ns)
        resolve_model_path(ns.model)
        load_chat_template(ns.chat_template, ns.chat_template_file)
    return fields


@dataclass(slots=True)
class Reply:
    """One assistant reply as it streamed in, with the client-side timings.

    Attributes:
        content / reasoning: the text pieces received (``text`` joins the content).
        finish_reason, usage: from the last chunks (None when the stream was cut short).
        sent / first / end: ``time.perf_counter()`` when the request went out, when its first
            text arrived (the end, for an empty reply) and when the stream ended.
        interrupted: Ctrl-C stopped it.
    """

    content: list[str] = field(default_factory=list)
    reasoning: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    usage: dict[str, Any] | None = None
    sent: float = 0.0
    first: float | None = None
    end: float | None = None
    interrupted: bool = False

    @property
    def text(self) -> str:
        """The reply's content (what goes into the conversation)."""
        return "".join(self.content)

    def stats_line(self) -> str:
        """``[P prompt + N generated tokens, finish_reason=R, TTFT T ms, decode D tok/s]``.

        TTFT is measured here, from sending the request to the first text; decode is the rate
        of the tokens after the first one.
        """
        usage = self.usage or {}
        prompt, generated = usage.get("prompt_tokens"), usage.get("completion_tokens")
        ttft = f"{(self.first - self.sent) * 1000:.0f} ms" if self.first is not None else "-"
        if generated and generated > 1 and self.end is not None and self.first is not None and self.end > self.first:
            decode = f"{(generated - 1) / (self.end - self.first):.1f} tok/s"
        else:
            decode = "- tok/s"
        counts = f"{prompt} prompt + {generated} generated tokens" if usage else "no usage reported"
        return f"[{counts}, finish_reason={self.finish_reason}, TTFT {ttft}, decode {decode}]"


class Session:
    """A connection to the server run/chat talk to.

    Args:
        client: the HTTP client.
        model: the ``model`` field to send (None: the server's default).
        fields: request fields from the flags (:func:`request_fields`).
    """

    def __init__(self, client: ChatClient, model: str | None, fields: dict[str, Any]) -> None:
        self.client, self.model, self.fields = client, model, fields

    def body(self, messages: list[dict[str, str]]) -> dict[str, Any]:
        """The streamed chat request for ``messages``."""
        body: dict[str, Any] = {"messages": messages, **self.fields, "stream": True,
                                "stream_options": {"include_usage": True}}
        if self.model is not None:
            body["model"] = self.model
        return body

    def stream_reply(self, messages: list[dict[str, str]], reply: Reply, out: TextIO | None = None,
                     err: TextIO | None = None) -> Reply:
        """Stream the reply to ``messages`` into ``reply``: content to ``out`` (stdout), reasoning
        to ``err`` (stderr), as it arrives; on a terminal, a newline on ``err`` ends the reasoning
        text when the content starts (both share the screen). Ctrl-C (KeyboardInterrupt) propagates with ``reply``
        holding what came so far; the connection is closed, so the server aborts the request.

        Raises:
            ClientError: the server could not be reached or refused the request.
        """
        out, err = out or sys.stdout, err or sys.stderr
        reply.sent = time.perf_counter()
        with closing(self.client.stream_chat(self.body(messages))) as chunks:
            for chunk in chunks:
                if chunk.usage:
                    reply.usage = chunk.usage
                if chunk.finish_reason:
                    reply.finish_reason = chunk.finish_reason
                if reply.first is None and (chunk.content or chunk.reasoning or chunk.finish_reason):
                    reply.first = time.perf_counter()
                if chunk.reasoning:
                    reply.reasoning.append(chunk.reasoning)
                    err.write(chunk.reasoning)
                    err.flush()
                if chunk.content:
                    if reply.reasoning and not reply.content and not reply.reasoning[-1].endswith("\n") \
                            and err.isatty():
                        err.write("\n")  # the reply starts on its own line, after the reasoning
                        err.flush()
                    reply.content.append(chunk.content)
                    out.write(chunk.content)
                    out.flush()
        reply.end = time.perf_counter()
        return reply


@contextmanager
def open_session(ns: argparse.Namespace, fields: dict[str, Any]) -> Iterator[Session]:
    """Connect to ``--server-base``, or to the in-process server (started here, stopped on exit),
    once ``/health`` answers 200.

    Args:
        ns: flags already checked by :func:`check_flags`.
        fields: the request fields it returned.

    Raises:
        MonobatchError: loading failed, the server is unreachable or refuses the API key.
    """
    remote = ns.server_base is not None
    with _server(ns) as base_url:
        client = ChatClient(base_url, ns.api_key if remote else None, trust_env=remote)
        try:
            client.wait_healthy(LOAD_WAIT, on_wait=lambda: print(
                f"monobatch {ns.command}: the server at {client.base_url} is loading its model...",
                file=sys.stderr, flush=True))
            yield Session(client, client.model_id(), fields)
        finally:
            client.close()


@contextmanager
def _server(ns: argparse.Namespace) -> Iterator[str]:
    """The base URL to talk to: ``--server-base``, or the app ``serve`` builds from the same flags,
    served on a background thread of this process on 127.0.0.1 and a free port."""
    if ns.server_base is not None:
        yield ns.server_base
        return
    from monobatch.server.runner import ServerThread, app_from_args

    local = argparse.Namespace(**{**vars(ns), "api_key": None})  # loopback, our own process: no key
    server = ServerThread(app_from_args(local)).start()
    try:
        server.wait_ready()  # loads the model (a progress bar on a terminal); raises what loading raised
        # where the bar was, on a terminal or with --stats (`make run`): what was loaded (weights, KV)
        if (sys.stderr.isatty() or getattr(ns, "stats", False)) and not ns.no_progress:
            print(f"monobatch {ns.command}: {server.state.scheduler.engine.describe()}", file=sys.stderr, flush=True)
        yield server.base_url
    finally:
        server.stop()

