"""`monobatch bench-serve`: a serving benchmark against a running server, like `vllm bench serve`.

Sends --num-prompts streaming requests of synthesized text (about --input-len prompt tokens,
--output-len generated tokens with ignore_eos) at --request-rate requests/s (Poisson arrivals;
inf = all at once), at most --max-concurrency in flight, and reports request and token
throughput and TTFT / TPOT / ITL / end-to-end latency (mean, median, P90, P99, ms). Output
tokens are the server's usage counts. Works with any OpenAI-compatible server (monobatch serve,
vLLM, llama-server).

  monobatch serve --port 8080 &
  monobatch bench-serve --base-url http://127.0.0.1:8080 --num-prompts 200 --request-rate 8
  monobatch bench-serve --max-concurrency 16 --input-len 512 --output-len 128 --json > serve.json

--json prints one JSON object on one line (settings and results) instead of the table.
Failed requests are counted and the first error shown; exit 1 when none succeeds or the server
cannot be reached.
"""

from __future__ import annotations

import argparse
import json
import math


def _rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected requests per second or inf, got {text!r}") from None
    if math.isnan(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"the rate must be > 0 (inf = all at once), got {text!r}")
    return value


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``monobatch bench-serve`` and its flags."""
    from monobatch.cli.serve import API_KEY_ENV

    p = sub.add_parser("bench-serve", help="serving benchmark against a running server (like vllm bench serve)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8080",
                   help="the server (default http://127.0.0.1:8080; a trailing /v1 is fine)")
    p.add_argument("--api-key", help=f"sent as `Authorization: Bearer KEY` (default ${API_KEY_ENV})")
    p.add_argument("--model", help="the model name to request (default: the first of GET /v1/models)")
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions",
                   help="/v1/completions (default) or /v1/chat/completions")
    p.add_argument("--num-prompts", type=int, default=100, help="requests to send (default 100)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per request, approximately (default 128)")
    p.add_argument("--output-len", type=int, default=128,
                   help="generated tokens per request (max_tokens with ignore_eos; default 128)")
    p.add_argument("--request-rate", type=_rate, default=math.inf,
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the arrival gaps: 1 = Poisson (default), < 1 burstier, > 1 steadier")
    p.add_argument("--max-concurrency", type=int, help="most requests in flight at once (default: no cap)")
    p.add_argument("--seed", type=int, default=0, help="seed of the prompts and arrival times (default 0)")
    p.add_argument("--num-warmups", type=int, default=0,
                   help="requests sent one at a time before the timed run, not counted (default 0)")
    p.add_argument("--timeout", type=float, default=600.0,
                   help="seconds a request's stream may stay silent before it counts as failed (default 600)")
    p.add_argument("--label", help="a label for the result (its `label` field in --json)")
    p.add_argument("--json", action="store_true", help="print one JSON object (one line) instead of the table")
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    """Run the benchmark, print the table or JSON. Returns the exit code."""
    from monobatch.bench_serve import BenchServeError, ServeBenchConfig, bench_serve, table
    from monobatch.cli.serve import api_key_of

    cfg = ServeBenchConfig(
        base_url=ns.base_url, api_key=api_key_of(ns.api_key), model=ns.model,
        endpoint=ns.endpoint, num_prompts=ns.num_prompts, input_len=ns.input_len, output_len=ns.output_len,
        request_rate=ns.request_rate, burstiness=ns.burstiness, max_concurrency=ns.max_concurrency,
        seed=ns.seed, num_warmups=ns.num_warmups, timeout=ns.timeout, label=ns.label)
    result = bench_serve(cfg)
    print(json.dumps(result) if ns.json else table(result), flush=True)
    if result["completed"] == 0:
        raise BenchServeError(f"all {result['failed']} requests failed; the first: {result['first_error']}")
    return 0
