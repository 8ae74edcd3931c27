"""CUDA graphs for decode-only steps: the model's forward captured once per batch size and
replayed, so a decode step costs one graph launch instead of ~20 kernel launches per layer.

A decode-only step (every sequence contributes one token; :attr:`StepBatch.is_decode_only`) is
padded up to the next captured size (1, 2, 4, 8, then multiples of 16 up to ``max_num_seqs``).
Its inputs are copied into static buffers — token ids, positions, and the paged KV's
:class:`monobatch.kv.paged.DecodeStep` (slot mapping, block tables, lengths) — and the graph
replays the same forward code the eager path runs; only attention differs: it reads the pool
through the block tables in a kernel (:mod:`monobatch.kernels.paged_decode`) instead of a
host-planned gather. Padding rows write their K/V to a scratch block and their logits are
dropped. Graphs are captured lazily, on a size's first use; a size whose capture fails (out of
memory, a kernel that does not build) is logged once and runs the same static-buffer forward
eagerly from then on.

The page-locked host buffers are rewritten each step while the previous step's copies from them
may still be queued: an event recorded after the copies is waited on before the next rewrite.

Used on CUDA with paged storage in the default (fast) mode, when the paged-decode kernel is
usable; ``EngineConfig.cuda_graphs=False`` (``--enforce-eager``) turns it off. The same class
runs eagerly (``capture=False``) so CPU tests check the static-buffer path bit for bit.
"""

from __future__ import annotations

import logging

import torch

from monobatch.engine.batch import StepBatch
from monobatch.kv.paged import DecodeStep, PagedKv
from monobatch.models.llama import LlamaModel

log = logging.getLogger(__name__)


def capture_sizes(max_batch: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then every multiple of 16 up to ``max_batch``
    (vLLM's ladder, shortened), always including ``max_batch``."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch] + list(range(16, max_batch + 1, 16))
    return sorted(set(sizes + [max_batch]))


class DecodeGraphs:
    """Static-buffer decode forward, captured as one CUDA graph per padded batch size.

    Args:
        model: the decoder (its forward runs unchanged inside the graph).
        kv: the paged KV store (decode attention from :class:`DecodeStep` tensors).
        max_batch: the largest batch handled (``max_num_seqs``); larger steps run eagerly.
        capture: False runs the same static-buffer forward without a graph (CPU, tests).
    """

    def __init__(self, model: LlamaModel, kv: PagedKv, max_batch: int, capture: bool = True) -> None:
        self.model, self.kv = model, kv
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.capture = capture
        device = model.device
        n, blocks = self.max_batch, kv.max_blocks_per_seq
        self.token_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.logit_rows = torch.arange(n, dtype=torch.int64, device=device)
        self.step = DecodeStep.empty(n, blocks, device)
        self.host = DecodeStep.empty(n, blocks, "cpu", pin=device.type == "cuda")
        self.host_ids = torch.zeros(2, n, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor] | None] = {}  # None: capture failed
        self.pool = None  # the graphs' shared memory pool (torch.cuda.graph_pool_handle)
        self.copied = torch.cuda.Event() if device.type == "cuda" else None  # host buffers free again
        self.replays = 0

    def handles(self, batch: StepBatch) -> bool:
        """True when ``batch`` is decode-only and fits the largest size."""
        return batch.is_decode_only and 0 < len(batch.chunks) <= self.max_batch

    def padded(self, n: int) -> int:
        """The captured size a batch of ``n`` rows runs at."""
        return next(s for s in self.sizes if s >= n)

    def _static_batch(self, size: int) -> StepBatch:
        """A StepBatch whose tensors are views of the static buffers (``size`` rows)."""
        return StepBatch(token_ids=self.token_ids[:size], positions=self.positions[:size],
                         seq_ids=torch.zeros(size, dtype=torch.int64), logit_rows=self.logit_rows[:size], chunks=())

    def _graph(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor] | None:
        """Capture the forward at ``size`` rows (after two warm-up runs on a side stream, which
        also settle lazy initialisation such as cuBLAS workspaces and Triton compilation).
        Returns None, logging why, when the capture fails."""
        calls = self.kv.paged_attention_calls  # warm-up and capture are not steps
        try:
            return self._capture(size)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
            log.warning("CUDA graph capture at batch size %d failed (%s); that size runs eagerly", size, e)
            return None
        finally:
            self.kv.paged_attention_calls = calls

    def _capture(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        batch = self._static_batch(size)
        step = self.step.rows(size)
        # Warm-up and capture run on padding only: every row writes the scratch block.
        step.slot_mapping.fill_(self.kv.scratch_block * self.kv.block_size)
        step.block_tables.fill_(self.kv.scratch_block)
        step.seq_lens.fill_(1)
        self.kv.bind_decode(step)
        stream = torch.cuda.Stream(device=self.model.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.model(batch, self.kv)
        torch.cuda.current_stream().wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.model(batch, self.kv)
        return graph, logits

    @torch.inference_mode()
    def forward(self, batch: StepBatch, token_ids: torch.Tensor | None = None, commit: bool = True) -> torch.Tensor:
        """Run a decode-only ``batch`` (see :meth:`handles`), caching its KV.

        Args:
            batch: the step.
            token_ids: ``[n]`` int64 device tensor of the input tokens, overriding the chunks'
                (async scheduling: the previous step's draws, never seen by the host).
            commit: advance the KV store (:meth:`KvStore.commit`) now; False leaves it to the
                caller once the input ids are known.

        Returns:
            ``[R, V]`` float32 logits, one row per chunk. With graphs this is a view of a static
            buffer, overwritten by the next replay: consume it within the step.

        Raises:
            ValueError, InsufficientMemoryError: as :meth:`PagedKv.prepare_decode`.
        """
        n = len(batch.chunks)
        size = self.padded(n)
        if self.copied is not None:
            self.copied.synchronize()  # the last step's copies from the host buffers are done
        ids = self.host_ids[:, :size]
        ids.zero_()
        ids[0, :n] = torch.as_tensor([c.token_ids[0] for c in batch.chunks])
        ids[1, :n] = torch.as_tensor([c.pos for c in batch.chunks])
        self.kv.prepare_decode(batch, self.host.rows(size), self.step.rows(size))
        self.token_ids[:size].copy_(ids[0], non_blocking=True)
        self.positions[:size].copy_(ids[1], non_blocking=True)
        if self.copied is not None:
            self.copied.record()
        if token_ids is not None:
            self.token_ids[:n].copy_(token_ids)
        if self.capture and size not in self.graphs:
            self.graphs[size] = self._graph(size)
            self.kv.prepare_decode(batch, self.host.rows(size), self.step.rows(size))  # capture clobbered them
        captured = self.graphs.get(size) if self.capture else None
        if captured is None:
            logits = self.model(self._static_batch(size), self.kv)
        else:
            graph, logits = captured
            graph.replay()
            self.kv.paged_attention_calls += len(self.model.layers)  # the replay's attend calls
        if commit:
            self.kv.commit(batch)
        self.replays += 1
        return logits[:n]
