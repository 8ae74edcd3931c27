"""`monobatch` as a user runs it: subprocesses, exit codes, one-line errors, no tracebacks."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def monobatch(*args: str, stdin: str | None = None, timeout: int = 180) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, "-m", "monobatch", *args], input=stdin, capture_output=True,
                          text=True, timeout=timeout, env=env)


def assert_one_line_error(res: subprocess.CompletedProcess, *needles: str) -> None:
    assert res.returncode != 0
    assert "Traceback" not in res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


@pytest.mark.parametrize("args,needle", [
    (["-n", "-3"], "max-tokens"),
    (["--top-p", "2"], "--top-p"),
    (["--temperature", "-1"], "--temperature"),
    (["--top-k", "-5"], "--top-k"),
    (["--system", "be brief"], "--system needs --chat"),
    (["--chat-template", "{{ messages }}"], "--chat-template needs --chat"),
    (["--chat-template-file", "t.jinja"], "--chat-template-file needs --chat"),
    (["--seed", "-7"], "or -1 for a random seed"),
    (["-c", "-1"], "ctx-size"),
    (["-t", "0"], "threads"),
    (["--prefill-chunk", "0"], "prefill-chunk"),
    (["--logit-bias", "abc"], "ID=BIAS"),
    (["--dtype", "float8"], "dtype"),
    (["--device", "tpu"], "device"),
    (["--frobnicate"], "unrecognized"),
    (["--logit-bias", "999999=1"], "vocabulary"),
])
def test_out_of_range_values(args, needle):
    res = monobatch("generate", "-p", "hi", "--no-progress", *args)
    assert_one_line_error(res, needle)


@pytest.mark.parametrize("command", ["run", "generate", "parity", "chat", "serve", "bench", "bench-serve"])
def test_unknown_flag_names_the_command(command):
    """argparse alone would say `monobatch: error: unrecognized arguments` (the command lost).
    `hi` is the prompt of run and generate and the model of serve (vLLM's `serve MODEL`); the
    other commands take no positional argument."""
    res = monobatch(command, "--bogus", "hi", timeout=60)
    leftovers = "--bogus" if command in ("run", "generate", "serve") else "--bogus hi"
    assert res.returncode == 2, res
    assert res.stderr == f"monobatch {command}: error: unrecognized arguments: {leftovers} (see --help)\n", res.stderr
    assert res.stdout == ""


@pytest.mark.parametrize("command,args,flag", [
    ("generate", ["--max-tok", "3", "-p", "hi"], "--max-tok"),  # once --max-tokens, silently
    ("generate", ["--tempera=0.5", "-p", "hi"], "--tempera=0.5"),
    ("serve", ["--ho", "0.0.0.0"], "--ho"),
    ("run", ["--server", "http://127.0.0.1:9", "hi"], "--server"),  # once --server-base
    ("bench", ["--num-p", "2"], "--num-p"),
])
def test_an_abbreviated_flag_is_an_unknown_flag(command, args, flag):
    """Flags are taken only as written (argparse's prefix matching off, allow_abbrev=False): an
    abbreviation is one line and exit 2, never a longer flag it happens to start (llama.cpp's and
    vLLM's users type whole flags); llama.cpp's own short names (--temp) are flags of their own."""
    res = monobatch(command, *args, timeout=60)
    assert res.returncode == 2, res
    assert res.stderr.startswith(f"monobatch {command}: error: unrecognized arguments: {flag}"), res.stderr
    assert len(res.stderr.splitlines()) == 1 and res.stdout == "", res.stderr


@pytest.mark.parametrize("command,args,hint", [
    ("generate", ["--max-token", "3", "-p", "hi"], "; did you mean --max-tokens?"),
    ("serve", ["--prot", "8080"], "; did you mean --port?"),
    ("bench", ["--frobnicate"], ""),
    ("run", ["--logprobs"], "; --logprobs is a flag of monobatch generate"),  # another command's flag
    # its value was read as run's prompt and the prompt looked extra: the flag and its value are named
    ("run", ["--logprobs", "3", "hi"], "; --logprobs is a flag of monobatch generate"),
    # a flag of several other commands: every one named
    ("generate", ["--api-key", "x", "-p", "hi"], "; --api-key is a flag of monobatch bench-serve, serve, run and chat"),
])
def test_a_mistyped_flag_gets_a_suggestion(command, args, hint):
    """An unknown flag a letter away from one of the command's is refused with that flag named
    (difflib's closest, ratio >= 0.8), still one line and exit 2; a flag near none gets no hint."""
    res = monobatch(command, *args, timeout=60)
    assert res.returncode == 2, res
    named = " ".join(args[:2]) if args[:2] in (["--logprobs", "3"], ["--api-key", "x"]) else args[0]
    assert res.stderr.endswith(f"{named}{hint} (see --help)\n"), res.stderr
    assert len(res.stderr.splitlines()) == 1


@pytest.mark.parametrize("args,named", [
    (["--logprobs", "3", "hi", "--bogus"], "--logprobs 3 --bogus"),  # the other unknown flag still named
    (["--logprobs", "--bogus", "hi"], "--logprobs --bogus"),  # a flag after it is no value of it
    (["--logprobs", "-1", "hi"], "--logprobs -1"),  # a negative number is
])
def test_another_commands_flag_is_named_with_its_value_and_the_rest(args, named):
    """Another command's flag given a value is named with the value as typed, beside every other
    unknown flag; the word after it is taken as its value only where it is not itself a flag."""
    res = monobatch("run", *args, timeout=60)
    assert res.returncode == 2, res
    assert res.stderr.endswith(f"unrecognized arguments: {named}; --logprobs is a flag of monobatch generate (see --help)\n"), \
        res.stderr


def test_a_model_given_as_the_prompt_is_named(tmp_path):
    """vLLM's and Ollama's habit, the model first: a positional prompt that names a model file (a
    .gguf file, an HF folder) is refused with -m named, not generated from; words after the prompt
    of a command that takes one get the hint that it takes one prompt and a model with -m; other
    extras (serve's, an unknown short flag) do not."""
    gguf, hf = tmp_path / "m.gguf", tmp_path / "hf"
    gguf.write_bytes(b"GGUF")
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    for command, args in (("generate", [str(gguf), "-n", "2"]), ("run", [str(gguf)]), ("generate", [str(hf)])):
        res = monobatch(command, *args, timeout=60)
        assert res.returncode == 1 and res.stdout == "", res
        assert f"names a model, not a prompt: give the model with -m {args[0]} (a prompt of that text with -p)" \
            in res.stderr, res.stderr
        assert len(res.stderr.splitlines()) == 1, res.stderr
    hint = "takes one prompt (quote it) and a model with -m MODEL"
    res = monobatch("run", "smollm2", "Why is the sky blue?", timeout=60)
    assert res.returncode == 2 and res.stderr.endswith(
        f"unrecognized arguments: Why is the sky blue?; monobatch run {hint} (see --help)\n"), res.stderr
    for command, args in (("serve", ["smollm2", "extra"]), ("run", ["-z", "hi"])):
        res = monobatch(command, *args, timeout=60)
        assert res.returncode == 2 and "unrecognized arguments" in res.stderr and hint not in res.stderr, res.stderr
    res = monobatch("chat", "hi", timeout=60)  # chat takes its prompts at its own prompt or from stdin
    assert res.returncode == 2 and res.stderr.endswith(
        'unrecognized arguments: hi; monobatch chat takes no prompt argument (type at its prompt, or pipe lines '
        'in) and a model with -m MODEL; for one prompt: monobatch run "..." (see --help)\n'), res.stderr


def test_a_positional_prompt_imports_no_torch():
    """The thin client (run --server-base) reads a positional prompt without the loader or torch."""
    code = ("import sys; from monobatch.cli.args import read_prompt; read_prompt('hi', None, ''); "
            "print(sorted(m for m in ('torch', 'fastapi', 'uvicorn') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "src")})
    assert out.stdout.strip() == "[]", out.stderr


def test_every_parser_refuses_abbreviations():
    """Every parser and subparser of the command (a new one too) has prefix matching off."""
    import argparse

    sys.path.insert(0, str(ROOT / "src"))
    from monobatch.cli.main import build_parser

    parsers, seen = [build_parser()], []
    while parsers:
        p = parsers.pop()
        seen.append(p.prog)
        assert p.allow_abbrev is False, p.prog
        parsers += [sp for a in p._actions if isinstance(a, argparse._SubParsersAction) for sp in a.choices.values()]
    assert len(seen) == 8, seen
    ns, extras = build_parser().parse_known_args(["generate", "--temp", "0.5", "--max-tokens", "3"])
    assert (ns.temperature, ns.max_tokens, extras) == (0.5, 3, [])  # whole flags, llama.cpp's --temp among them


def test_unknown_flag_without_a_command():
    res = monobatch("--bogus", timeout=60)
    assert res.returncode == 2 and res.stderr == "monobatch: error: unrecognized arguments: --bogus (see --help)\n"


@pytest.mark.parametrize("command", ["generate", "run", "serve", "bench", "parity"])
@pytest.mark.parametrize("args,needle", [(["--device", "tpu"], "argument --device: unknown device 'tpu'"),
                                         (["--dtype", "float64"], "argument --dtype: invalid choice: 'float64'")])
def test_bad_device_or_dtype_is_a_flag_error(command, args, needle):
    """docs/cli.md: a bad choice is a flag error, exit 2, refused before anything loads."""
    res = monobatch(command, *args, timeout=60)
    assert res.returncode == 2, res
    assert_one_line_error(res, f"monobatch {command}: error: {needle}", "(see --help)")


def test_reasoning_format_needs_chat():
    """Like --system: a raw completion has no reasoning split, so the flag would do nothing."""
    res = monobatch("generate", "-p", "x", "--reasoning-format", "none", timeout=60)
    assert res.returncode == 1
    assert_one_line_error(res, "monobatch generate: error: --reasoning-format needs --chat")


@pytest.mark.parametrize("config,needles", [
    ({"model_type": "llama", "hidden_size": "x"}, ["config.json: hidden_size must be an integer >= 1", '"x"']),
    ({}, ["config.json is incomplete", "no model_type"]),
    ([1, 2], ["config.json: expected a JSON object"]),
])
def test_malformed_hf_config_is_one_line(tmp_path, config, needles):
    (tmp_path / "config.json").write_text(json.dumps(config))
    res = monobatch("generate", "-p", "hi", "--no-progress", "-m", str(tmp_path), timeout=120)
    assert res.returncode == 1
    assert_one_line_error(res, "monobatch generate: error:", *needles)


def test_errors_stay_one_line_with_progress_enabled():
    """Without --no-progress the bar is off when stderr is not a terminal: the error is alone."""
    assert_one_line_error(monobatch("generate", "-p", ""), "prompt is empty")


def test_non_utf8_prompt_is_refused():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    res = subprocess.run([sys.executable, "-m", "monobatch", "generate", "--no-progress"], input=b"a\xffb",
                         capture_output=True, timeout=120, env=env)
    res.stderr = res.stderr.decode()
    assert_one_line_error(res, "not valid UTF-8")


BAD = os.fsdecode(b"a\xffb")  # how Python hands a command line's bytes that are not UTF-8: "a\udcffb"
NO_MODEL = ("-m", "/nonexistent/model.gguf")  # without the check: a fast failure, not a generation


@pytest.mark.parametrize("argv,flag", [
    (["run", "--server-base", "http://127.0.0.1:9", "-p", "hi", "--system", BAD], "--system"),
    (["run", "--server-base", "http://127.0.0.1:9", "-p", "hi", "--stop", "ok", "--stop", BAD], "--stop"),
    (["chat", "--server-base", "http://127.0.0.1:9", "--json-schema", BAD], "--json-schema"),
    (["generate", "-p", "hi", *NO_MODEL, "--dry-multiplier", "1", "--dry-sequence-breaker", BAD],
     "--dry-sequence-breaker"),
    (["generate", "-p", "hi", *NO_MODEL, "--stop", BAD], "--stop"),
    (["generate", "-p", "hi", "-m", BAD], "-m/--model"),
    (["serve", "--port", "-1", "--served-model-name", "ok", BAD], "--served-model-name"),
    (["serve", BAD], "MODEL"),
    (["bench-serve", "--label", BAD], "--label"),
    (["parity", "--configs", BAD], "--configs"),
])
def test_a_text_flag_that_is_not_utf8_is_a_flag_error(argv, flag, capsys):
    """Any text flag (or list of them) holding bytes that are not UTF-8 is refused by the parser,
    before anything runs, as one line naming the flag, exit 2 (it once crashed in the tokenizer or
    the HTTP body, or was taken silently, as --stop was)."""
    from monobatch.cli.main import main

    with pytest.raises(SystemExit) as exited:
        main(argv)
    out, err = capsys.readouterr()
    assert exited.value.code == 2 and out == ""
    assert err == f"monobatch {argv[0]}: error: {flag}: not valid UTF-8 text: byte 0xFF at character 1 (see --help)\n"


@pytest.mark.parametrize("argv", [["generate", "-p", BAD], ["generate", BAD], ["run", BAD], ["run", "-p", BAD],
                                  ["parity", "-p", BAD]])
def test_a_prompt_argument_that_is_not_utf8_keeps_the_prompts_message(argv, capsys):
    """The prompt is checked as the prompt, wherever it comes from (stdin, -f, -p, the argument):
    the prompt's own message (exit 1; parity's error code, 2)."""
    from monobatch.cli.main import main

    rc = main(argv)
    assert rc == (2 if argv[0] == "parity" else 1)
    assert capsys.readouterr().err == (f"monobatch {argv[0]}: error: the prompt is not valid UTF-8 text (byte 0xFF at "
                                       "character 1)\n")


def test_a_text_flag_that_is_not_utf8_on_a_real_command_line():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    res = subprocess.run([sys.executable, "-m", "monobatch", "generate", "-p", "hi", "--stop", b"a\xffb"],
                         capture_output=True, timeout=120, env=env)
    assert res.returncode == 2 and res.stdout == b""
    assert res.stderr == b"monobatch generate: error: --stop: not valid UTF-8 text: byte 0xFF at character 1 (see --help)\n"


@pytest.mark.parametrize("argv,line", [
    (["generate", "-p", "hi", *NO_MODEL, "--json-schema", "@"],
     "monobatch generate: error: --json-schema: the file name is missing (@FILE: a file name after the @)"),
    (["generate", "-p", "hi", *NO_MODEL, "--grammar-file", ""], "monobatch generate: error: --grammar-file: the file name is missing"),
    (["generate", *NO_MODEL, "-f", ""], "monobatch generate: error: -f/--file: the file name is missing"),
    (["generate", "-p", "hi", "--chat", "--chat-template-file", ""],
     "monobatch generate: error: --chat-template-file: the file name is missing"),
    (["generate", "-p", "hi", *NO_MODEL, "--json-schema", "null"],
     "monobatch generate: error: --json-schema: a JSON schema must be an object, got null"),
    (["generate", "-p", "hi", *NO_MODEL, "--json-schema", "[1]"],
     "monobatch generate: error: --json-schema: a JSON schema must be an object, got an array"),
    (["generate", "-p", "hi", "-m", ""], "monobatch generate: error: -m/--model: empty path"),
    (["run", "-m", "", "hi"], "monobatch run: error: -m/--model: empty path"),
    (["serve", "--port", "0", "-m", ""], "monobatch serve: error: -m/--model: empty path"),
    (["parity", "-m", ""], "monobatch parity: error: -m/--model: empty path"),
])
def test_messages_say_what_is_wrong(argv, line, capsys):
    """An empty @FILE or file flag (once "cannot read '': Is a directory"), a schema that is JSON
    null (once "got NoneType"), an empty -m (once the current folder, read as a checkpoint): the
    line says what it is, before anything loads."""
    from monobatch.cli.main import main

    rc = main(argv)
    assert rc == (2 if argv[0] == "parity" else 1)
    assert capsys.readouterr().err == line + "\n"


def test_a_truncated_gguf_is_one_line(bundled_path, tmp_path):
    cut = tmp_path / "cut.gguf"
    with open(bundled_path, "rb") as src:
        cut.write_bytes(src.read(50_000_000))
    res = monobatch("generate", "-p", "hi", "--no-progress", "-t", "1", "-m", str(cut))
    assert_one_line_error(res, f"monobatch generate: error: {cut}: the file is truncated (tensor data past the end of "
                               "the file: the file has 50000000 bytes, a tensor's data runs to byte ")


def test_serve_refuses_a_file_that_is_no_gguf_before_it_listens(tmp_path):
    """``serve -m FILE`` with a file that is no GGUF: the loader's one line, before the server
    listens (it loads on its own thread once listening, and would print its start-up lines first)."""
    bad = tmp_path / "bad.gguf"
    bad.write_text("not a gguf")
    res = monobatch("serve", "--port", "0", "-m", str(bad), timeout=60)
    assert_one_line_error(res, f"monobatch serve: error: {bad}: not a readable GGUF file (GGUF magic invalid)")
    assert "listening" not in res.stderr


def test_serve_whose_engine_cannot_be_built_ends_with_its_one_error_line():
    """``serve --kv-cache-memory 1K``: the model loads (once listening: /health answers 503 while
    it does), then the engine refuses the pool. stderr: the "listening on" line, the loader's INFO
    lines (the default --log-level info), then exactly one error line, last — no uvicorn start-up or
    shutdown lines, no duplicate ``ERROR: ... loading the model failed`` log line; exit 1."""
    res = monobatch("serve", "--port", "0", "--no-progress", "-t", "1", "--kv-cache-memory", "1K")
    assert res.returncode == 1, res.stderr
    assert "Traceback" not in res.stderr and res.stdout == ""
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    errors = [ln for ln in lines if "error" in ln.lower()]
    assert errors == [lines[-1]], res.stderr
    assert lines[-1].startswith("monobatch serve: error: the KV cache memory (1,024 bytes) holds 0 tokens"), res.stderr
    for uvicorn_says in ("Started server", "Uvicorn running", "Application startup", "Shutting down",
                         "Finished server process"):
        assert uvicorn_says not in res.stderr, res.stderr
    assert lines[0].startswith("monobatch serve: listening on http://127.0.0.1:"), res.stderr
    assert all(ln.startswith("INFO:     monobatch.") for ln in lines[1:-1]), res.stderr  # the loader's, nothing else


def test_logprobs_needs_json_output():
    assert_one_line_error(monobatch("generate", "-p", "hi", "--logprobs", "2"), "--output-format json")


def test_progress_bar_on_a_terminal():
    """On a terminal, loading shows a progress bar on stderr (llama.cpp users expect one)."""
    import fcntl
    import pty
    import struct
    import termios

    main_fd, child_fd = pty.openpty()
    fcntl.ioctl(child_fd, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))  # a real terminal's size
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.Popen([sys.executable, "-m", "monobatch", "generate", "-p", "Hi", "-n", "1", "--temperature", "0"],
                            stdout=subprocess.PIPE, stderr=child_fd, env=env)
    os.close(child_fd)
    chunks = []
    while True:
        try:
            data = os.read(main_fd, 4096)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=180) == 0
    os.close(main_fd)
    assert b"loading weights" in b"".join(chunks)


def test_missing_model():
    res = monobatch("generate", "-p", "hi", "-m", "/nonexistent/model.gguf")
    assert_one_line_error(res, "model not found", "/nonexistent/model.gguf")
    assert "downloads nothing" not in res.stderr


def test_a_hugging_face_repo_id_says_nothing_is_downloaded():
    """``-m org/name`` (vLLM's habit) that is no local path: the one line says monobatch downloads
    nothing and what to give instead (a new user's trial, 2026-12-05)."""
    from monobatch.errors import ModelNotFoundError
    from monobatch.loader import resolve_model_path

    with pytest.raises(ModelNotFoundError, match="model not found: HuggingFaceTB/SmolLM2-135M-Instruct; "
                                                 "monobatch downloads nothing: give a local GGUF file"):
        resolve_model_path("HuggingFaceTB/SmolLM2-135M-Instruct")
    with pytest.raises(ModelNotFoundError) as missing:
        resolve_model_path("models/absent.gguf")  # a relative path, not a repo id
    assert "downloads nothing" not in str(missing.value)


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf at all")
    assert_one_line_error(monobatch("generate", "-p", "hi", "-m", str(bad)), "not a readable GGUF")


@pytest.mark.parametrize("command,code", [("generate", 1), ("bench", 1), ("parity", 2)])
def test_a_corrupt_safetensors_file_is_one_line(tmp_path, command, code):
    """An HF folder whose *.safetensors is not readable: one line naming the file, as a bad GGUF
    (it was safetensors' SafetensorError traceback in generate, bench and parity)."""
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "model.safetensors").write_text("garbage\n")
    args = ("-p", "hi") if command == "generate" else ()
    res = monobatch(command, *args, "-t", "1", "--no-progress", "-m", str(tmp_path))
    assert res.returncode == code
    assert_one_line_error(res, f"monobatch {command}: error: {tmp_path}/model.safetensors: not a readable safetensors "
                               "file (Error while deserializing header: header too large)")


def test_unsupported_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 8}))
    assert_one_line_error(monobatch("generate", "-p", "hi", "-m", str(tmp_path)), "unsupported architecture", "gpt2")


@pytest.mark.parametrize("name,value", [("MONOBATCH_DECODE_STAGES", "abc"), ("MONOBATCH_DECODE_STAGES", "0"),
                                        ("MONOBATCH_DECODE_SPLITS", "3,2"), ("MONOBATCH_DECODE_SPLITS", "x"),
                                        ("MONOBATCH_DECODE_BLOCK_N", "48"), ("MONOBATCH_DECODE_MIN_PART", "96"),
                                        ("MONOBATCH_DECODE_WARPS", "3"), ("MONOBATCH_VARLEN_WARPS", "64"),
                                        ("MONOBATCH_VARLEN_BLOCK_N", "256"), ("MONOBATCH_VARLEN_STAGES", "-1")])
def test_malformed_kernel_setting_is_one_line(monkeypatch, name, value):
    """A malformed kernel A/B variable (read at import, on any device) stops the command with one
    line naming it, before anything loads, with the CLI's error prefix (exit 1)."""
    monkeypatch.setenv(name, value)
    res = monobatch("generate", "-p", "hi", "-n", "1")
    assert res.returncode == 1
    assert_one_line_error(res, f"monobatch generate: error: {name}=")


def test_empty_prompt():
    assert_one_line_error(monobatch("generate", "-p", "", "--no-progress"), "prompt is empty")


def test_no_prompt_on_a_closed_stdin():
    assert_one_line_error(monobatch("generate", "--no-progress", stdin=""), "prompt is empty")


def test_prompt_longer_than_context():
    res = monobatch("generate", "-p", "word " * 40, "-c", "16", "--no-progress")
    assert_one_line_error(res, "context is 16 tokens")


def test_generate_streams_text_and_reports_json(loaded):
    res = monobatch("generate", "--chat", "-p", "What is 2+2?", "--temperature", "0", "-n", "12", "--no-progress")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip()
    assert "finish_reason=" in res.stderr
    res = monobatch("generate", "--temperature", "0", "-n", "-1", "-c", "40", "--ignore-eos", "--output-format", "json",
                    "--logprobs", "2", "--no-progress", stdin="Once upon a time")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["finish_reason"] == "length"
    assert out["usage"]["total_tokens"] == 40  # -n -1 runs to the context end
    assert set(out["timings"]) >= {"load_ms", "ttft_ms", "decode_tok_per_s"}
    # Logprobs are the model's distribution: a greedy token is its own top-1 alternative.
    assert len(out["logprobs"]) == len(out["token_ids"])
    for tok, entry in zip(out["token_ids"], out["logprobs"]):
        top = entry["top_logprobs"]
        assert len(top) == 2 and top[0]["logprob"] >= top[1]["logprob"]
        assert entry["token_id"] == tok == top[0]["token_id"]
        assert entry["logprob"] == pytest.approx(top[0]["logprob"]) and entry["logprob"] <= 0
        assert entry["token"] == top[0]["token"] and isinstance(top[1]["token"], str)
    # the tokens' texts join to the generated text (the prompt ends mid-sentence: no leading-space rule applies)
    assert "".join(e["token"] for e in out["logprobs"]) == out["text"]


def test_bench_json_dummy_weights():
    res = monobatch("bench", "--dummy-weights", "--shape", "smollm2-135m", "-p", "16", "-n", "8", "-r", "1", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["prompt_tokens"] == 16 and out["gen_tokens"] == 8
    assert out["decode_tok_s"] > 0 and out["ttft_ms"] > 0 and out["peak_rss_mib"] > 0


def test_stdin_trailing_newline_is_not_part_of_the_prompt():
    """`echo text | monobatch generate` sends the same prompt as `-p text` (llama.cpp strips it too)."""
    piped = json.loads(monobatch("generate", "-n", "0", "--output-format", "json", "--no-progress",
                                 stdin="Once upon a time\n").stdout)
    flag = json.loads(monobatch("generate", "-n", "0", "--output-format", "json", "--no-progress",
                                "-p", "Once upon a time").stdout)
    assert piped["usage"]["prompt_tokens"] == flag["usage"]["prompt_tokens"] == 4


def test_bench_shape_needs_dummy_weights():
    assert_one_line_error(monobatch("bench", "--shape", "llama-1b"), "--dummy-weights")


def test_bench_unknown_shape():
    assert_one_line_error(monobatch("bench", "--dummy-weights", "--shape", "gpt-5"), "unknown shape")


def test_ctx_size_cap_note_names_the_command():
    """-c above the model's context is capped, with a note prefixed like every other line."""
    ctx = 8192  # the bundled model's (test_loader checks it)
    res = monobatch("generate", "-p", "Hi", "-n", "1", "--temperature", "0", "-c", str(ctx * 4), "--no-progress",
                    "-t", "1")
    assert res.returncode == 0, res.stderr
    assert f"monobatch generate: -c {ctx * 4} exceeds the model's context; using {ctx}\n" in res.stderr, res.stderr


def test_threads_beyond_the_usable_cpus_are_capped_with_a_note():
    """-t above the CPUs this process may use (-t 100000 once crashed in libgomp creating its
    threads; -t 10000 decoded at 0.1 tok/s) runs at that count, with one note in -c's style."""
    cpus = len(os.sched_getaffinity(0))
    res = monobatch("generate", "-p", "Hi", "-n", "1", "--temperature", "0", "-t", "100000", "--no-progress")
    assert res.returncode == 0, res
    assert f"monobatch generate: -t 100000 exceeds the {cpus} CPUs this process may use; using {cpus}\n" in res.stderr


def test_the_threads_cap_is_one_note_in_the_flag_check_every_command_makes(monkeypatch, capsys):
    """engine_settings, which every command with -t calls first (some twice), lowers -t once."""
    sys.path.insert(0, str(ROOT / "src"))
    from monobatch.cli import args
    from monobatch.cli.main import build_parser

    assert args.usable_cpus() == len(os.sched_getaffinity(0))
    monkeypatch.setattr(args.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    for command, threads, after in (("serve", 10000, 3), ("run", 3, 3), ("parity", -1, -1)):
        ns = build_parser().parse_args([command, "-t", str(threads)])
        args.engine_settings(ns)
        args.engine_settings(ns)
        assert ns.threads == after
        note = f"monobatch {command}: -t {threads} exceeds the 3 CPUs this process may use; using 3\n"
        assert capsys.readouterr().err == (note if threads > 3 else "")


def test_prompt_from_a_file_as_llama_cpp_reads_it(tmp_path):
    """``generate -f FILE`` (llama-completion's flag) sends the file's text, one trailing newline
    dropped, as ``-p`` sends the same text; with ``-p`` too, or a file that is not there, one line."""
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("Once upon a time\n", encoding="utf-8")
    args = ("--temperature", "0", "-n", "4", "--ignore-eos", "--output-format", "json", "--no-progress")
    from_file = monobatch("generate", "-f", str(prompt), *args)
    from_flag = monobatch("generate", "-p", "Once upon a time", *args)
    assert from_file.returncode == 0 and from_flag.returncode == 0, from_file.stderr + from_flag.stderr
    a, b = json.loads(from_file.stdout), json.loads(from_flag.stdout)
    assert a["token_ids"] == b["token_ids"] and a["usage"] == b["usage"]
    assert_one_line_error(monobatch("generate", "-f", str(prompt), "-p", "hi", "--no-progress"),
                          "the prompt was given with -p/--prompt and with -f/--file: give it once")
    assert_one_line_error(monobatch("generate", "-f", str(tmp_path / "absent.txt"), "--no-progress"),
                          "cannot read the prompt file")


def test_serve_takes_the_model_as_vllm_does(tmp_path):
    """``monobatch serve MODEL`` (vLLM's form) names the model as -m does: a missing file is refused
    before any port is bound, naming that file; the positional and a different -m, one line."""
    missing = str(tmp_path / "absent.gguf")
    assert_one_line_error(monobatch("serve", missing, "--port", "0"), "absent.gguf")
    assert_one_line_error(monobatch("serve", missing, "-m", str(tmp_path / "other.gguf"), "--port", "0"),
                          "give the model once")
    # --served-model-name takes every word after it: a model given after it is refused, not served as a name
    # beside the bundled model (a new user's trial, 2026-12-05)
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text("{}")  # a safetensors folder's mark (args.names_a_model)
    for model in (missing, str(tmp_path / "hf"), "gemma3"):  # a path, a folder, a model by name
        assert_one_line_error(monobatch("serve", "--served-model-name", "foo", model, "--port", "0"),
                              f"--served-model-name took {model!r} as a name and no model was given")


@pytest.mark.parametrize("pattern,cause", [("[0-9", "unclosed character class"), ("(ab", "unclosed group"),
                                           ("ab\\", "incomplete escape sequence (a backslash at the end)"),
                                           ("\\d+[a-", "unclosed character class")])
def test_a_regex_that_does_not_parse_is_one_line_before_loading(pattern, cause):
    """--regex is checked with llguidance's parser (Rust regex syntax) before a model loads (the
    missing model is not what is reported), and the line says so plainly with the short cause,
    the pattern as typed (``"\\d+[a-"``, not JSON's ``"\\\\d+[a-"``)."""
    res = monobatch("generate", "-m", "/nonexistent/model.gguf", "-p", "hi", "-n", "2", "--no-progress",
                    "--regex", pattern)
    assert_one_line_error(res, f'--regex: the regular expression "{pattern}" does not compile: {cause}')
    assert "at 1(" not in res.stderr and "(in regex)" not in res.stderr


def test_a_regex_too_large_to_compile_and_one_that_compiles(loaded):
    """A pattern that parses but that llguidance's lexer refuses is reported the same way, once the
    model's vocabulary is there; a good one constrains the reply."""
    res = monobatch("generate", "-p", "hi", "-n", "2", "--no-progress", "--regex", "a{1000000}")  # ~0.5 s to refuse
    assert_one_line_error(res, '--regex: the regular expression "a{1000000}" does not compile: ',
                          "(the pattern is too large)")
    res = monobatch("generate", "-p", "My phone number is", "-n", "12", "--temperature", "0", "--no-progress",
                    "--regex", "[0-9]{3}-[0-9]{4}")
    assert res.returncode == 0, res.stderr
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", res.stdout.strip()), res.stdout


@pytest.mark.parametrize("load, threads, tty, shown", [
    (2.4, 2, True, True), (1.2, 2, True, False), (2.4, 1, True, False), (2.4, 2, False, False)])
def test_a_busy_machine_gets_a_one_line_threads_note_on_a_terminal(monkeypatch, capsys, load, threads, tty, shown):
    """The default threads on a machine whose load average is about its core count: one stderr
    line pointing at -t 1 (a new user's first `make run` decoded 0.7 tok/s so, 25 with -t 1);
    nothing on an idle machine, at one thread, or where stderr is not a terminal (scripts, tests)."""
    from monobatch.cli import args

    monkeypatch.setattr(args.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(args.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(args.sys.stderr, "isatty", lambda: tty)
    args.busy_machine_hint("run", threads)
    err = capsys.readouterr().err
    if shown:
        assert err.count("\n") == 1 and err.startswith("monobatch run: note: this machine is busy (load average 2.4 on 2")
        assert "-t 1" in err
    else:
        assert err == ""


@pytest.mark.parametrize("load, shown", [(2.4, True), (1.2, False)])
def test_serve_on_a_busy_machine_logs_the_threads_warning(monkeypatch, capsys, caplog, load, shown):
    """``serve`` with the default threads on a busy machine: a warning in its log whether or not
    stderr is a terminal (a server's log is where its operator looks; a new user's server decoded
    at 1 tok/s beside a test suite without a word)."""
    import logging

    from monobatch.cli import args

    monkeypatch.setattr(args.os, "getloadavg", lambda: (load, load, load))
    monkeypatch.setattr(args.os, "cpu_count", lambda: 2)
    monkeypatch.setattr(args.sys.stderr, "isatty", lambda: False)
    with caplog.at_level(logging.WARNING, logger="monobatch"):
        args.busy_machine_hint("serve", 2)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert capsys.readouterr().err == ""
    assert warned == (["this machine is busy (load average 2.4 on 2 cores): with 2 threads decode may wait for the "
                       "CPU; -t 1 can be many times faster"] if shown else [])
