"""Tensor parallelism over ``torch.distributed``: one engine across several devices of one host.

Megatron-style sharding (Shoeybi et al. 2019, "Megatron-LM"): attention heads and their KV cache
split across ranks, column-parallel q/k/v and gate/up, row-parallel o and down with one
all-reduce each, vocabulary-parallel embedding and LM head. The driver rank (the engine's own
process) runs the one scheduler, sampler and finish step; worker ranks, spawned by the engine,
run only the model forward on each step's batch (ADR 0007).

- :mod:`.plan`: :class:`TensorParallelPlan`, which rank owns which heads, FFN columns and
  vocabulary rows (in fixed *pieces*, one per KV head), and the size checks.
- :mod:`.comm`: :class:`TpGroup`, the process group (gloo on CPU, NCCL on CUDA) and the
  collectives the layers call, with timeouts.
- :mod:`.sharding`: the parallel layers and :func:`shard_model`, dense and packed weights alike.
- :mod:`.runtime`: :class:`TensorParallelDriver` (spawns the ranks, mirrors the KV store's
  calls, runs a step) and the worker loop.
"""

from monobatch.distributed.plan import TensorParallelPlan

__all__ = ["TensorParallelPlan"]
