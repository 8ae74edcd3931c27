"""In-process A/B of decode-step settings on the GPU: one CUDA graph of the B=1 decode forward
(plus the greedy argmax) captured per setting, replayed in interleaved rounds, so slow drift of
the machine (clocks, neighbours) hits every arm alike. Settings are module constants read when a
kernel is launched (hence when the graph is captured), e.g. ``monobatch.kernels.pdl.ON=False``,
or entries of a dict, e.g. a GEMV config:
``monobatch.kernels.gemv.PDL_CONFIGS[(2048,2048,1,'bfloat16')]=(4,2048,1,8,1,False)``.

    PYTHONPATH=src python3 scripts/ab_graphs.py --shape llama-1b -p 256 \
        --arm base= --arm nopdl=monobatch.kernels.pdl.ON=False

Prints one JSON object: per arm the median and min over rounds of the GPU time of one replay
(ms), and its ratio to the first arm.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import statistics

import torch

from monobatch.engine.engine import Engine, EngineConfig
from monobatch.engine.params import SamplingParams
from monobatch.engine.scheduler import BatchScheduler
from monobatch.engine.sequence import Request
from monobatch.kernels.argmax import argmax
from monobatch.loader.dummy import dummy_model


_MISSING = object()


def _slot(target: str) -> tuple[object, object]:
    """``MODULE.NAME`` -> (module, name); ``MODULE.NAME[KEY]`` -> (that dict, KEY)."""
    key = None
    if target.endswith("]"):
        target, key = target[:-1].split("[", 1)
    module, name = target.rsplit(".", 1)
    mod = importlib.import_module(module)
    return (mod, name) if key is None else (getattr(mod, name), ast.literal_eval(key))


def _apply(setting: str) -> list:
    """Set each ``MODULE.NAME=VALUE`` or ``MODULE.DICT[KEY]=VALUE`` (space-separated; VALUE and
    KEY Python literals without spaces) and return what :func:`_restore` needs."""
    old = []
    for item in setting.split():
        target, value = item.split("=", 1)
        obj, name = _slot(target)
        if isinstance(obj, dict):
            old.append((obj, name, obj.get(name, _MISSING)))
            obj[name] = ast.literal_eval(value)
        else:
            old.append((obj, name, getattr(obj, name)))
            setattr(obj, name, ast.literal_eval(value))
    return old


def _restore(old: list) -> None:
    for obj, name, value in reversed(old):
        if not isinstance(obj, dict):
            setattr(obj, name, value)
        elif value is _MISSING:
            del obj[name]
        else:
            obj[name] = value


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama-1b")
    ap.add_argument("-p", type=int, default=256, help="context length (prompt tokens)")
    ap.add_argument("--arm", action="append", required=True, metavar="NAME=SETTINGS",
                    help="NAME=MODULE.NAME=VALUE [MODULE.NAME=VALUE ...] (empty: the defaults)")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--replays", type=int, default=50, help="replays timed together per round and arm")
    ns = ap.parse_args()
    arms = [a.split("=", 1) if "=" in a else (a, "") for a in ns.arm]
    engine = Engine(dummy_model(ns.shape, "cuda"), EngineConfig(cuda_graphs=True))
    sched = BatchScheduler(engine)
    sched.add_request(Request("r", list(range(1, ns.p + 1)), SamplingParams(max_tokens=64, temperature=0.0,
                                                                             ignore_eos=True), bypass_prefix_cache=True))
    graphs = engine.graphs
    while graphs.replays < 3:  # prefill (chunks), then decode steps: the static buffers hold a real B=1 step
        sched.step()
    model, kv = graphs.model, graphs.kv
    batch = graphs._static_batch(1)
    torch.cuda.synchronize()
    kv.bind_decode(graphs.step.rows(1))  # the last step's slot, block table and length, as it stands
    captured = {}
    with torch.inference_mode():
        for name, setting in arms:
            old = _apply(setting)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):  # compile and warm up under this setting
                    argmax(model(batch, kv))
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=graphs.pool):
                argmax(model(batch, kv))
            captured[name] = graph
            _restore(old)
        times: dict[str, list[float]] = {name: [] for name, _ in arms}
        for r in range(ns.rounds):
            order = arms if r % 2 == 0 else arms[::-1]
            for name, _ in order:
                graph = captured[name]
                graph.replay()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(ns.replays):
                    graph.replay()
                end.record()
                end.synchronize()
                times[name].append(start.elapsed_time(end) / ns.replays)
    base = statistics.median(times[arms[0][0]])
    print(json.dumps({"shape": ns.shape, "context": ns.p, "rounds": ns.rounds, "replays": ns.replays, "arms": {
        name: {"setting": setting, "median_ms": round(statistics.median(times[name]), 4),
               "min_ms": round(min(times[name]), 4), "ratio": round(statistics.median(times[name]) / base, 4)}
        for name, setting in arms}}))


if __name__ == "__main__":
    main()
