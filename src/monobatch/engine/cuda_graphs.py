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

The step's inputs are staged in one page-locked host buffer (:class:`DecodeInputs`) and copied
to the device in one memcpy. The host buffer is rewritten each step (a row's block tables only
when its sequence's tables changed: :meth:`PagedKv.prepare_decode`) while the previous step's
copy from it may still be queued: an event recorded after the copy is waited on before the next
rewrite.

Used on CUDA with paged storage in the default (fast) mode, when the paged-decode kernel is
usable; ``EngineConfig.cuda_graphs=False`` (``--enforce-eager``) turns it off. The same class
runs eagerly (``capture=False``) so CPU tests check the static-buffer path bit for bit.
"""

from __future__ import annotations

import logging

import torch

from monobatch.batch import StepBatch
from monobatch.kernels.varlen_attention import tokens_per_tile
from monobatch.kv.paged import DecodeStep, PagedKv, PrefillStep
from monobatch.models.layers import DecoderModel

log = logging.getLogger(__name__)


class DecodeInputs:
    """Every input of a decode-only step in one flat buffer, so that staging them on the host and
    copying them to the device is one memcpy (five small copies cost ~15 µs of GPU time a step).

    Layout for ``rows`` rows of ``blocks`` blocks in ``groups`` layer groups (1 without sliding
    windows; :class:`~monobatch.kv.paged.DecodeStep`), as typed views of one uint8 buffer::

        int64: token_ids [rows] | positions [rows] | slot_mapping [groups, rows]
        int32: seq_lens [rows] | step positions [rows] | (padding to 16 bytes) | block_tables [rows, groups, blocks]

    so the first ``size`` rows of everything lie in the first :meth:`nbytes` ``(size)`` bytes.

    Attributes:
        token_ids, positions: ``[rows]`` int64.
        step: the :class:`DecodeStep` views (slot mapping, block tables, lengths, the int32
            positions of the deterministic layout).
    """

    def __init__(self, rows: int, blocks: int, device: torch.device | str, pin: bool = False, groups: int = 1) -> None:
        words_end = (2 + groups) * rows * 8
        self._head = -(-(words_end + rows * 8) // 16) * 16  # bytes before the block tables (16-aligned)
        self._row_bytes = groups * blocks * 4
        self.buf = torch.zeros(self._head + rows * self._row_bytes, dtype=torch.uint8, device=device, pin_memory=pin)
        words = self.buf[:words_end].view(torch.int64)
        self.token_ids, self.positions = words[:rows], words[rows:2 * rows]
        slot_mapping = words[2 * rows:].view(groups, rows)
        seq_lens = self.buf[words_end:words_end + rows * 4].view(torch.int32)
        step_positions = self.buf[words_end + rows * 4:words_end + rows * 8].view(torch.int32)  # DecodeStep.positions
        block_tables = self.buf[self._head:].view(torch.int32).view(rows, groups, blocks)
        # a host buffer tracks which sequence's tables each row holds (rewritten only on a change)
        self.step = DecodeStep(slot_mapping, block_tables, seq_lens, step_positions,
                               {} if self.buf.device.type == "cpu" else None)
        seq_lens.fill_(1)

    def nbytes(self, size: int) -> int:
        """Bytes holding the first ``size`` rows of every input."""
        return self._head + size * self._row_bytes

    def copy_from(self, src: "DecodeInputs", size: int) -> None:
        """Copy the first ``size`` rows of ``src`` (same layout) here: one asynchronous copy
        (page-locked ``src``: the host buffer may not be rewritten until it has run)."""
        end = self.nbytes(size)
        self.buf[:end].copy_(src.buf[:end], non_blocking=True)


def capture_sizes(max_batch: int) -> list[int]:
    """Batch sizes that get a graph: 1, 2, 4, 8, then every multiple of 16 up to ``max_batch``
    (vLLM's ladder, shortened), always including ``max_batch``."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_batch] + list(range(16, max_batch + 1, 16))
    return sorted(set(sizes + [max_batch]))


class _StaticGraphs:
    """What the decode and prefill graphs share: capturing the model's forward over a store bound
    to static tensors, and running a step from them (replayed, or eagerly without a graph).

    Attributes:
        pool: the graphs' shared memory pool (torch.cuda.graph_pool_handle), made at the first capture.
        rope_tables: the RoPE tables the graphs read, kept alive while they exist (another Engine
            on the same model may replace the model's, for a longer context).
    """

    def __init__(self, model: DecoderModel, kv: PagedKv) -> None:
        self.model, self.kv = model, kv
        self.pool = None
        self.rope_tables: list[torch.Tensor] = []

    def _capture_forward(self, batch: StepBatch, bind) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Two warm-up runs of ``model(batch, kv)`` on a side stream (they settle lazy
        initialisation: cuBLAS workspaces, Triton compilation, the split counters), then its
        capture. ``bind()`` binds the store to the static step before each: whatever the store
        derives from the step's tensors (the varlen layout of deterministic mode) is then derived
        inside the graph, so every replay recomputes it from the values copied in, not from the
        warm-up's padding."""
        bind()
        stream = torch.cuda.Stream(device=self.model.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self.model(batch, self.kv)
        torch.cuda.current_stream().wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        for table in (rope.table for rope in self.model.ropes):
            if table is not None and not any(t is table for t in self.rope_tables):
                self.rope_tables.append(table)
        graph = torch.cuda.CUDAGraph()
        bind()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.model(batch, self.kv)
        return graph, logits

    def _run(self, captured: tuple[torch.cuda.CUDAGraph, torch.Tensor] | None, static: StepBatch,
             batch: StepBatch, commit: bool) -> torch.Tensor:
        """The step's logits from the static buffers: the graph's replay, or the forward run
        eagerly on ``static`` without one; then the store's commit of ``batch`` if asked."""
        if captured is None:
            logits = self.model(static, self.kv)
        else:
            graph, logits = captured
            graph.replay()
            self.kv.paged_attention_calls += len(self.model.layers)  # the replay's attend calls
        if commit:
            self.kv.commit(batch)
        return logits


class DecodeGraphs(_StaticGraphs):
    """Static-buffer decode forward, captured as one CUDA graph per padded batch size.

    Args:
        model: the decoder (its forward runs unchanged inside the graph).
        kv: the paged KV store (decode attention from :class:`DecodeStep` tensors).
        max_batch: the largest batch handled (``max_num_seqs``); larger steps run eagerly.
        capture: False runs the same static-buffer forward without a graph (CPU, tests).
    """

    def __init__(self, model: DecoderModel, kv: PagedKv, max_batch: int, capture: bool = True) -> None:
        super().__init__(model, kv)
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.capture = capture
        device = model.device
        n, blocks = self.max_batch, kv.max_blocks_per_seq
        groups = len(kv.groups)  # layer groups: one block table per group (sliding windows, ADR 0005)
        self.inputs = DecodeInputs(n, blocks, device, groups=groups)  # what the graphs read
        self.host = DecodeInputs(n, blocks, "cpu", pin=device.type == "cuda", groups=groups)  # staged here, one copy a step
        self.token_ids, self.positions, self.step = self.inputs.token_ids, self.inputs.positions, self.inputs.step
        self.logit_rows = torch.arange(n, dtype=torch.int64, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor] | None] = {}  # None: capture failed
        self._rows: dict[int, tuple[DecodeStep, DecodeStep]] = {}  # size -> (host, device) views, see _views
        self._batches: dict[int, StepBatch] = {}  # size -> _static_batch
        self.copied = torch.cuda.Event() if device.type == "cuda" else None  # host buffers free again
        self.replays = 0

    def handles(self, batch: StepBatch) -> bool:
        """True when ``batch`` is decode-only and fits the largest size."""
        return batch.is_decode_only and 0 < len(batch.chunks) <= self.max_batch

    def padded(self, n: int) -> int:
        """The captured size a batch of ``n`` rows runs at."""
        return next(s for s in self.sizes if s >= n)

    def _views(self, size: int) -> tuple[DecodeStep, DecodeStep]:
        """The first ``size`` rows of the host and device :class:`DecodeStep` (views of the static
        buffers, made once a size: three tensor slices cost ~6 us, twice a step)."""
        views = self._rows.get(size)
        if views is None:
            views = self._rows[size] = (self.host.step.rows(size), self.step.rows(size))
        return views

    def _static_batch(self, size: int) -> StepBatch:
        """A StepBatch whose tensors are views of the static buffers (``size`` rows), made once a
        size (~11 us of slices and a zeros tensor, a step)."""
        batch = self._batches.get(size)
        if batch is None:
            batch = self._batches[size] = StepBatch(
                token_ids=self.token_ids[:size], positions=self.positions[:size],
                seq_ids=torch.zeros(size, dtype=torch.int64), logit_rows=self.logit_rows[:size], chunks=(),
                position_bound=self.kv.max_seq_len)  # prepare_decode checks each row's position
        return batch

    def capture_all(self) -> None:
        """Capture every size now (a server's start-up, as vLLM does): a lazy capture costs the
        first step of its size ~0.1 s, which a burst of new requests would see as TTFT."""
        for size in self.sizes:
            if size not in self.graphs:
                self.graphs[size] = self._graph(size)

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
            self.kv.unbind()  # no static step left bound: a forgotten prepare() fails loudly

    def _capture(self, size: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        batch = self._static_batch(size)
        step = self.step.rows(size)
        # Warm-up and capture run on padding only: every row writes the scratch block.
        step.slot_mapping.fill_(self.kv.scratch_block * self.kv.block_size)
        step.block_tables.fill_(self.kv.scratch_block)
        step.seq_lens.fill_(1)
        step.positions.zero_()
        return self._capture_forward(batch, lambda: self.kv.bind_decode(step))

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
            self.copied.synchronize()  # the last step's copy from the host buffer is done
        host = self.host
        # the batch's own [n] tensors (on the host: Engine.build_batch), not its chunks again
        host.token_ids[:n].copy_(batch.token_ids)
        host.positions[:n].copy_(batch.positions)
        if n < size:  # padding rows
            host.token_ids[n:size] = 0
            host.positions[n:size] = 0
        host_rows, device_rows = self._views(size)
        self.kv.prepare_decode(batch, host_rows, device_rows)
        if self.capture and size not in self.graphs:
            self.graphs[size] = self._graph(size)  # on padding values, overwritten by the copy below
            self.kv.bind_decode(device_rows)
        self.inputs.copy_from(host, size)
        if self.copied is not None:
            self.copied.record()
        if token_ids is not None:
            self.token_ids[:n].copy_(token_ids)
        logits = self._run(self.graphs.get(size) if self.capture else None, self._static_batch(size), batch, commit)
        self.replays += 1
        return logits[:n]


#: Token rows a prefill graph may hold (its buckets: powers of two from 16 up to this), and the
#: chunks of one step (buckets 1, 2, 4, 8): a short prompt's step, alone or beside a few others.
#: Longer steps are GEMM-bound and gain nothing from a graph.
PREFILL_MAX_TOKENS = 512
PREFILL_MAX_CHUNKS = 8


class PrefillInputs:
    """Every input of a prefill graph's step (``rows`` token rows, ``chunks`` chunks, ``tiles``
    tiles, ``blocks`` blocks per table, ``groups`` layer groups) in one flat buffer, so staging
    them on the host and copying them to the device is one memcpy::

        int64: token_ids [rows] | positions [rows] | logit_rows [chunks] | write [groups, rows]
        int32: chunk rows [3, chunks + 1] | tiles [2, tiles] | block_tables [chunks + 1, groups, blocks]

    Attributes:
        token_ids, positions: ``[rows]`` int64; logit_rows: ``[chunks]`` int64.
        step: the :class:`PrefillStep` views.
    """

    def __init__(self, rows: int, chunks: int, tiles: int, blocks: int, groups: int, bt: int,
                 device: torch.device | str, pin: bool = False) -> None:
        words = 2 * rows + chunks + groups * rows
        ints = 3 * (chunks + 1) + 2 * tiles + (chunks + 1) * groups * blocks
        self.buf = torch.zeros(words * 8 + ints * 4, dtype=torch.uint8, device=device, pin_memory=pin)
        w = self.buf[:words * 8].view(torch.int64)
        self.token_ids, self.positions = w[:rows], w[rows:2 * rows]
        self.logit_rows = w[2 * rows:2 * rows + chunks]
        write = w[2 * rows + chunks:].view(groups, rows)
        i = self.buf[words * 8:].view(torch.int32)
        meta = i[:3 * (chunks + 1)].view(3, chunks + 1)
        order = i[3 * (chunks + 1):3 * (chunks + 1) + 2 * tiles].view(2, tiles)
        tables = i[3 * (chunks + 1) + 2 * tiles:].view(chunks + 1, groups, blocks)
        self.step = PrefillStep(write, tables, meta, order, bt)

    def copy_from(self, src: "PrefillInputs") -> None:
        """One asynchronous copy of ``src`` (same layout; page-locked: not to be rewritten until
        the copy has run)."""
        self.buf.copy_(src.buf, non_blocking=True)


class PrefillGraphs(_StaticGraphs):
    """Short prompt steps (at most :data:`PREFILL_MAX_TOKENS` tokens in at most
    :data:`PREFILL_MAX_CHUNKS` chunks, no prompt logprobs) captured as CUDA graphs, one per
    (token bucket, chunk bucket), so such a step costs one graph launch instead of ~165 kernel
    launches of ~30-45 µs host time each (a 256-token llama-1b prefill was 7 ms of host launches
    for 2 ms of kernels on the H200) — vLLM captures graphs by token count for the same reason
    (piecewise there, attention outside; whole here, the varlen attention reading static tensors). Attention runs :func:`~monobatch.kernels.varlen_attention.varlen_paged_attention`
    from static tensors (:class:`~monobatch.kv.paged.PrefillStep`); padding rows write the
    scratch block, padding tiles point to an empty chunk. The same forward code runs inside the
    graph; ``capture=False`` runs it eagerly on the static buffers (tests).

    Args:
        model: the decoder. kv: the paged store (its varlen kernel usable; the tiles of
            deterministic mode when ``kv.batch_invariant``).
        capture: False runs the static-buffer forward without a graph.
    """

    def __init__(self, model: DecoderModel, kv: PagedKv, capture: bool = True) -> None:
        super().__init__(model, kv)
        self.capture = capture
        args = model.args
        self.bt = tokens_per_tile(args.num_attention_heads, args.num_key_value_heads, kv.batch_invariant)
        self.inputs: dict[tuple[int, int], tuple[PrefillInputs, PrefillInputs]] = {}  # (host, device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor] | None] = {}
        self.copied = torch.cuda.Event() if model.device.type == "cuda" else None
        self.replays = 0

    @staticmethod
    def bucket(tokens: int, chunks: int) -> tuple[int, int]:
        """The (rows, chunks) sizes a step of ``tokens`` tokens in ``chunks`` chunks runs at."""
        return max(16, 1 << (tokens - 1).bit_length()), 1 << max(0, chunks - 1).bit_length()

    def sizes(self) -> list[tuple[int, int]]:
        """Every bucket."""
        rows = [1 << k for k in range(4, PREFILL_MAX_TOKENS.bit_length()) if 1 << k <= PREFILL_MAX_TOKENS]
        return [(r, c) for r in rows for c in (1, 2, 4, 8) if c <= PREFILL_MAX_CHUNKS]

    def handles(self, batch: StepBatch) -> bool:
        """True for a step with prompt chunks that fits the largest bucket (decode-only steps are
        :class:`DecodeGraphs`')."""
        chunks = batch.chunks
        return (0 < len(chunks) <= PREFILL_MAX_CHUNKS and batch.num_tokens <= PREFILL_MAX_TOKENS
                and not batch.is_decode_only and not batch.row_tile
                and not any(c.all_logits for c in chunks))

    def _buffers(self, size: tuple[int, int]) -> tuple[PrefillInputs, PrefillInputs]:
        if size not in self.inputs:
            rows, chunks = size
            tiles = rows // self.bt + chunks  # each chunk adds at most one partial tile
            shape = (rows, chunks, tiles, self.kv.max_blocks_per_seq, len(self.kv.groups), self.bt)
            cuda = self.model.device.type == "cuda"
            self.inputs[size] = (PrefillInputs(*shape, "cpu", pin=cuda), PrefillInputs(*shape, self.model.device))
        return self.inputs[size]

    def _static_batch(self, dev: PrefillInputs) -> StepBatch:
        rows = dev.token_ids.shape[0]
        return StepBatch(token_ids=dev.token_ids, positions=dev.positions, seq_ids=torch.zeros(rows, dtype=torch.int64),
                         logit_rows=dev.logit_rows, chunks=(), position_bound=self.kv.max_seq_len)

    def capture_all(self) -> None:
        """Capture every bucket now (a server's start-up)."""
        for size in self.sizes():
            if size not in self.graphs:
                self.graphs[size] = self._graph(size)

    def _graph(self, size: tuple[int, int]) -> tuple[torch.cuda.CUDAGraph, torch.Tensor] | None:
        """Capture the forward at ``size`` on padding (two warm-up runs first); None, logged,
        when the capture fails."""
        calls = self.kv.paged_attention_calls
        try:
            host, dev = self._buffers(size)
            step = dev.step
            step.write.fill_(self.kv.scratch_block * self.kv.block_size)
            step.chunks.zero_()
            step.tiles[0].fill_(step.chunks.shape[1] - 1)
            step.tiles[1].zero_()
            return self._capture_forward(self._static_batch(dev), lambda: self.kv.bind_prefill(step))
        except (RuntimeError, torch.cuda.OutOfMemoryError) as e:
            log.warning("CUDA graph capture of a %d-token, %d-chunk prefill step failed (%s); it runs eagerly",
                        size[0], size[1], e)
            return None
        finally:
            self.kv.paged_attention_calls = calls
            self.kv.unbind()  # no static step left bound: a forgotten prepare() fails loudly

    @torch.inference_mode()
    def forward(self, batch: StepBatch, token_ids: torch.Tensor | None = None, commit: bool = True) -> torch.Tensor:
        """Run ``batch`` (see :meth:`handles`) from the static buffers of its bucket, caching its KV.

        Args / Returns / Raises: as :meth:`DecodeGraphs.forward` (``token_ids``: ``[T]`` on the
        device; the logits: ``[R, V]`` float32, a view of a static buffer with graphs).
        """
        T, R = batch.num_tokens, batch.logit_rows.shape[0]
        size = self.bucket(T, len(batch.chunks))
        host, dev = self._buffers(size)
        if self.copied is not None:
            self.copied.synchronize()  # the last step's copy from a host buffer is done
        host.token_ids.zero_()
        host.positions.zero_()
        host.logit_rows.zero_()
        host.token_ids[:T].copy_(batch.token_ids)
        host.positions[:T].copy_(batch.positions)
        host.logit_rows[:R].copy_(batch.logit_rows)
        self.kv.prepare_prefill(batch, host.step, dev.step)
        if self.capture and size not in self.graphs:
            self.graphs[size] = self._graph(size)  # on padding values, overwritten by the copy below
            self.kv.bind_prefill(dev.step)
        dev.copy_from(host)
        if self.copied is not None:
            self.copied.record()
        if token_ids is not None:
            dev.token_ids[:T].copy_(token_ids)
        logits = self._run(self.graphs.get(size) if self.capture else None, self._static_batch(dev), batch, commit)
        self.replays += 1
        return logits[:R]
