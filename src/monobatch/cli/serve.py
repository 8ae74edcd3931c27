"""`monobatch serve`: the OpenAI-compatible HTTP server (vLLM's and llama-server's role).

Listens at once (GET /health answers 503 while the model loads, then 200) and serves
/v1/completions, /v1/chat/completions, /v1/models, /tokenize, /detokenize and /metrics.
Sampling flags set server-wide defaults, below each request's own fields.
SIGINT/SIGTERM: in-flight requests get --shutdown-timeout seconds, then are aborted.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from monobatch import defaults
from monobatch.chat_output import REASONING_FORMATS
from monobatch.cli.args import add_model_args, add_sampling_args, engine_settings, names_a_model, sampling_flags
from monobatch.errors import InvalidRequestError, ModelNotFoundError, MonobatchError, require_api_key

#: Environment variable read when --api-key is not given (keeps the key out of `ps`).
API_KEY_ENV = "MONOBATCH_API_KEY"
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")


def api_key_of(flag: str | None) -> str | None:
    """The API key of ``serve`` and of the clients (``run``/``chat --server-base``, ``bench-serve``):
    ``--api-key``, else ``$MONOBATCH_API_KEY`` (unset or empty: no key), checked by
    :func:`monobatch.errors.require_api_key` naming where it came from.

    Raises:
        InvalidRequestError: a key no ``Authorization`` header can carry.
    """
    if flag is not None:
        require_api_key(flag, "--api-key")
        return flag
    key = os.environ.get(API_KEY_ENV) or None
    require_api_key(key, f"${API_KEY_ENV}")
    return key


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``monobatch serve`` and its flags."""

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server on the engine", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_tag", nargs="?", metavar="MODEL",
                   help="the model, as in vLLM's `vllm serve MODEL` (the same as -m/--model)")
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0 = all)")
    s.add_argument("--port", type=int, default=8080, help="port (default 8080; 0 = a free port, printed at start)")
    s.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="names the API answers to in `model` (default: the model file's name)")
    s.add_argument("--api-key", help=f"require `Authorization: Bearer KEY` on /v1/*, /tokenize, /detokenize and "
                                     f"the API docs (/docs, /openapi.json) (default: ${API_KEY_ENV} if set; "
                                     f"/health and /metrics stay open)")
    s.add_argument("--allowed-origins", nargs="+", metavar="ORIGIN",
                   help="browser origins allowed to call the API through CORS, e.g. http://localhost:3000 "
                        "(* = any; default: none, no CORS headers)")
    s.add_argument("--max-model-len", type=int, help="context length in tokens (vLLM's name for -c/--ctx-size)")
    s.add_argument("--max-queue", type=int,
                   help="sequences that may wait beyond --max-num-seqs; more get HTTP 429 (default: no limit)")
    s.add_argument("--reasoning-format", choices=REASONING_FORMATS, default="separate",
                   help="separate: <think> text goes to reasoning_content; none: all text is content "
                        "(default separate)")
    s.add_argument("--log-level", choices=LOG_LEVELS, default="info", help="log level (default info)")
    s.add_argument("--shutdown-timeout", type=float, default=defaults.SERVER_SHUTDOWN_TIMEOUT,
                   help=f"seconds in-flight requests get to finish on SIGINT/SIGTERM (default {defaults.SERVER_SHUTDOWN_TIMEOUT:g})")
    add_model_args(p)
    add_sampling_args(p, logprobs=False)  # logprobs is each request's output option, not a default
    p.set_defaults(func=run)


def check_flags(ns: argparse.Namespace) -> None:
    """Refuse bad flags before binding a port or loading anything.

    Raises:
        MonobatchError: a bad value, a missing model, a bad chat template.
    """
    from monobatch.engine.params import resolve_sampling
    from monobatch.tokenizer.chat_template import load_chat_template

    if ns.model_tag is not None:
        if ns.model is not None and ns.model != ns.model_tag:
            raise InvalidRequestError(f"give the model once: {ns.model_tag!r} or -m {ns.model!r}, not both", "model")
        ns.model = ns.model_tag
    if ns.max_model_len is not None:
        if ns.ctx_size and ns.ctx_size != ns.max_model_len:
            raise InvalidRequestError("give --max-model-len or -c/--ctx-size, not both", "max_model_len")
        if ns.max_model_len < 0:
            raise InvalidRequestError(f"--max-model-len must be >= 0, got {ns.max_model_len}", "max_model_len")
        ns.ctx_size = ns.max_model_len
    if not 0 <= ns.port <= 65535:
        raise InvalidRequestError(f"--port must be in 0..65535, got {ns.port}", "port")
    if ns.shutdown_timeout < 0:
        raise InvalidRequestError("--shutdown-timeout must be >= 0", "shutdown_timeout")
    ns.api_key = api_key_of(ns.api_key)
    engine_settings(ns)
    from monobatch.loader import resolve_model_path  # these import torch (seconds): after the plain checks
    from monobatch.loader.named import NAMED_MODELS
    names = ns.served_model_name or []
    last = names[-1] if names else None
    if ns.model is None and last and (names_a_model(last) or last in NAMED_MODELS or (
            len(names) > 1 and last.lower().endswith(".gguf"))):
        # --served-model-name takes every word after it: `serve --served-model-name foo MODEL` would
        # serve the bundled model under the model's path or name
        raise InvalidRequestError(f"--served-model-name took {last!r} as a name and no model was given: put the "
                                  f"model first (serve MODEL --served-model-name ...) or give it with -m",
                                  "served_model_name")
    from monobatch.server.runner import settings_from_args

    settings_from_args(ns)
    resolve_sampling(None, sampling_flags(ns), entry_point="chat")
    path = resolve_model_path(ns.model)
    if path.is_file():  # a file that is no GGUF: one line now, not after the server started listening
        from monobatch.loader.gguf_file import check_magic
        try:
            check_magic(path)
        except OSError as e:
            raise ModelNotFoundError(f"{path}: cannot read the model file ({e.strerror or e})") from e
    load_chat_template(ns.chat_template, ns.chat_template_file)


def run(ns: argparse.Namespace) -> int:
    """Serve until interrupted; returns the exit code."""
    check_flags(ns)
    from monobatch.server.runner import app_from_args, bind, serve_foreground, url_of

    logging.basicConfig(level=ns.log_level.upper(), format="%(levelname)s:     %(name)s: %(message)s")
    app = app_from_args(ns)
    sock = bind(ns.host, ns.port)
    print(f"monobatch serve: listening on {url_of(sock)} (loading the model; GET /health answers 200 when ready)",
          file=sys.stderr, flush=True)
    state = serve_foreground(app, sock, ns.log_level, ns.shutdown_timeout)
    error = state.load_error
    if error is not None:
        raise error if isinstance(error, MonobatchError) else MonobatchError(f"loading the model failed: {error}")
    return 0
