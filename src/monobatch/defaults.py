"""The one defaults table. Every client (CLI, server, Python API) reads its defaults here.

Precedence for a sampling field, highest first (see docs/adr/0001-one-engine.md):
request field > server/CLI flag > the model's generation config > this table.
:func:`monobatch.engine.params.resolve_sampling` applies that order; no other module may hold a
default of its own.
"""

from __future__ import annotations

from typing import Any

# -- engine ---------------------------------------------------------------------------------
#: Tokens of one prompt computed per step. The seed project measured 512 raising TTFT at 8K
#: tokens by 8-29 % against 2048, with decode unchanged.
PREFILL_CHUNK = 2048
#: Tokens one step computes across all sequences when --max-num-batched-tokens is not given, by
#: device type (at least PREFILL_CHUNK and MAX_NUM_SEQS). On CUDA one step's GEMMs reach full
#: speed only from a few thousand rows: 128 prompts of 128 tokens prefilled at 138k tok/s in steps
#: of 2,048 tokens and at 227k in steps of 8,192 (H200, llama-1b; vLLM's default is 8,192 too).
STEP_TOKEN_BUDGET = {"cuda": 8192}
#: Tokens per sequence a DenseKv buffer grows by (allocation granularity, not a limit).
DENSE_KV_GROWTH = 256
#: Prompt tokens per step of a request that asked for prompt logprobs: every position's logits
#: ([chunk, vocab] float32) are materialised, so its chunk is smaller (256 x 49152 x 4 B = 48 MiB).
PROMPT_LOGPROBS_CHUNK = 256
#: Sequences the scheduler runs at once.
MAX_NUM_SEQS = 64
#: Paged KV block size in tokens (vLLM, llama.cpp's server use 16 too).
BLOCK_SIZE = 16
#: KV storage when none is named. Paged everywhere: it adds the prefix cache and a memory budget,
#: and at B=1 on CPU it measured within noise of dense (docs/benchmarks); dense stays selectable.
KV_STORAGE = "paged"
#: Paged KV pool on CPU when --kv-cache-memory is not given (bytes), raised to one full context
#: if that is larger. Small and fixed so several test servers fit in one machine's memory.
KV_CACHE_MEMORY_CPU = 1 << 30
#: Paged KV pool on CUDA: this fraction of the device memory free after loading the weights.
KV_CACHE_GPU_FRACTION = 0.85
#: Deterministic mode: rows per fixed GEMM tile, by device type. A larger tile wastes work at
#: B=1; a smaller one slows prefill (CPU, 2 cores: 8 costs 2.5x per GEMM at both ends).
DETERMINISTIC_ROW_TILE = {"cpu": 8, "cuda": 32}

# -- server ---------------------------------------------------------------------------------
#: Seconds in-flight requests get to finish after SIGINT/SIGTERM before they are aborted.
SERVER_SHUTDOWN_TIMEOUT = 5.0

# -- sampling (the table of the last precedence level) --------------------------------------
#: Neutral values: a request that names nothing samples the model's own distribution, as
#: OpenAI's API does (temperature 1, top_p 1) and as vLLM does. Each filter's "off" value.
SAMPLER_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,        # OpenAI API default
    "top_k": 0,                # off (llama.cpp: <= 0 disables; vLLM's -1 accepted too)
    "top_p": 1.0,              # off; OpenAI API default
    "min_p": 0.0,              # off
    "typical_p": 1.0,          # off
    "repeat_penalty": 1.0,     # off
    "repeat_last_n": 64,       # llama.cpp's window
    "presence_penalty": 0.0,   # OpenAI API default
    "frequency_penalty": 0.0,  # OpenAI API default
    "dry_multiplier": 0.0,     # off (llama.cpp)
    "dry_base": 1.75,          # llama.cpp
    "dry_allowed_length": 2,   # llama.cpp
    "dry_penalty_last_n": 64,  # same window as repeat_last_n (ENGINE.md)
    "dry_sequence_breakers": ("\n", ":", '"', "*"),  # llama.cpp
}

#: max_tokens when a request omits it, per entry point. None = until EOS or the context end
#: (llama.cpp's -n -1); 16 is OpenAI's documented default for /v1/completions.
MAX_TOKENS_DEFAULT: dict[str, int | None] = {
    "generate": None,
    "completions": 16,
    "chat": None,
    "python": 16,  # vLLM's SamplingParams default
}
