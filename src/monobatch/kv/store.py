"""KvStore: the one interface attention reads and writes the KV cache through.

Storages behind it: :class:`monobatch.kv.dense.DenseKv` (a contiguous buffer per sequence) and
:class:`monobatch.kv.paged.PagedKv` (a block pool with block tables and the prefix cache). The
forward never touches a storage's layout.

Per step the scheduler calls ``reserve(seq, n)`` for each planned chunk (paged storage allocates
blocks, or says no), the engine calls ``prepare(batch)`` (check positions, build the step's
indices), then each layer calls ``attend(layer, q, k, v, batch)`` (store the step's K/V, attend),
then ``commit(batch)`` (the new tokens become part of each sequence's cached length; paged
storage registers blocks that became full in the prefix cache).

Sliding-window layers (Gemma 3's local layers) are the store's business too: ``windows`` says,
per layer, how many of the last positions its queries see (0 = all), and :meth:`KvStore.attend`
runs that window in every path — prefill chunks, decode, cache hits, recompute after preemption
(ADR 0005).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import torch

from monobatch.batch import Chunk, StepBatch
from monobatch.kv.attention import window_start


@dataclass(slots=True)
class KvUsage:
    """A snapshot of a KV store for metrics.

    Attributes:
        used_blocks / total_blocks: blocks referenced by sequences / in the pool (paged); for
            dense storage, sequences holding a buffer / 0 (no fixed pool).
        used_bytes: bytes held by sequences.
        cached_blocks: unreferenced blocks kept for the prefix cache (evictable).
    """

    used_blocks: int
    total_blocks: int
    used_bytes: int
    cached_blocks: int = 0

    @property
    def usage(self) -> float:
        """Fraction of the pool referenced by sequences, 0..1 (0 without a fixed pool)."""
        return self.used_blocks / self.total_blocks if self.total_blocks else 0.0


class KvStore(ABC):
    """Key/value cache for any number of sequences, addressed by sequence id.

    Caches are token-major: a sequence's keys of one layer read as ``[S, n_kv, hd]``.

    Args:
        num_layers, num_kv_heads, head_dim: the model's KV shape.
        max_seq_len: the context length; no sequence may grow past it (tokens).
        dtype, device: storage dtype and device (the model's compute dtype).
        windows: per layer, the sliding window its attention sees (the last N positions, its
            own included), 0 = full attention; None = every layer full
            (:meth:`monobatch.models.args.ModelArgs.layer_windows`).
    """

    #: Tokens per block; None for storages without blocks (no prefix cache).
    block_size: int | None = None

    #: attend() calls that read paged storage (one per layer per step); 0 for dense storage.
    paged_attention_calls: int = 0

    #: Deterministic mode on CUDA (set by the engine): every step's attention, decode steps
    #: included, runs the varlen kernel with its one deterministic tile, so a token's bits do not
    #: depend on the step it is computed in (:mod:`monobatch.kernels.varlen_attention`).
    batch_invariant: bool = False

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_seq_len: int,
                 dtype: torch.dtype, device: torch.device, windows: Sequence[int] | None = None) -> None:
        self.windows = tuple(int(w) for w in windows) if windows is not None else (0,) * num_layers
        if len(self.windows) != num_layers or min(self.windows, default=0) < 0:
            raise ValueError(f"windows must give {num_layers} values >= 0 (0 = full attention)")
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.dtype = dtype
        self.device = torch.device(device)

    def key_start(self, layer: int, pos: int) -> int:
        """The first position ``layer``'s query at ``pos`` sees (0 for a full-attention layer)."""
        return window_start(self.windows[layer], pos)

    @staticmethod
    def token_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        """KV bytes one token occupies across all layers (K and V)."""
        return 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token occupies across all layers (K and V)."""
        return self.token_bytes(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype)

    @abstractmethod
    def seq_len(self, seq_id: int) -> int:
        """Tokens cached for ``seq_id`` (0 for an unknown sequence)."""

    def reserve(self, seq_id: int, num_tokens: int) -> bool:
        """Make room for ``seq_id`` to hold ``num_tokens`` tokens before the next step.

        Returns False (and changes nothing) when the storage cannot; storages without a fixed
        pool always say yes and grow in :meth:`prepare`.
        """
        return True

    def adopt_prefix(self, seq_id: int, token_ids: Sequence[int]) -> int:
        """Start ``seq_id`` (holding no KV) from cached blocks matching a prefix of ``token_ids``.

        Returns:
            Tokens adopted (whole blocks; 0 for storages without a prefix cache). The caller
            computes the rest; pass at most ``num_tokens - 1`` ids so the last token, whose
            logits are needed, is always recomputed.
        """
        return 0

    def capacity_tokens(self) -> int | None:
        """Tokens the whole store can hold at once (None = no fixed pool)."""
        return None

    def check_chunk(self, chunk: Chunk) -> None:
        """A chunk must continue its sequence's cache and stay within the context.

        Raises:
            ValueError: a gap (``chunk.pos`` is not the cached length) or an overflow.
        """
        have = self.seq_len(chunk.seq_id)
        if chunk.pos != have:
            raise ValueError(f"sequence {chunk.seq_id}: chunk starts at {chunk.pos} but {have} tokens are cached")
        if chunk.end_pos > self.max_seq_len:
            raise ValueError(f"sequence {chunk.seq_id}: {chunk.end_pos} tokens exceed the context ({self.max_seq_len})")

    @abstractmethod
    def prepare(self, batch: StepBatch) -> None:
        """Reserve room for every chunk of ``batch`` and build its indices.

        Raises:
            ValueError: a chunk does not start at its sequence's cached length, or would pass
                ``max_seq_len``. InsufficientMemoryError: no room (allocation failed).
        """

    def store_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """Where this step's keys and values of ``layer`` go, for a projection that writes them
        itself (the fused RoPE, :func:`monobatch.kernels.fused.rope_qk`): ``(k_cache, v_cache,
        slot_mapping)`` (pools ``[slots, n_kv, hd]``, ``[T]`` int64 slots), or None where
        :meth:`attend` stores them (the default; also where its attention kernel stores them in
        its own launch). After a call that returned slots, :meth:`attend` may get k and v None."""
        return None

    #: A model's fused CPU layer chain bound to this store's caches, as ``(model, its placement,
    #: chain or None)`` (:meth:`monobatch.models.layers.DecoderModel.layer_chain` builds it at its
    #: first step, and again after the model's weights moved).
    layer_chain: tuple | None = None

    def chain_layer(self, layer: int) -> tuple[int, torch.Tensor, torch.Tensor, int] | None:
        """What the C++ attention (:func:`monobatch.kernels.cpu_ops.attention`) needs of ``layer``
        for a whole-model layer chain (:class:`monobatch.models.layers.DecoderModel.layer_chain`):
        ``(its layer group, k_cache, v_cache [slots, n_kv, hd], its window)``; None where this
        store does not attend through that kernel (the default)."""
        return None

    def chain_inputs(self, batch: StepBatch, layers: int) -> tuple[list, list, list] | None:
        """The prepared step's inputs of the C++ attention, one entry a layer group: ``(write
        [T] int64, rows [R, 3] int64, tables int32)``, where :meth:`attend` would run every layer's
        attention of ``batch`` in that kernel alone; else None (the default). A non-None answer
        counts the ``layers`` attention calls the chain makes (:attr:`paged_attention_calls`)."""
        return None

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
               batch: StepBatch) -> torch.Tensor:
        """Store this step's keys/values of ``layer`` and return attention outputs.

        Args:
            q: ``[T, n_q, hd]``; k, v: ``[T, n_kv, hd]`` for the batch's T tokens (RoPE applied),
                or both None: already written at :meth:`store_slots`.

        Returns:
            ``[T, n_q, hd]``, each token attending causally to its own sequence only (one query
            row at a time when ``batch.row_tile`` is set).
        """

    @abstractmethod
    def commit(self, batch: StepBatch) -> None:
        """Mark the step's tokens as cached (after every layer ran ``attend``)."""

    @abstractmethod
    def trim(self, seq_id: int, n: int) -> None:
        """Keep only the first ``n`` cached tokens of ``seq_id`` (rewind); ``n`` >= current is a no-op."""

    @abstractmethod
    def fork(self, src: int, dst: int) -> None:
        """Give ``dst`` (holding no KV) ``src``'s cached tokens. Dense storage copies the buffer;
        paged storage shares the blocks (reference counts) and copies a shared block only when a
        sequence writes into it.

        Raises:
            ValueError: ``dst`` already holds KV. InsufficientMemoryError: (dense) no room for the copy.
        """

    @abstractmethod
    def free(self, seq_id: int) -> None:
        """Release everything held for ``seq_id``; unknown ids are ignored."""

    @abstractmethod
    def num_sequences(self) -> int:
        """Sequences currently holding KV."""

    @abstractmethod
    def usage(self) -> KvUsage:
        """Blocks and bytes in use (for metrics)."""

    def clear_prefix_cache(self) -> int:
        """Drop the prefix cache's unreferenced blocks (they become free); the number dropped.
        Storage without a prefix cache has none: 0."""
        return 0

    def used_bytes(self) -> int:
        """Bytes of KV storage currently held by sequences."""
        return self.usage().used_bytes

    def describe(self) -> str:
        """One line for the start-up log: storage, capacity, dtype."""
        return f"{type(self).__name__}"
