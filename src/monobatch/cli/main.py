"""The `monobatch` command: one parser, one subcommand module per command.

Errors a user can cause are :class:`monobatch.errors.MonobatchError`: printed as one line on
stderr, exit code 1 (argparse's flag errors: one line, exit code 2). No tracebacks.
"""

from __future__ import annotations

import argparse
import difflib
import sys

from monobatch import __version__
from monobatch.cli.args import PROMPT_DESTS, OneLineParser
from monobatch.env import SettingError, warn_unknown_names
from monobatch.errors import MonobatchError


def build_parser() -> OneLineParser:
    """The ``monobatch`` parser with one subcommand per command module."""
    from monobatch.cli import bench, bench_serve, chat, generate, parity, run, serve

    parser = OneLineParser(prog="monobatch", description="One batch-native LLM inference engine.")
    parser.add_argument("--version", action="version", version=f"monobatch {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=OneLineParser)
    generate.add_parser(sub)
    bench.add_parser(sub)
    bench_serve.add_parser(sub)
    serve.add_parser(sub)
    run.add_parser(sub)
    chat.add_parser(sub)
    parity.add_parser(sub)
    return parser


#: Field names whose CLI flag is not ``--`` + the name with dashes.
_FLAG_NAMES = {"dry_sequence_breakers": "--dry-sequence-breaker", "max_tokens": "-n/--max-tokens",
               # run/chat send their constraint flags as request fields (the server names those)
               "grammar": "--grammar-file", "response_format.json_schema.schema": "--json-schema",
               "response_format": "--json-schema", "structured_outputs.regex": "--regex"}


def as_flag(error: MonobatchError, argv: list[str]) -> str:
    """The message with a leading ``field:`` renamed to the CLI flag that set it (``top_p:`` ->
    ``--top-p:``), only when that flag is on the command line (a model default keeps its name)."""
    message, param = str(error), getattr(error, "param", None)
    if not param or not message.startswith(f"{param}:"):
        return message
    flag = _FLAG_NAMES.get(param, f"--{param.replace('_', '-')}")
    if not any(arg.split("=", 1)[0] in flag.split("/") for arg in argv):
        return message
    return flag + message[len(param):]


def _did_you_mean(parser: argparse.ArgumentParser, command: str | None, extras: list[str],
                  argv: list[str]) -> tuple[list[str], str]:
    """What to name as unrecognized, and a hint: ``"; did you mean --max-tokens?"`` for the first
    unknown flag close to one of the command's (difflib's ratio, at least 0.8: a letter missing or
    swapped); else, for a flag other commands have, ``"; --logprobs is a flag of monobatch
    generate"`` (every such command named) — and where that flag takes a value, the flag and the value as typed (argparse read
    the value as this command's argument, so the word after it looked extra: ``run --logprobs 3
    hi`` names ``--logprobs 3``, not ``--logprobs hi``); else, where only words are extra to a
    command that takes a prompt, a hint that it takes one (``run smollm2 "Why ..."``: a model given
    first, as vLLM and Ollama take it), or to ``chat``, that it takes none (``run`` does); else
    ``extras`` and ``""``."""
    subs = next((a.choices for a in parser._actions if isinstance(a, argparse._SubParsersAction)), {})
    sub = subs.get(command) if command else None
    known = list((sub or parser)._option_string_actions)
    flags = [arg.split("=", 1)[0] for arg in extras if arg.startswith("--")]
    for flag in flags:
        close = difflib.get_close_matches(flag, known, n=1, cutoff=0.8)
        if close:
            return extras, f"; did you mean {close[0]}?"
    for flag in flags:
        owners = [name for name, p in subs.items() if name != command and flag in p._option_string_actions]
        if owners:
            names = " and ".join([", ".join(owners[:-1]), owners[-1]] if len(owners) > 1 else owners)
            hint = f"; {flag} is a flag of monobatch {names}"
            takes = subs[owners[0]]._option_string_actions[flag].nargs != 0
            at = argv.index(flag) + 1 if flag in argv else len(argv)
            if takes and at < len(argv) and not _is_flag(argv[at]):
                others = [e for e in extras if _is_flag(e) and e.split("=", 1)[0] != flag]
                return [flag, argv[at], *others], hint  # (the other unknown flags still named)
            return extras, hint
    takes_prompt = sub is not None and any(not a.option_strings and a.dest in PROMPT_DESTS for a in sub._actions)
    if takes_prompt and not any(_is_flag(e) for e in extras):  # words after the prompt: a model given first
        return extras, f"; monobatch {command} takes one prompt (quote it) and a model with -m MODEL"
    if command == "chat" and not any(_is_flag(e) for e in extras):  # `chat hi` or `chat MODEL` (Ollama's habit)
        return extras, ("; monobatch chat takes no prompt argument (type at its prompt, or pipe lines in) and a "
                        "model with -m MODEL; for one prompt: monobatch run \"...\"")
    return extras, ""


def _is_flag(word: str) -> bool:
    """Whether a command-line word is a flag (``-x``, ``--name``), not a value such as ``-1``."""
    if not word.startswith("-"):
        return False
    try:
        float(word)
    except ValueError:
        return True
    return False


def main(argv: list[str] | None = None) -> int:
    """Entry point of the console script and ``python -m monobatch``; returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    warn_unknown_names()  # a misspelt MONOBATCH_* variable, said before anything else (the command may fail for it)
    try:
        parser = build_parser()
        ns, extras = parser.parse_known_args(argv)
    except KeyboardInterrupt:  # Ctrl-C while the commands' modules import
        print("\nmonobatch: interrupted", file=sys.stderr)
        return 130
    if extras:  # argparse would name only `monobatch`; name the command the flag was given to
        prog = f"monobatch {ns.command}" if getattr(ns, "command", None) else "monobatch"
        shown, hint = _did_you_mean(parser, getattr(ns, "command", None), extras, argv)
        print(f"{prog}: error: unrecognized arguments: {' '.join(shown)}{hint} (see --help)", file=sys.stderr)
        return 2
    if not getattr(ns, "func", None):
        parser.print_help(sys.stderr)
        return 2
    try:
        return ns.func(ns)
    except MonobatchError as e:
        print(f"monobatch {ns.command}: error: {as_flag(e, argv)}", file=sys.stderr)
        return 1
    except SettingError as e:  # a malformed kernel knob, read when the engine's modules import
        print(f"monobatch {ns.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"\nmonobatch {ns.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
