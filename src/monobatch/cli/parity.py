"""`monobatch parity`: one prompt and sampling config through every door — the engine directly
(the reference), `run` (the chat CLI over HTTP), the server at B=1 with dense and with paged KV,
a prefix-cache hit, and the request inside a batch of 8 others — compared token id by token id.

Prints, per config (greedy; seeded with penalties and DRY; json: greedy under a JSON schema with a
nested object, an enum and an array) and door: identical, or the first divergent token, both ids
and the draw margin there (greedy: the top-2 logit gap; seeded: the gap between the draw's two
best noise-perturbed scores); each door's paged-attention calls, prefix-cache adoption and
prefill chunks. Under --deterministic every door must be identical.

Exit codes: 0 done; 1 with --expect-identical: a door diverged or a check failed; 2 an error
(a bad flag, a model that cannot load, a door that failed to run).

Examples:
  monobatch parity -t 1
  monobatch parity --deterministic --expect-identical --json report.json
  monobatch parity --configs greedy -n 64 -p "Why is the sky blue?" --device cuda
"""

from __future__ import annotations

import argparse
import sys
import traceback

from monobatch.cli.args import add_model_args, check_writable, engine_settings
from monobatch.errors import InvalidRequestError, MonobatchError, require_utf8

#: Config names (kept here too so building the parser imports nothing heavy).
CONFIG_NAMES = ("greedy", "seeded", "json")


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``monobatch parity`` and its flags."""
    p = sub.add_parser("parity", help="check that every door gives the same tokens (the one-engine invariants)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("parity")
    g.add_argument("-p", "--prompt", help="the user message every door sends (chat template applied; default: a "
                                          "question of ~30 tokens, ~60 with the template)")
    g.add_argument("-n", "--max-tokens", type=int, default=32,
                   help="tokens each door generates, EOS ignored (default 32)")
    g.add_argument("--configs", default=",".join(CONFIG_NAMES),
                   help=f"sampling configs, comma-separated: {', '.join(CONFIG_NAMES)} (default: all three)")
    g.add_argument("--batch-prefill-chunk", type=int, default=16,
                   help="prefill chunk of the batch door's server, tokens (default 16: the prompt is computed in "
                        "several chunks beside the other requests; 0 = --prefill-chunk)")
    g.add_argument("--expect-identical", action="store_true",
                   help="exit 1 when a door diverges or a check fails (2 stays for errors)")
    g.add_argument("--json", metavar="FILE",
                   help="also write the report as JSON to FILE (- = stdout, instead of the text)")
    add_model_args(p)
    p.set_defaults(func=run)


def _configs(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in CONFIG_NAMES]
    if not names or bad:
        raise InvalidRequestError(f"--configs: expected a comma-separated list of {', '.join(CONFIG_NAMES)}, "
                                  f"got {text!r}", "configs")
    return names


def check_flags(ns: argparse.Namespace) -> tuple[str, ...]:
    """Refuse bad flags before loading anything; returns the config names.

    Raises:
        MonobatchError: a bad value, a missing model or chat template file.
    """
    configs = _configs(ns.configs)
    if ns.max_tokens < 1:
        raise InvalidRequestError(f"-n/--max-tokens must be >= 1, got {ns.max_tokens}", "max_tokens")
    if ns.batch_prefill_chunk < 0:
        raise InvalidRequestError(f"--batch-prefill-chunk must be >= 0, got {ns.batch_prefill_chunk}",
                                  "batch_prefill_chunk")
    if ns.prompt is not None and not ns.prompt.strip():
        raise InvalidRequestError("--prompt is empty", "prompt")
    if ns.prompt is not None:
        require_utf8(ns.prompt, "prompt", escaped_bytes=True)  # the prompt's own message, as generate's and run's
    engine_settings(ns)
    from monobatch.loader import resolve_model_path  # torch: only once the plain values are good (seconds)
    from monobatch.tokenizer.chat_template import load_chat_template

    resolve_model_path(ns.model)
    load_chat_template(ns.chat_template, ns.chat_template_file)
    return configs


def run(ns: argparse.Namespace) -> int:
    """Load once, run every door, print the report; returns the exit code (0, 1 or 2)."""
    try:
        return _run(ns)
    except MonobatchError as exc:  # 2, not main's 1: exit 1 means "a door diverged"
        print(f"monobatch parity: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    except (KeyboardInterrupt, BrokenPipeError):
        raise
    except Exception:  # noqa: BLE001 - a bug: the traceback, and the error exit code
        traceback.print_exc()
        return 2


def _run(ns: argparse.Namespace) -> int:
    configs = check_flags(ns)
    if ns.json not in (None, "-"):
        check_writable(ns.json, "--json")  # before minutes of doors, not after
    import torch

    from monobatch.engine.engine import EngineConfig
    from monobatch.loader import load_model
    from monobatch.parity import DEFAULT_PROMPT, run_parity, write_json
    from monobatch.tokenizer.chat_template import load_chat_template

    if ns.threads > 0:
        torch.set_num_threads(ns.threads)
    base = EngineConfig(**engine_settings(ns))
    template = load_chat_template(ns.chat_template, ns.chat_template_file)
    loaded = load_model(ns.model, ns.device, ns.dtype, chat_template=template, progress=not ns.no_progress,
                        weights=ns.weights)
    tty = sys.stderr.isatty()
    report = run_parity(loaded, base, prompt=ns.prompt or DEFAULT_PROMPT, configs=configs,
                        max_tokens=ns.max_tokens, batch_prefill_chunk=ns.batch_prefill_chunk,
                        progress=(lambda line: print(f"monobatch parity: {line}...", file=sys.stderr, flush=True))
                        if tty else None)
    if ns.json != "-":
        print(report.text(), flush=True)
    if ns.json is not None:
        try:
            write_json(report, ns.json)
        except OSError as e:
            raise InvalidRequestError(f"--json {ns.json}: cannot write the report: {e.strerror or e}", "json") from e
    return report.exit_code(ns.expect_identical)
