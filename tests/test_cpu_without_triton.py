"""On a machine without CUDA the product never imports Triton (kernels/common.py: ~70 MB of
resident memory for kernels no CPU path launches); the test suite itself sets
``MONOBATCH_TRITON=1`` (conftest.py), so this runs the default in a child process."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cli_util import cli_env

CHILD = """
import contextlib, io, json, sys
from monobatch.cli.main import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    rc = main(["generate", "-t", "1", "--no-progress", "-n", "6", "--temperature", "0", "--ignore-eos",
               "--output-format", "json", "-p", "The capital of France is"])
from monobatch.kernels import common
print(json.dumps({"rc": rc, "triton": "triton" in sys.modules, "common": common.triton is None,
                  "out": out.getvalue()}))
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine imports Triton by design")
@pytest.mark.parametrize("setting", ["auto", None])
def test_generate_on_cpu_never_imports_triton(setting):
    env = {k: v for k, v in cli_env().items() if k not in ("MONOBATCH_TRITON", "TRITON_INTERPRET")}
    if setting:
        env["MONOBATCH_TRITON"] = setting
    res = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.splitlines()[-1])
    assert got["rc"] in (0, None) and not got["triton"] and got["common"], got
    assert len(json.loads(got["out"])["token_ids"]) == 6, got["out"]


def test_kernel_cache_is_one_folder_per_installed_copy(monkeypatch, tmp_path):
    """Two checkouts must not share a build folder (ninja's build file names the source paths, so
    each would rebuild the other's module on every start): the folder names torch's version and a
    hash of this package's folder, under $MONOBATCH_KERNEL_CACHE."""
    import hashlib

    from monobatch.kernels import quant_cpu

    monkeypatch.setenv("MONOBATCH_KERNEL_CACHE", str(tmp_path))
    where = hashlib.sha1(str(Path(quant_cpu.__file__).resolve().parent).encode()).hexdigest()[:10]
    assert quant_cpu.cache_dir() == tmp_path / f"torch-{torch.__version__}-{where}"


def test_build_folders_of_deleted_copies_are_pruned(tmp_path):
    """A build folder whose ``build.ninja`` compiles a source that no longer exists (a deleted
    checkout), not loaded for STALE_DAYS, is removed; one whose source exists (a space in its path,
    escaped as ninja does), one loaded recently (a copy that may live on another host sharing the
    cache), one without a build file and the current one are kept."""
    import os
    import time

    from monobatch.kernels import quant_cpu

    live = tmp_path / "a checkout" / "quant_cpu.cpp"
    live.parent.mkdir()
    live.write_text("")
    dead = str(tmp_path / "gone" / "quant_cpu.cpp")
    old = time.time() - (quant_cpu.STALE_DAYS + 1) * 86400

    def folder(name: str, source: str | None, when: float = old) -> Path:
        d = tmp_path / "cache" / name
        d.mkdir(parents=True)
        (d / "x.so").write_bytes(b"")
        if source is not None:
            (d / "build.ninja").write_text(f"ninja_required_version = 1.3\nbuild quant_cpu.o: compile {source}\n"
                                           f"build cpu_ops.o: compile {source}\n")
        os.utime(d, (when, when))
        return d

    current = folder("torch-1-current", dead)
    gone = folder("torch-1-gone", dead)
    kept = folder("torch-1-live", str(live).replace(" ", "$ "))
    recent = folder("torch-1-recent", dead, when=time.time() - (quant_cpu.STALE_DAYS - 1) * 86400)
    bare = folder("torch-1-bare", None)
    other = folder("unrelated", dead)
    assert quant_cpu.prune_stale(current) == [gone]
    assert not gone.exists() and all(d.exists() for d in (current, kept, recent, bare, other))
    # aged against a later time, the recent one goes too
    assert quant_cpu.prune_stale(current, now=time.time() + 2 * 86400) == [recent]


def test_an_unknown_triton_setting_warns_and_counts_as_auto():
    """``MONOBATCH_TRITON=yes`` is not silently taken for something: one warning naming the value
    and the accepted ones, then the default (on this CPU machine: no Triton)."""
    env = {k: v for k, v in cli_env().items() if k not in ("MONOBATCH_TRITON", "TRITON_INTERPRET")}
    env["MONOBATCH_TRITON"] = "yes"
    code = "from monobatch.kernels import common; print(common.triton is None)"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stderr
    assert "MONOBATCH_TRITON='yes' is not one of auto, 1, 0: using auto" in res.stderr
    if not torch.cuda.is_available():
        assert res.stdout.strip() == "True"
