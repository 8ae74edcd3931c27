"""`monobatch bench`: prefill/decode speed and TTFT through the engine, the in-process server
(its engine thread and router) or HTTP; batched throughput as llama.cpp's llama-batched-bench.

Prompts are synthesized text cut to the exact token count, generation is greedy with EOS
ignored, and the prefix cache is bypassed. Every path x prompt length x batch size is measured
(one warm-up, then --runs timed runs, medians). On the bundled model by default, or random
weights of a named shape with --dummy-weights --shape NAME (no download).

  monobatch bench -p 256,8064 -n 128
  monobatch bench --path engine,server,http -p 256
  monobatch bench --dummy-weights --shape llama-1b --device cuda --batch-size 1,8,32,64,128 --json
  monobatch bench --dummy-weights --shape llama-1b --quant Q4_K --device cuda   # random packed weights

--json prints one JSON object per line, one per configuration (its "label" names it).
"""

from __future__ import annotations

import argparse
import json
import sys

from monobatch import defaults
from monobatch.cli.args import add_model_args, engine_settings
from monobatch.errors import InvalidRequestError

#: The paths, in the order they run (monobatch.bench.DRIVERS' keys, named here so that building
#: the parser imports no torch).
PATHS = ("engine", "server", "http")


def _int_list(text: str) -> tuple[int, ...]:
    """An argparse type: a comma list of ints (duplicates dropped); :func:`run` checks the values
    (a bad value exits 1 like every other flag's, a non-integer is a flag error, exit 2)."""
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a comma list of integers such as 1,8,32, got {text!r}") from None
    return tuple(dict.fromkeys(values))


def _paths(text: str) -> tuple[str, ...]:
    """An argparse type: a comma list of path names, returned in :data:`PATHS` order."""
    names = tuple(dict.fromkeys(v.strip() for v in text.split(",")))
    unknown = [n for n in names if n not in PATHS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown path {unknown[0]!r} (expected a comma list of {', '.join(PATHS)})")
    return tuple(p for p in PATHS if p in names)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``monobatch bench`` and its flags."""
    from monobatch.models.shapes import SHAPES

    p = sub.add_parser("bench", help="measure prefill/decode speed (engine, in-process server, HTTP; batched)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-p", "--prompt-tokens", type=_int_list, default=(256,), metavar="N[,N...]",
                   help="prompt lengths in tokens, a comma list (default 256)")
    p.add_argument("-n", "--gen-tokens", type=int, default=128, help="generated tokens, EOS ignored, at least 2 (decode speed needs two; default 128)")
    p.add_argument("-r", "--runs", type=int, default=3, help="timed runs after one warm-up (default 3)")
    p.add_argument("--path", type=_paths, default=("engine",), metavar="PATH[,PATH...]",
                   help="engine (the scheduler directly), server (the server's engine thread and router, in "
                        "process, no HTTP), http (streaming /v1/completions on 127.0.0.1); default engine")
    p.add_argument("--batch-size", type=_int_list, default=(1,), metavar="B[,B...]",
                   help="sequences submitted together, a comma list: 1 = B=1 TTFT/prefill/decode, more = "
                        "llama-batched-bench PP/TG (default 1)")
    p.add_argument("-b", "--concurrency", type=int, default=0,
                   help="also run N requests at once and the same N one after another (default 0: skip)")
    p.add_argument("--dummy-weights", action="store_true", help="random weights of --shape instead of a checkpoint")
    p.add_argument("--shape", help=f"with --dummy-weights: {', '.join(SHAPES)} (default smollm2-135m)")
    p.add_argument("--quant", metavar="TYPE",
                   help="with --dummy-weights: random packed weights of this GGUF type (Q4_0, Q4_1, Q4_K, Q5_0, Q5_K, "
                        "Q6_K, Q8_0) instead of dense ones, run by the packed kernels")
    p.add_argument("--json", action="store_true", help="print one JSON object per line, one per configuration")
    p.add_argument("--constrained", nargs="?", const="only", choices=("only", "ab"),
                   help="decode every request under a JSON schema (structured output: an array of at least 4096 "
                        "small objects, so the grammar cannot end before -n tokens); 'ab': also without it, the "
                        "two arms' runs alternated in this process, the constrained rows with their ratio (vs_plain)")
    add_model_args(p)
    p.set_defaults(func=run, max_num_seqs=None)  # None: max(the default, the largest --batch-size)


def run(ns: argparse.Namespace) -> int:
    """Check the flags, load, measure, print each result as it comes. Returns the exit code."""
    for name, low in (("gen_tokens", 2), ("runs", 1)):
        if getattr(ns, name) < low:
            raise InvalidRequestError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(ns, name)}", name)
    for name in ("prompt_tokens", "batch_size"):
        values = getattr(ns, name)
        if any(v < 1 for v in values):
            raise InvalidRequestError(f"every --{name.replace('_', '-')} value must be >= 1, "
                                      f"got {','.join(map(str, values))}", name)
    if ns.concurrency < 0:
        raise InvalidRequestError(f"--concurrency must be >= 0, got {ns.concurrency}", "concurrency")
    if ns.shape is not None and not ns.dummy_weights:
        raise InvalidRequestError("--shape needs --dummy-weights (a checkpoint has its own shape)", "shape")
    if ns.quant is not None and not ns.dummy_weights:
        raise InvalidRequestError("--quant needs --dummy-weights (a checkpoint has its own types)", "quant")
    if ns.max_num_seqs is None:
        ns.max_num_seqs = max(defaults.MAX_NUM_SEQS, *ns.batch_size)
    engine_settings(ns)  # refuse bad flags before building weights

    from monobatch.bench import TABLE_HEADER, BenchPlan, Setup, run_bench
    from monobatch.cli.args import open_engine
    from monobatch.loader.dummy import dummy_model

    plan = BenchPlan(paths=ns.path, prompt_tokens=ns.prompt_tokens, gen_tokens=ns.gen_tokens,
                     batch_sizes=ns.batch_size, runs=ns.runs, concurrency=ns.concurrency)
    if ns.constrained:
        from monobatch.bench import bench_constraint

        plan.structured, plan.plain_too = bench_constraint(), ns.constrained == "ab"
    loaded = dummy_model(ns.shape or "smollm2-135m", ns.device, ns.dtype, quant=ns.quant) if ns.dummy_weights else None
    scheduler = open_engine(ns, loaded)
    plan.check(scheduler)
    if not ns.json:
        print(Setup.of(scheduler).header())
        constrained = ("" if not plan.structured else ", each row also under the --constrained JSON schema (json), "
                       "runs alternated; last column: its decode/TG rate over the plain row's" if plan.plain_too
                       else ", under the --constrained JSON schema")
        runs = f"median of {plan.runs} runs" if plan.runs > 1 else "1 run"
        print(f"prompt {'/'.join(map(str, plan.prompt_tokens))} + gen {plan.gen_tokens} tokens (synthesized text, "
              f"prefix cache bypassed, greedy, EOS ignored{constrained}); {runs} after 1 warm-up")
        print(TABLE_HEADER, flush=True)

    def emit(row) -> None:
        print(json.dumps(row.to_dict()) if ns.json else row.table_line(), flush=True)
        if row.samples.get("preemptions"):
            print(f"monobatch bench: warning: {row.label}: {row.samples['preemptions']} preemptions (KV pool too "
                  "small for the batch; raise --kv-cache-memory)", file=sys.stderr)

    rows = run_bench(scheduler, plan, emit)
    if not ns.json:
        print(f"peak RSS {rows[-1].peak_rss_mib:.0f} MiB")
    return 0
