"""Engine: one step of the model — forward, sample, finish — over a planned StepBatch.

The engine knows nothing of HTTP, the CLI or queues; its inputs are token ids. The one decode
loop that drives it is :class:`monobatch.engine.scheduler.BatchScheduler`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
from dataclasses import dataclass

import torch

from monobatch import defaults, env
from monobatch.batch import StepBatch
from monobatch.distributed import comm
from monobatch.distributed.plan import TensorParallelPlan, check_devices
from monobatch.engine import cuda_graphs
from monobatch.engine.constraint import GrammarCompiler
from monobatch.engine.cuda_graphs import DecodeGraphs, PrefillGraphs
from monobatch.engine.finish import FinishStep, RowOutput
from monobatch.engine.params import SamplingParams
from monobatch.engine.sampler import RowSampler, SampleOutput, SamplerState, ids_on, token_logprobs
from monobatch.engine.sequence import Sequence
from monobatch.errors import InsufficientMemoryError, InvalidRequestError
from monobatch.kernels import invariant_gemm
from monobatch.kernels.paged_decode import triton_usable
from monobatch.kv.block_manager import blocks_per_sequence, layer_groups
from monobatch.kv.dense import DenseKv
from monobatch.kv.paged import PagedKv
from monobatch.kv.store import KvStore
from monobatch.loader import LoadedModel
from monobatch.loader.weights import trim_heap
from monobatch.quant.packed import GEMV_ROWS, dequant_scratch_bytes

#: Redraw unchecked draws at forced grammar positions before the next step reads them
#: (:meth:`Engine.draw_forced`); ``MONOBATCH_FORCED_DRAWS=0`` turns it off for A/B runs.
FORCED_DRAWS = env.flag("MONOBATCH_FORCED_DRAWS", True)


def _to_host(ids: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
    """Queue the copy of ``[k]`` int64 device ids to the host: ``(host tensor, its CUDA event)``;
    on CUDA the host tensor is page-locked and valid once the event is done (nothing waits here),
    on CPU it is a copy already (event None). Runs on the current stream and device."""
    cuda = ids.is_cuda
    host = torch.empty(ids.shape, dtype=torch.int64, pin_memory=cuda)
    host.copy_(ids, non_blocking=cuda)
    ready = None
    if cuda:
        ready = torch.cuda.Event()
        ready.record()
    return host, ready


@dataclass(slots=True)
class PendingStep:
    """A step launched on the device whose draws the host has not read yet (async scheduling).

    Attributes:
        batch: the step.
        rows: the R sequences that drew a token, in row order.
        tokens: ``[R]`` int64 draws on the device (the next step's input ids).
        host: ``[R]`` int64 copy on the host (page-locked on CUDA), valid once ``ready`` is done;
            None until :meth:`Engine.draw_forced` queues it for an unchecked step with grammar rows.
        ready: CUDA event recorded after the copy (None on CPU: the copy is synchronous).
        logits: ``[R, V]`` on the device while the draw is deferred (``tokens``/``host`` None):
            constrained rows, whose masks need the previous step's tokens accepted first.
        check: an unchecked draw's grammar rows (:attr:`SamplerState.greedy_checked`): their row
            indices and their ``[M, V]`` float32 raw logits (a copy where the step's own logits
            are a CUDA graph's static buffer, overwritten by the next step), so
            :meth:`Engine.resolve` can check each raw argmax against its grammar and redraw a
            refused one.
        void: rows whose draw is void: their input id was a refused draw of the step before
            (its replacement is ``seq.output_ids[-1]``); :meth:`Engine.resolve` skips them.
        corrected: rows whose draw :meth:`Engine.resolve` replaced (a refused unchecked draw):
            a step launched on this step's device draws computed those rows from a wrong id.
        forced: rows of an unchecked draw redrawn at a forced grammar position before the next
            step reads ``tokens`` (:meth:`Engine.draw_forced`), in ascending order. Their redraws
            are in ``tokens`` and in its host copy, which for such a step is queued after them.
    """

    batch: StepBatch
    rows: list[Sequence]
    tokens: torch.Tensor | None
    host: torch.Tensor | None
    ready: torch.cuda.Event | None
    logits: torch.Tensor | None = None  # a deferred draw's input until :meth:`Engine.draw_deferred`
    check: tuple[list[int], torch.Tensor] | None = None
    void: set[int] = dataclasses.field(default_factory=set)
    corrected: list[int] = dataclasses.field(default_factory=list)
    forced: list[int] | None = None


@dataclass(slots=True)
class EngineConfig:
    """Engine settings (CLI flags / server options map onto these; defaults from
    :mod:`monobatch.defaults`).

    Attributes:
        max_model_len: context length in tokens (None = the model's).
        max_num_seqs: sequences running at once.
        prefill_chunk: prompt tokens of one sequence computed per step.
        max_num_batched_tokens: tokens per step across all sequences (None: prefill_chunk, or
            ``defaults.STEP_TOKEN_BUDGET`` for the device where larger, raised to max_num_seqs so
            every running decode fits; :meth:`token_budget`).
        kv_storage: ``paged`` (block pool + prefix cache) or ``dense`` (a buffer per sequence).
        kv_cache_memory: paged pool size in bytes (None: ``defaults.KV_CACHE_MEMORY_CPU`` on CPU,
            ``defaults.KV_CACHE_GPU_FRACTION`` of free memory on CUDA).
        block_size: paged block size in tokens.
        deterministic: batch-invariant computation (see :class:`StepBatch` ``row_tile`` and the
            ADR): a request's logits do not depend on batch, chunking or cache state.
        cuda_graphs: capture decode-only steps as CUDA graphs (:mod:`monobatch.engine.cuda_graphs`)
            where possible: CUDA, paged storage, the default mode, the paged-decode kernel usable.
        async_scheduling: let the scheduler launch decode step N+1 before reading step N's draws
            back (:meth:`BatchScheduler.step`), so the host's work overlaps the device's. None
            (default): on for CUDA outside deterministic mode. Tokens are the same either way at
            B=1 (see :mod:`monobatch.engine.scheduler` for batches).
        tensor_parallel_size: ranks the model is sharded over (one process each, spawned by the
            engine; ADR 0007). 1: this process alone.
    """

    max_model_len: int | None = None
    max_num_seqs: int = defaults.MAX_NUM_SEQS
    prefill_chunk: int = defaults.PREFILL_CHUNK
    max_num_batched_tokens: int | None = None
    kv_storage: str = defaults.KV_STORAGE
    kv_cache_memory: int | None = None
    block_size: int = defaults.BLOCK_SIZE
    deterministic: bool = False
    cuda_graphs: bool = True
    async_scheduling: bool | None = None
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "prefill_chunk", "max_num_batched_tokens", "kv_cache_memory",
                     "block_size", "tensor_parallel_size"):
            setattr(self, name, _whole(name, getattr(self, name), name in _OPTIONAL_INTS))
        for name in ("deterministic", "cuda_graphs", "async_scheduling"):
            value = getattr(self, name)
            if value is None and name == "async_scheduling":
                continue
            if type(value).__name__ not in ("bool", "bool_"):  # a Python or numpy bool
                raise InvalidRequestError(f"{name} must be True or False, not {value!r}", name)
            setattr(self, name, bool(value))
        if not isinstance(self.kv_storage, str):
            raise InvalidRequestError(f"kv_storage must be 'paged' or 'dense', not {self.kv_storage!r}", "kv_storage")
        if self.tensor_parallel_size < 1:
            raise InvalidRequestError(f"--tensor-parallel-size must be >= 1, got {self.tensor_parallel_size}",
                                      "tensor_parallel_size")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InvalidRequestError("max_model_len (--ctx-size) must be >= 2", "max_model_len")
        if self.max_num_seqs < 1:
            raise InvalidRequestError("max_num_seqs must be >= 1", "max_num_seqs")
        if self.prefill_chunk < 1:
            raise InvalidRequestError("prefill_chunk must be >= 1", "prefill_chunk")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise InvalidRequestError("max_num_batched_tokens must be >= 1", "max_num_batched_tokens")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            raise InvalidRequestError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs ({self.max_num_seqs}) "
                "so every running decode fits in a step", "max_num_batched_tokens")
        if self.kv_storage not in ("paged", "dense"):
            raise InvalidRequestError(f"kv_storage {self.kv_storage!r}: expected 'paged' or 'dense'", "kv_storage")
        if self.kv_cache_memory is not None and self.kv_cache_memory < 1:
            raise InvalidRequestError("kv_cache_memory must be a positive number of bytes", "kv_cache_memory")
        if self.kv_cache_memory is not None and self.kv_storage != "paged":
            raise InvalidRequestError("kv_cache_memory sizes the paged pool; it needs kv_storage 'paged'", "kv_cache_memory")
        if self.block_size < 1:
            raise InvalidRequestError("block_size must be >= 1", "block_size")

    def token_budget(self, device_type: str = "cpu") -> int:
        """Tokens one step may compute on a device of ``device_type``."""
        return self.max_num_batched_tokens or max(self.prefill_chunk, self.max_num_seqs,
                                                  defaults.STEP_TOKEN_BUDGET.get(device_type, 0))


#: :class:`EngineConfig`'s integer fields that may be None.
_OPTIONAL_INTS = frozenset({"max_model_len", "max_num_batched_tokens", "kv_cache_memory"})


def _whole(name: str, value: object, optional: bool) -> int | None:
    """An integer setting of :class:`EngineConfig` as an int: an integer (numpy's too), or a float
    with no fraction (``1.5e9`` bytes); None stays None where ``optional`` (the range checks come
    after).

    Raises:
        InvalidRequestError: a bool, a string (the CLI's ``512M`` is ``512 * 2**20`` here), a
            fraction, None for a field that needs a value, or anything else, naming the field."""
    if value is None and optional:
        return None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and type(value).__name__ != "bool_":
        return int(value)
    if isinstance(value, numbers.Real) and float(value).is_integer() and not isinstance(value, bool):
        return int(value)
    raise InvalidRequestError(f"{name} must be a whole number{' of bytes' if name == 'kv_cache_memory' else ''}, "
                              f"not {value!r}", name)


def _size(nbytes: int) -> str:
    """Bytes for a message: MiB with one decimal, or the byte count below 0.1 MiB."""
    return f"{nbytes / 2**20:.1f} MiB" if nbytes >= 2**20 // 10 else f"{nbytes:,} bytes"


class Engine:
    """The model, its KV cache, the sampler and the finish step.

    Args:
        loaded: weights and tokenizer from :func:`monobatch.loader.load_model`.
        config: engine settings; ``max_model_len`` is capped at the model's context length.
    """

    def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None) -> None:
        self.loaded = loaded
        self.model = loaded.model
        self.tokenizer = loaded.tokenizer
        self.config = config or EngineConfig()
        args = self.model.args
        self.max_model_len = min(self.config.max_model_len or args.max_position_embeddings,
                                 args.max_position_embeddings)
        # Tensor parallel (ADR 0007): this process is rank 0 and holds its shard. Deterministic mode
        # on CPU shards TP=1 too, into the same pieces, so any rank count computes the same bits; on
        # CUDA TP=1 stays whole (the pieces would multiply the launches of the batch-invariant path).
        world, self.tp = self.config.tensor_parallel_size, None
        comm.timeout_s()  # MONOBATCH_TP_TIMEOUT: a bad value warns here, before any rank starts, with or without TP
        if world > 1 and self.model.device.type == "cuda":
            check_devices("cuda", self.model.device.index or 0, world, torch.cuda.device_count())
        pieces_at_1 = self.config.deterministic and args.num_key_value_heads > 1 and self.model.device.type == "cpu"
        self.tp_plan = TensorParallelPlan.build(args, world) if world > 1 or pieces_at_1 else None
        if self.tp_plan is not None:
            from monobatch.distributed.sharding import shard_model

            self.model = shard_model(loaded.model, self.tp_plan, 0, pieces=self.config.deterministic, copy_=world > 1)
        self.kv_heads = self.tp_plan.kv_heads(0) if self.tp_plan else args.num_key_value_heads  # this rank's
        # every position a step can hold; before the KV pool takes its share of the free memory. On
        # CPU (no CUDA graph keeps the table) it grows a chunk at a time as positions reach it.
        self.model.build_rope_tables(self.max_model_len, self.model.dtype, grow=self.model.device.type == "cpu")
        self.kv: KvStore = self._make_kv()
        # Deterministic mode on CUDA (Triton): batch-invariant kernels at full batch — the GEMMs of
        # kernels.invariant_gemm, the varlen attention's one tile for every row; elsewhere fixed
        # row tiles (StepBatch.row_tile) and one query row per attention call.
        self.invariant = self.config.deterministic and triton_usable(self.device, args.head_dim)
        self.row_tile = (defaults.DETERMINISTIC_ROW_TILE.get(self.device.type, 8)
                         if self.config.deterministic and not self.invariant else 0)
        # ... not padded where every row-wise op computes each row alone (CPU, packed weights, the
        # fused routes): the step then runs as the fast mode's does (the layer chain, no wasted rows)
        # (world == 1 first: at TP > 1 no route is decided before the shards' groups are attached,
        # so RowParallelLinear.fused_mat never sees a layer without its all-reduce)
        self.row_pad = not (self.row_tile and world == 1 and self.model.rows_independent())
        if not self.row_pad:
            self.row_tile = GEMV_ROWS  # (at most: above it the packed products dequantize, row_independent)
        self.kv.batch_invariant = self.invariant
        if world > 1:  # spawn ranks 1..N-1; the KV store becomes the mirror that replays its calls there
            from monobatch.distributed.runtime import TensorParallelDriver

            self.tp = TensorParallelDriver(loaded.model, self.model, self.tp_plan, self.kv, self.config.deterministic,
                                           self.row_tile, self.invariant)
            self.kv = self.tp.kv
        # A padded embedding (HF exports round it up) has rows no token owns: never draw them.
        self.vocab_size = min(args.vocab_size, self.tokenizer.vocab_size)
        self.sampler = RowSampler(self.vocab_size)
        self._side: torch.cuda.Stream | None = None  # see _side_stream
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size)  # structured outputs
        self.finisher = FinishStep(self.tokenizer.eog_ids, self.max_model_len)
        self.graphs = DecodeGraphs(self.model, self.kv, self.config.max_num_seqs) if self._graphs_usable() else None
        # short prompt steps as CUDA graphs too (launch-bound otherwise; needs the varlen kernel)
        self.prefill_graphs = (PrefillGraphs(self.model, self.kv)
                               if self.graphs is not None and getattr(self.kv, "varlen", False) else None)
        # CPU: whether the last step computed prompt tokens (None: not tracked, on CUDA). A prompt
        # step's float32 temporaries (up to a few MiB a layer) stay in glibc's heap as free chunks
        # when it ends; decode steps allocate little, so the first decode step after one hands
        # the free pages back (trim_heap): the decode's KV growth then fits under the prompt
        # step's peak instead of adding to it (issue 17's RSS; ADR 0006).
        self._after_prompt: bool | None = False if self.device.type == "cpu" else None

    def close(self) -> None:
        """Stop the tensor-parallel worker ranks, if any (also done at exit); the engine is unusable after."""
        if self.tp is not None:
            self.tp.close()

    @torch.inference_mode()
    def warm_up(self) -> None:
        """Capture the CUDA graphs of every decode batch size and prefill bucket now rather than on
        first use (the server calls this before it reports ready); nothing without graphs."""
        with self._on_device():
            for graphs in (self.graphs, self.prefill_graphs):
                if graphs is not None:
                    graphs.capture_all()

    def _graphs_usable(self) -> bool:
        """CUDA graphs for decode steps: on CUDA, paged storage, kernel usable, not row tiles."""
        return (self.config.cuda_graphs and not self.row_tile and isinstance(self.kv, PagedKv) and self.tp is None
                and triton_usable(self.device, self.model.args.head_dim))

    @property
    def device(self) -> torch.device:
        """The model's device (where StepBatch tensors go, except those of a decode step that a
        CUDA graph runs: :meth:`build_batch`)."""
        return self.model.device

    def build_batch(self, chunks: list[tuple]) -> StepBatch:
        """:meth:`StepBatch.build` for this engine (its device and row tile). A decode step that
        a CUDA graph will run keeps its tensors on the host: the graph reads its own static
        buffers, staged from this batch's host tensors (:class:`DecodeGraphs`), so no copy is spent on them."""
        batch = StepBatch.build(chunks, "cpu", self.row_tile, self.row_pad)
        return batch if self._graph_for(batch) is not None else batch.to(self.device)

    def _graph_for(self, batch: StepBatch) -> DecodeGraphs | PrefillGraphs | None:
        """The CUDA graphs that run ``batch`` (decode-only or a short prompt step), if any."""
        for graphs in (self.graphs, self.prefill_graphs):
            if graphs is not None and graphs.handles(batch):
                return graphs
        return None

    def describe(self) -> str:
        """One line for a start-up log: the weights (packed or dequantized, resident bytes), the KV
        store, its capacity and the numerics mode."""
        mode = ("deterministic (batch-invariant kernels)" if self.invariant else
                f"deterministic (row tiles of {self.row_tile})" if self.row_tile and self.row_pad else
                "deterministic (row-independent CPU kernels)" if self.row_tile else "fast (not batch-invariant)")
        graphs = f"; CUDA graphs for decode steps of up to {self.graphs.max_batch} sequences" if self.graphs else ""
        if self.prefill_graphs is not None:
            graphs += (f" and prompt steps of up to {cuda_graphs.PREFILL_MAX_TOKENS} tokens "
                       f"in {cuda_graphs.PREFILL_MAX_CHUNKS} chunks")
        overlap = "; async scheduling" if self.async_scheduling else ""
        tp = f"; {self.tp_plan.describe()}" if self.tp is not None else ""
        return (f"{self.loaded.describe_weights()}; {self.kv.describe()}; context {self.max_model_len} tokens; "
                f"mode {mode}{graphs}{overlap}{tp}")

    def _make_kv(self) -> KvStore:
        """The KV store the config names; a paged pool is sized from ``kv_cache_memory``.

        Raises:
            InsufficientMemoryError: the pool holds fewer tokens than one context.
        """
        args, cfg = self.model.args, self.config
        shape = (args.num_hidden_layers, self.kv_heads, args.head_dim, self.max_model_len,
                 self.model.dtype, self.model.device)
        windows = args.layer_windows()  # sliding-window layers (ADR 0005); all 0 for most models
        if cfg.kv_storage == "dense":
            return DenseKv(*shape, windows=windows)
        groups = layer_groups(windows)
        block_bytes = cfg.block_size * KvStore.token_bytes(len(groups[0].layers), self.kv_heads,
                                                           args.head_dim, self.model.dtype)
        # what one sequence may hold at once: a context, its local layers' windows and one step's chunk
        chunk = min(cfg.prefill_chunk, cfg.token_budget(self.device.type))
        context_blocks = blocks_per_sequence(windows, self.max_model_len, cfg.block_size, chunk)
        memory = cfg.kv_cache_memory
        if memory is None and self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            # memory torch's caching allocator holds but does not use (a freed engine's pool) is free too
            free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            free -= dequant_scratch_bytes(self.model)  # packed weights: a prompt step's dequantized temporary
            memory = int(max(free, 0) * defaults.KV_CACHE_GPU_FRACTION)
        elif memory is None:
            memory = max(defaults.KV_CACHE_MEMORY_CPU, context_blocks * block_bytes)
        num_blocks = memory // block_bytes
        if num_blocks < context_blocks:
            raise InsufficientMemoryError(
                f"the KV cache memory ({_size(memory)}) holds {num_blocks * cfg.block_size // len(groups)} tokens, "
                f"fewer than one context of {self.max_model_len} tokens ({_size(context_blocks * block_bytes)}); "
                "raise --kv-cache-memory or lower -c/--ctx-size")
        return PagedKv(*shape, num_blocks=num_blocks, block_size=cfg.block_size, windows=windows)

    @torch.inference_mode()
    def prompt_logits(self, token_ids: list[int], all_positions: bool = False) -> torch.Tensor:
        """Logits of one prompt run alone (B=1) on a scratch dense KV cache — for parity
        reports and near-tie margins; the engine's own KV is untouched.

        Returns:
            ``[V]`` float32 after the last token, or ``[T, V]`` for every position.
        """
        if self.tp is not None:  # every rank runs it on its own scratch store
            logits = self.tp.prompt_logits(list(token_ids), all_positions)[:, : self.vocab_size]
            return logits if all_positions else logits[0]
        args = self.model.args
        scratch = DenseKv(args.num_hidden_layers, self.kv_heads, args.head_dim,
                          max(len(token_ids), 1), self.model.dtype, self.model.device, windows=args.layer_windows())
        batch = StepBatch.build([(0, list(token_ids), 0, True)], self.device, self.row_tile, self.row_pad)
        if all_positions:
            batch.logit_rows = torch.arange(len(token_ids), device=self.device)
        scratch.batch_invariant = self.invariant
        scratch.prepare(batch)
        with self._on_device():
            logits = self.model(batch, scratch)[:, : self.vocab_size]  # no padded columns
        return logits if all_positions else logits[0]

    def _record_prompt_logprobs(self, batch: StepBatch, logits: torch.Tensor,
                                prompt_rows: dict[int, Sequence]) -> torch.Tensor:
        """Append the prompt logprobs of ``all_logits`` chunks to their sequences; returns the
        rows that sample (one per chunk that reaches its sequence's end), in chunk order."""
        sample, r = [], 0
        for c in batch.chunks:
            n = c.length if c.all_logits else int(c.wants_logits)
            if c.all_logits:
                seq = prompt_rows[c.seq_id]
                have = len(seq.prompt_logprobs)  # positions 0..have-1 are recorded (recompute-safe)
                first, last = max(c.pos, have - 1), min(c.end_pos, len(seq.prompt_ids) - 1)  # rows p predict token p+1
                if last > first:
                    seq.prompt_logprobs += token_logprobs(logits[r + first - c.pos:r + last - c.pos, :self.vocab_size],
                                                          seq.prompt_ids[first + 1:last + 1], seq.prompt_logprobs_k)
            if c.wants_logits:
                sample.append(r + n - 1)
            r += n
        return logits[sample]

    def top2_margin(self, token_ids: list[int]) -> float:
        """The gap between the two largest logits after ``token_ids`` (how near a tie the next
        greedy draw is)."""
        top = self.prompt_logits(token_ids).topk(2).values
        return float(top[0] - top[1])

    def draw_margin(self, prompt_ids: list[int], generated: list[int], params: SamplingParams) -> float:
        """How near the draw after ``prompt_ids + generated`` was to another token: the gap between
        the two best of its :meth:`RowSampler.draw_scores` (logit units, >= 0; ``inf`` where one
        token alone can be drawn). For a greedy request the top-2 gap of the logits after its
        grammar, bias and penalties; for a seeded one the gap between the two best
        noise-perturbed scores of that position's draw. Run alone (B=1) on a scratch KV cache
        (:meth:`prompt_logits`), the sampler state rebuilt from the prompt and ``generated``.

        Raises:
            InvalidRequestError: a structured-output spec that does not compile.
        """
        grammar = self.grammars.matcher(params.structured) if params.structured is not None else None
        state = SamplerState(params, prompt_ids, params.effective_seed(), token_bytes=self.tokenizer.token_bytes,
                             grammar=grammar)
        for t in generated:
            state.accept(t)
        logits = self.prompt_logits(list(prompt_ids) + list(generated))[None]
        top = self.sampler.draw_scores(logits, [state])[0].topk(2).values.tolist()
        return top[0] - top[1] if math.isfinite(top[1]) else math.inf

    def forward(self, batch: StepBatch, token_ids: torch.Tensor | None = None, commit: bool | None = None) -> torch.Tensor:
        """Run ``batch`` through the model, caching its KV. Returns ``[R, V]`` float32 logits
        (a decode-only step replays a CUDA graph when :attr:`graphs` is set).

        ``token_ids`` (``[T]`` int64, on the device) is run instead of the batch's input ids (the
        batch itself is not changed); then the batch's own ids are placeholders, so
        :meth:`KvStore.commit` (which keys the prefix cache by them) is left to the caller unless
        ``commit`` says otherwise: async scheduling feeds a step the previous step's draws before
        the host has read them (:meth:`launch`).
        """
        commit = token_ids is None if commit is None else commit
        if self._after_prompt is not None:
            decode_only = batch.is_decode_only
            if decode_only and self._after_prompt:
                trim_heap()  # once per run of prompt steps: ~2 ms, against a prompt step's hundreds
            self._after_prompt = not decode_only
        with self._on_device():
            graphs = self._graph_for(batch)
            if graphs is not None:
                return graphs.forward(batch, token_ids, commit)
            batch = batch.to(self.device)
            if token_ids is not None:
                batch = dataclasses.replace(batch, token_ids=token_ids)
            self.kv.prepare(batch)
            logits = self.model(batch, self.kv) if self.tp is None else self.tp.forward(batch)
            if commit:
                self.kv.commit(batch)
            return logits

    @contextlib.contextmanager
    def _on_device(self):
        """Make the model's GPU the current CUDA device (Triton kernels, streams and graph
        capture use the current device, which need not be the tensors'), with the
        batch-invariant GEMMs on in deterministic mode (:func:`invariant_gemm.mode`)."""
        with (torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext()), \
                invariant_gemm.mode(self.invariant):
            yield

    @property
    def async_scheduling(self) -> bool:
        """Whether the scheduler may overlap steps (config; default: on CUDA, except in
        row-tiled deterministic mode, which runs eagerly)."""
        on = self.config.async_scheduling
        if self.tp is not None:  # the workers need each step's input ids on the host
            return False
        return self.device.type == "cuda" and not self.row_tile if on is None else on

    @torch.inference_mode()
    def launch(self, batch: StepBatch, rows: list[Sequence], ahead: int = 0,
               token_ids: torch.Tensor | None = None, defer_draw: bool = False,
               unchecked: bool = False, replace: dict[int, int] | None = None) -> PendingStep:
        """Forward ``batch`` and draw one token per row on the device, without waiting for it:
        the draws are copied to the host behind an event (read by :meth:`resolve`). An
        ``unchecked`` step with grammar rows queues that copy later, after its forced redraws
        (:meth:`draw_forced`; :meth:`resolve` where that was not called): call ``draw_forced``
        before launching the next step, or the copy waits behind that step's forward.

        Args:
            batch: a step whose logit rows belong to ``rows`` (no prompt logprobs).
            rows: R sequences, every one :attr:`SamplerState.history_free` or
                :attr:`SamplerState.grammar_only`.
            ahead: draws of these rows not yet resolved (0 or 1); ``token_ids`` then holds the
                last of them, on the device, and the KV commit is left to the caller.
            defer_draw: only queue the forward; :meth:`draw_deferred` draws once the rows'
                previous tokens are accepted (rows with a structured-output grammar:
                :attr:`SamplerState.grammar_only`).
            unchecked: every row is plain greedy or :attr:`SamplerState.greedy_checked`: the
                grammar rows draw their raw argmax now, checked by :meth:`resolve` once their
                previous tokens are accepted (no mask, no sync on most steps).
            replace: row -> input id overriding ``token_ids`` (a void row of the step before:
                its input is the id that replaced its refused draw).

        Returns:
            The :class:`PendingStep` (its ``tokens`` can feed the next step at once, unless the
            draw is deferred).

        Raises:
            as :meth:`forward` (the KV store's errors) and :meth:`RowSampler.draw`.
        """
        if replace:  # one page-locked copy, no wait for the step in flight
            with self._on_device():
                buf = ids_on([*replace, *replace.values()], token_ids.device)
                k = len(replace)
                token_ids = token_ids.index_copy(0, buf[:k], buf[k:].to(token_ids.dtype))
        logits = self.forward(batch, token_ids)
        if defer_draw:
            return PendingStep(batch, rows, None, None, None, logits)
        return self._draw_async(batch, rows, logits, ahead, unchecked)

    @torch.inference_mode()
    def draw_deferred(self, pending: PendingStep) -> None:
        """Draw a deferred step's tokens now that every row's earlier tokens are accepted: the
        grammar masks are computed on the host while the forward runs, then the draws and their
        copy to the host are queued behind it (fills ``tokens``, ``host``, ``ready``)."""
        drawn = self._draw_async(pending.batch, pending.rows, pending.logits, 0)
        pending.tokens, pending.host, pending.ready, pending.logits = drawn.tokens, drawn.host, drawn.ready, None

    @torch.inference_mode()
    def draw_forced(self, pending: PendingStep) -> None:
        """Redraw a launched unchecked step's grammar rows whose grammar forces the next bytes,
        once their previous tokens are accepted — before the step after it reads ``tokens``.

        An unchecked draw is the raw argmax; the grammar refuses it mostly where it forces the
        next bytes (a key, a quote, a separator), and a refusal voids the row in the step
        launched on it (recomputed one step later). At those positions only a few tokens can spell
        the forced bytes, so the best of them (unchecked candidates,
        :meth:`GrammarMatcher.forced_candidates`) is drawn now (:meth:`RowSampler.forced_draws`: on
        the host where a row has one candidate, else a gather on the device) and written into
        ``tokens``: the next step computes those rows from these ids, and :meth:`resolve` checks
        the redraws instead of the raw argmax (nearly always accepted; a refused one is corrected
        and voided like a refused argmax). Runs on the host while the step's
        forward runs; no wait for the device.

        An unchecked step with grammar rows has its draws' host copy queued here, after the
        redraws (one copy of the final draws, none of the redraws apart); :meth:`resolve` queues
        it where this was not called.
        """
        if pending.tokens is None:
            return
        with self._on_device():
            try:
                if FORCED_DRAWS and pending.check is not None:
                    self._redraw_forced(pending)
            finally:
                if pending.host is None:
                    pending.host, pending.ready = _to_host(pending.tokens)

    def _redraw_forced(self, pending: PendingStep) -> None:
        """:meth:`draw_forced`'s redraws, written into ``pending.tokens`` (``pending.forced``: their
        rows). Runs in :meth:`_on_device`."""
        gram, x = pending.check
        void, rows = pending.void, pending.rows
        live = {r for r in gram if not rows[r].is_finished and r not in void}
        if not live:
            return
        got = self.sampler.forced_draws(x, [seq.sampler for seq in rows], gram, live)
        if got is None:
            return
        picked, at, ids = got
        pending.tokens.index_copy_(0, at, ids)
        pending.forced = picked

    def _draw_async(self, batch: StepBatch, rows: list[Sequence], logits: torch.Tensor, ahead: int,
                    unchecked: bool = False) -> PendingStep:
        """Draw on the device and queue the copy of the draws to the host behind an event
        (``unchecked``: as :meth:`launch`; the grammar rows' raw logits are kept for the check and
        the copy is left to :meth:`draw_forced`).
        Runs in :meth:`_on_device` (the event, the pinned copies and the argmax kernel's launch use
        the current CUDA device, which must be the model's: an engine on ``cuda:1``)."""
        with self._on_device():
            masked = self.finisher.ban_early_stops(logits, rows, ahead)
            check = None
            if unchecked:  # an argmax is exact whatever the batch: one draw, in any mode
                tokens = self.sampler.draw(masked, [s.sampler for s in rows], ahead, unchecked=True)
                gram = [r for r, seq in enumerate(rows) if seq.sampler.grammar is not None]
                if gram:  # grammar rows have no engine-side mask: their raw logits are the model's
                    if len(gram) < len(rows):  # page-locked, no wait for the step in flight (a new tensor)
                        x = logits.index_select(0, ids_on(gram, logits.device)).to(torch.float32)
                    else:  # a CUDA graph's logits are its static buffer, overwritten by the next replay
                        x = logits.to(torch.float32, copy=self._graph_for(batch) is not None)
                    check = (gram, x)
                    # the host copy waits for draw_forced's redraws (one copy of the final draws)
                    return PendingStep(batch, rows, tokens, None, None, check=check)
            elif self._per_row_draws(rows):  # one row per draw, as in step()
                tokens = torch.cat([self.sampler.draw(masked[r:r + 1], [seq.sampler], ahead)
                                    for r, seq in enumerate(rows)])
            else:
                tokens = self.sampler.draw(masked, [s.sampler for s in rows], ahead)
            return PendingStep(batch, rows, tokens, *_to_host(tokens), check=check)

    def _per_row_draws(self, rows: list[Sequence]) -> bool:
        """Deterministic mode samples one row per sampler call, so no reduction over a row (a
        softmax's sum, a top-p cumsum) sees a neighbour's row — except when every row is a
        greedy draw needing at most the grammar mask: an argmax is exact whatever the batch
        (the row's maximum, ties to the lowest id), and a mask is elementwise, so the batch
        draws at once."""
        return self.config.deterministic and not all(seq.sampler.argmax_draw for seq in rows)

    def resolve(self, pending: PendingStep) -> list[RowOutput]:
        """Wait for a launched step's draws and run the finish step on the rows still running (a
        row whose sequence ended or was aborted meanwhile is dropped, and so is a void row).
        An unchecked draw's grammar rows are checked first; a refused one is replaced by the
        best token the grammar accepts (recorded in ``pending.corrected``).

        Returns:
            One RowOutput per row still running, in row order.

        Raises:
            RuntimeError: the device failed the step (surfaces at the event's synchronize).
        """
        if pending.host is None:  # an unchecked step draw_forced did not see: its copy now
            with self._on_device():
                pending.host, pending.ready = _to_host(pending.tokens)
        if pending.ready is not None:
            pending.ready.synchronize()
        ids = pending.host.tolist()
        if pending.check is not None:
            self._check_draws(pending, ids)
        live = [(seq, t) for r, (seq, t) in enumerate(zip(pending.rows, ids))
                if r not in pending.void and not seq.is_finished]
        if not live:
            return []
        seqs, toks = zip(*live)
        return self.finisher.apply(list(seqs), SampleOutput(list(toks), None, None))

    def _check_draws(self, pending: PendingStep, ids: list[int]) -> None:
        """:meth:`RowSampler.check_picks` of an unchecked draw's grammar rows on the host, then, only where
        one was refused, :meth:`RowSampler.redraw`, in place in ``ids`` (``RowSampler.correct``'s
        two halves). On CUDA the redraw of a refused row runs on a side stream behind the step's own event, so
        it does not wait for the step launched after this one (async scheduling keeps the device
        busy through a refusal)."""
        gram, x = pending.check
        pending.check = None
        rows, void = pending.rows, pending.void
        live = {r for r in gram if not rows[r].is_finished and r not in void}
        if not live:
            return
        states = [seq.sampler for seq in rows]
        # the checks first, on the host (advance: an allowed draw advances its grammar now, the finish
        # step's accept confirms it); the device only where some draw was refused
        refused = self.sampler.check_picks(states, ids, gram, only=live, advance=True)
        if not refused:
            return
        with contextlib.ExitStack() as stack:
            stack.enter_context(self._on_device())  # the side stream and its event wait: the model's GPU
            if x.is_cuda:
                side = self._side_stream()
                side.wait_event(pending.ready)  # x is complete at the step's event
                x.record_stream(side)  # made on the main stream, read on this one
                stack.enter_context(torch.cuda.stream(side))
            fixed = self.sampler.redraw(x, states, ids, gram, refused)  # waits for its redraws
        for r, t in fixed.items():
            ids[r] = t
        pending.corrected = sorted(fixed)

    def _side_stream(self) -> torch.cuda.Stream:
        """A second CUDA stream on the model's device (refused draws' redraws), made on first use."""
        if self._side is None:
            self._side = torch.cuda.Stream(device=self.device)
        return self._side

    @torch.inference_mode()
    def step(self, batch: StepBatch, rows: list[Sequence],
             prompt_rows: dict[int, Sequence] | None = None) -> list[RowOutput]:
        """Forward ``batch``, then sample and finish one token for each of ``rows``.

        Args:
            batch: the planned step; its logit rows belong to ``rows``, in order, except chunks
                with ``all_logits`` (every row; their last row samples when the chunk ends the
                sequence's tokens).
            rows: the sequences whose chunk reaches their last token (R of them).
            prompt_rows: seq id -> sequence for the ``all_logits`` chunks: their prompt logprobs
                are recorded on the sequence.

        Returns:
            One RowOutput per row.
        """
        logits = self.forward(batch)  # (logit rows, V)
        if prompt_rows:
            logits = self._record_prompt_logprobs(batch, logits, prompt_rows)  # (R, V)
        if not rows:
            return []
        masked = self.finisher.ban_early_stops(logits, rows)
        if not self._per_row_draws(rows):
            return self.finisher.apply(rows, self.sampler.sample(masked, [s.sampler for s in rows], model_logits=logits))
        # Deterministic mode: one row per sampler call, so no reduction sees a neighbour's row.
        return [out for r, seq in enumerate(rows) for out in self.finisher.apply(
            [seq], self.sampler.sample(masked[r:r + 1], [seq.sampler], model_logits=logits[r:r + 1]))]
