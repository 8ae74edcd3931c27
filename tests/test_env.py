"""The MONOBATCH_* knobs (monobatch.env): a bad value is one ``monobatch: warning:`` line naming it
and the default is used, except the kernels' tile/split settings, which stop the command with the
CLI's one-line error. A MONOBATCH_* name that is none of them is one warning line, with the
closest known name; the registry of names is checked against the code and docs/cli.md."""

from __future__ import annotations

import re
import subprocess

import pytest

from cli_util import cli_env, monobatch
from monobatch import env
from server_util import ROOT

#: A name as the code writes it (the registry's test greps src/ and scripts/ for it).
NAME_RE = re.compile(r"MONOBATCH_[A-Z0-9_]+")

#: Bad values of every warning knob the CPU `generate` path reads, and the line each gives.
BAD = {
    "MONOBATCH_FUSED_KERNELS": ("maybe", "is not 0 or 1: using 1"),
    "MONOBATCH_PDL": ("maybe", "is not 0 or 1: using 1"),
    "MONOBATCH_TRITON_GEMV": ("x", "is not 0 or 1: using 1"),
    "MONOBATCH_TRITON_ARGMAX": ("x", "is not 0 or 1: using 1"),
    "MONOBATCH_FORCED_DRAWS": ("x", "is not 0 or 1: using 1"),
    "MONOBATCH_DET_GLU": ("x", "is not 0 or 1: using 1"),
    "MONOBATCH_CPU_KERNELS": ("x", "is not 0 or 1: using 1"),
    "MONOBATCH_PACKED_GEMV": ("foo", "is not one of fma, dot, dp4a: using dp4a"),
    "MONOBATCH_PACKED_DEQUANT_M": ("x", "is not an integer: using 17"),
    "MONOBATCH_CPU_MIN_THREAD_WORK": ("abc", "is not a positive integer: using the default"),
    "MONOBATCH_TP_TIMEOUT": ("abc", "is not a positive number of seconds: using 300.0"),
    "MONOBATCH_KERNEL_CACHE": ("/proc/nonexistent", "is not a usable folder ("),
}


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    monkeypatch.setattr(env, "_WARNED", set())


def test_flag(monkeypatch, capsys):
    for value, default, want in (("1", False, True), ("0", True, False), ("", True, True), ("", False, False)):
        monkeypatch.setenv("MONOBATCH_X", value)
        assert env.flag("MONOBATCH_X", default) is want
    monkeypatch.delenv("MONOBATCH_X")
    assert env.flag("MONOBATCH_X", True) is True
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("MONOBATCH_X", "yes")
    assert env.flag("MONOBATCH_X", True) is True and env.flag("MONOBATCH_X", True) is True
    assert capsys.readouterr().err == "monobatch: warning: MONOBATCH_X='yes' is not 0 or 1: using 1\n"  # once


def test_choice(monkeypatch, capsys):
    monkeypatch.setenv("MONOBATCH_X", "b")
    assert env.choice("MONOBATCH_X", "a", ("a", "b")) == "b"
    monkeypatch.setenv("MONOBATCH_X", "B")
    assert env.choice("MONOBATCH_X", "a", ("a", "b")) == "a"
    assert capsys.readouterr().err == "monobatch: warning: MONOBATCH_X='B' is not one of a, b: using a\n"


@pytest.mark.parametrize("value,want", [("2.5", 2.5), (" 7 ", 7.0), ("abc", 300.0), ("-3", 300.0), ("0", 300.0),
                                        ("nan", 300.0), ("inf", 300.0), ("1e300", 300.0)])
def test_tp_timeout(monkeypatch, capsys, value, want):
    from monobatch.distributed.comm import timeout_s

    monkeypatch.setenv("MONOBATCH_TP_TIMEOUT", value)
    assert timeout_s() == want
    err = capsys.readouterr().err
    if want == 300.0:
        assert err == f"monobatch: warning: MONOBATCH_TP_TIMEOUT={value!r} is not a positive number of seconds: using 300.0\n"
    else:
        assert err == ""


def test_number_parse_and_check(monkeypatch, capsys):
    monkeypatch.setenv("MONOBATCH_X", "12")
    assert env.number("MONOBATCH_X", 3, parse=int) == 12
    monkeypatch.setenv("MONOBATCH_X", "1.5")
    assert env.number("MONOBATCH_X", 3, parse=int, what="a positive integer") == 3
    assert "MONOBATCH_X='1.5' is not a positive integer: using 3" in capsys.readouterr().err


def test_fatal_integer(monkeypatch):
    monkeypatch.setenv("MONOBATCH_X", "48")
    with pytest.raises(env.SettingError, match=r"^MONOBATCH_X='48': expected a power of two >= 16$") as e:
        env.fatal_integer("MONOBATCH_X", 64, minimum=16, power_of_two=True)
    assert e.value.code == "MONOBATCH_X='48': expected a power of two >= 16"  # outside the CLI: exit 1, this line


def test_missing_gemv_table_names_the_variable(monkeypatch, capsys):
    """MONOBATCH_PACKED_GEMV_CONFIGS naming a missing file (read lazily, on CUDA: the GPU name faked)."""
    from monobatch.kernels import quant_gemm as Q

    monkeypatch.setattr(Q, "_gpu_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(Q, "_TABLES", {})
    monkeypatch.setenv(Q.TABLE_ENV, "/nope.json")
    assert Q.tuned_configs() == {}
    assert capsys.readouterr().err == ("monobatch: warning: MONOBATCH_PACKED_GEMV_CONFIGS='/nope.json' is not a "
                                       "readable file (No such file or directory): using the rule\n")


def test_every_bad_knob_warns_once_and_generate_succeeds():
    """One process, every warning knob bad at once: each named in exactly one prefixed line, no
    traceback, the tokens generated."""
    res = monobatch("generate", "-p", "Hi", "-n", "1", "-t", "1", "--no-progress",
                    env=cli_env(**{name: value for name, (value, _) in BAD.items()}))
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    lines = res.stderr.splitlines()
    for name, (value, says) in BAD.items():
        mine = [line for line in lines if line.startswith(f"monobatch: warning: {name}={value!r} ")]
        assert len(mine) == 1 and says in mine[0], (name, res.stderr)


def test_bad_tp_timeout_with_ranks_warns_once():
    """With -tp 2 (gloo on CPU): MONOBATCH_TP_TIMEOUT='abc' is one warning in the engine's process,
    none from the worker rank (it re-imports the knob-reading modules), no traceback; an unknown
    name likewise."""
    res = monobatch("generate", "-p", "Hi", "-n", "1", "-t", "1", "-tp", "2", "--no-progress",
                    env=cli_env(MONOBATCH_TP_TIMEOUT="abc", MONOBATCH_DET_GLU="x", MONOBATCH_TP_TIMEOUTS="9"))
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    assert res.stderr.count("monobatch: warning: MONOBATCH_TP_TIMEOUT='abc' is not a positive number of seconds") == 1
    assert res.stderr.count("MONOBATCH_DET_GLU='x'") == 1, res.stderr
    assert res.stderr.count("unknown environment variable MONOBATCH_TP_TIMEOUTS") == 1, res.stderr


# -- unknown names and the registry -------------------------------------------------------------
def test_unknown_names_warn_once_with_the_closest_known_name(capsys):
    """Each unknown MONOBATCH_* name: one line, sorted, the closest known name where one is a
    letter or two away, never the value; once per process; known and other variables: nothing."""
    environ = {"MONOBATCH_PACKED_GMEV": "fma", "MONOBATCH_APIKEY": "secret", "MONOBATCH_DET_ROWS": "128",
               "monobatch_pdl": "0", "MONOBATCH_PDL": "0", "MONOBATCH_API_KEY": "k", "PATH": "/bin",
               "XMONOBATCH_PDL": "0"}
    env.warn_unknown_names(environ)
    env.warn_unknown_names(environ)  # the CLI's main, then resolve_device: said once
    assert capsys.readouterr().err.splitlines() == [
        "monobatch: warning: unknown environment variable MONOBATCH_APIKEY (did you mean MONOBATCH_API_KEY?)",
        "monobatch: warning: unknown environment variable MONOBATCH_DET_ROWS",  # a removed knob: nothing close
        "monobatch: warning: unknown environment variable MONOBATCH_PACKED_GMEV (did you mean MONOBATCH_PACKED_GEMV?)",
        "monobatch: warning: unknown environment variable monobatch_pdl (did you mean MONOBATCH_PDL?)",
    ]


def test_the_python_api_warns_where_the_device_is_resolved(monkeypatch, capsys):
    """LLM() and every other model builder pass through resolve_device: the warning is there."""
    from monobatch.loader import resolve_device

    monkeypatch.setenv("MONOBATCH_TRITON_GEMW", "1")
    assert resolve_device("cpu").type == "cpu"
    assert capsys.readouterr().err == ("monobatch: warning: unknown environment variable MONOBATCH_TRITON_GEMW "
                                       "(did you mean MONOBATCH_TRITON_GEMV?)\n")


def test_the_cli_warns_once_for_every_command():
    """A command that loads a model (the CLI's main, then resolve_device) and one that loads none:
    the line once, before the command's own output, which is unchanged."""
    typo = cli_env(MONOBATCH_PACKED_GMEV="fma")
    line = "monobatch: warning: unknown environment variable MONOBATCH_PACKED_GMEV (did you mean MONOBATCH_PACKED_GEMV?)"
    res = monobatch("generate", "-p", "Hi", "-n", "1", "-t", "1", "--temperature", "0", "--no-progress", env=typo)
    assert res.returncode == 0 and res.stdout, res.stderr
    assert res.stderr.splitlines()[0] == line and res.stderr.count("unknown environment variable") == 1, res.stderr
    res = monobatch("--version", env=typo)
    assert res.returncode == 0 and res.stdout.startswith("monobatch ") and res.stderr == line + "\n"


def _names_in(*folders: str, skip: tuple[str, ...] = ()) -> dict[str, set[str]]:
    """Every MONOBATCH_* literal in the files under ``folders`` (``skip``: paths relative to the
    root left out), with the files that write it. The files are git's (tracked, and untracked ones
    not ignored), so build outputs (__pycache__, pip's *.egg-info) and ignored leftovers do not
    count; outside a git checkout, every file but those build outputs."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", *folders], cwd=ROOT, capture_output=True,
                            text=True)
    if listed.returncode == 0 and listed.stdout.strip():
        paths = [ROOT / rel for rel in listed.stdout.splitlines()]
    else:
        paths = [p for folder in folders for p in (ROOT / folder).rglob("*")
                 if not any(part == "__pycache__" or part.endswith(".egg-info") for part in p.relative_to(ROOT).parts)]
    found: dict[str, set[str]] = {}
    for path in sorted(paths):
        rel = path.relative_to(ROOT).as_posix()
        if not path.is_file() or rel in skip:
            continue
        for name in NAME_RE.findall(path.read_text(encoding="utf-8", errors="ignore")):
            found.setdefault(name, set()).add(rel)
    return found


def test_the_registry_lists_every_name_the_code_writes():
    """Every MONOBATCH_* literal in src/ and scripts/ is in env.KNOWN_NAMES, so a new knob cannot be
    read without being registered (and then warned about as unknown)."""
    found = _names_in("src", "scripts")
    missing = {name: sorted(files) for name, files in found.items() if name not in env.KNOWN_NAMES}
    assert not missing, f"add these to monobatch.env.KNOWN_NAMES (and docs/cli.md): {missing}"


def test_every_registered_name_is_read_and_documented():
    """...and the other way: each registered name is written somewhere besides the registry (a
    removed knob leaves it), and the environment table of docs/cli.md lists exactly these."""
    read = _names_in("src", "scripts", skip=("src/monobatch/env.py",))
    assert sorted(env.KNOWN_NAMES - read.keys()) == [], "registered but read nowhere: remove them"
    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    section = text.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    table = {name for line in section.splitlines() if line.startswith("|") for name in NAME_RE.findall(line)}
    assert table == env.KNOWN_NAMES, (sorted(table - env.KNOWN_NAMES), sorted(env.KNOWN_NAMES - table))
