"""`monobatch bench`: engine-direct B=1 prefill and decode speed, TTFT, load time and peak RSS;
with ``-b N``, N concurrent requests against the same N run one after another.

On the bundled model by default, or random weights of a named shape with
``--dummy-weights --shape NAME`` (no download). ``--json`` prints one JSON object.
"""

from __future__ import annotations

import argparse
import json

from monobatch.cli.args import add_model_args, engine_settings
from monobatch.errors import InvalidRequestError


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register ``monobatch bench`` and its flags."""
    from monobatch.models.shapes import SHAPES

    p = sub.add_parser("bench", help="measure B=1 prefill/decode speed through the engine", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-p", "--prompt-tokens", type=int, default=256, help="prompt length in tokens (default 256)")
    p.add_argument("-n", "--gen-tokens", type=int, default=128, help="generated tokens, EOS ignored (default 128)")
    p.add_argument("-r", "--runs", type=int, default=3, help="timed runs after one warm-up (default 3)")
    p.add_argument("-b", "--concurrency", type=int, default=0,
                   help="also run N requests at once and the same N one after another (default 0: skip)")
    p.add_argument("--dummy-weights", action="store_true", help="random weights of --shape instead of a checkpoint")
    p.add_argument("--shape", help=f"with --dummy-weights: {', '.join(SHAPES)} (default smollm2-135m)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_model_args(p)
    p.set_defaults(func=run)


def run(ns: argparse.Namespace) -> int:
    """Load, warm up, time, print. Returns the exit code."""
    from monobatch.bench import bench
    from monobatch.cli.args import open_engine
    from monobatch.loader.dummy import dummy_model

    for name in ("prompt_tokens", "gen_tokens", "runs"):
        if getattr(ns, name) < 1:
            raise InvalidRequestError(f"--{name.replace('_', '-')} must be >= 1", name)
    if ns.shape is not None and not ns.dummy_weights:
        raise InvalidRequestError("--shape needs --dummy-weights (a checkpoint has its own shape)", "shape")
    engine_settings(ns)  # refuse bad flags before building weights
    scheduler = open_engine(ns, dummy_model(ns.shape or "smollm2-135m", ns.device, ns.dtype) if ns.dummy_weights else None)
    need = ns.prompt_tokens + ns.gen_tokens
    if need > scheduler.engine.max_model_len:
        raise InvalidRequestError(f"prompt + generated tokens ({need}) exceed the context ({scheduler.engine.max_model_len})")
    if ns.concurrency < 0:
        raise InvalidRequestError("--concurrency must be >= 0", "concurrency")
    result = bench(scheduler, ns.prompt_tokens, ns.gen_tokens, ns.runs, concurrency=ns.concurrency)
    print(json.dumps(result.to_dict()) if ns.json else result.table())
    return 0
