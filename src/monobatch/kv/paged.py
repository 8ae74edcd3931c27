"""PagedKv: a pool of fixed-size KV blocks, a block table per sequence, and the prefix cache.

Layout (``bs`` = block size, tokens)::

    pool      [layers, 2, num_blocks * bs, n_kv, hd]    one slot per token, token-major
    table[s]  [b0, b1, b2]                              block ids of sequence s, in order
    slot(p)   = table[s][p // bs] * bs + p % bs        where position p of s lives

A step writes its tokens' K/V with one ``index_copy_`` per layer (slot mapping built once per
step in :meth:`PagedKv.prepare`) and reads each sequence's keys with one gather, so a
sequence's keys arrive as ``[S, n_kv, hd]`` exactly as dense storage hands them to
:func:`monobatch.kv.attention.attend_chunk` (a plain torch gather).

On CUDA (Triton) a step's attention is instead one launch per layer for all its chunks
(:func:`monobatch.kernels.varlen_attention.varlen_paged_attention`): the new K/V rows are stored
with one :func:`~monobatch.kernels.paged_decode.store_kv` and every query row reads its keys from
the pool through its block table, with no gather and no per-chunk work on the host or device.

A decode-only step can instead run from static device tensors (:class:`DecodeStep`: slot mapping,
block tables, lengths) through :func:`monobatch.kernels.paged_decode.paged_decode_attention`,
which needs no host work — the form a CUDA graph captures (:mod:`monobatch.engine.cuda_graphs`).
Rows that pad a captured batch write to a scratch block past the pool that no sequence owns.

Blocks are reference-counted (:class:`monobatch.kv.block_pool.BlockPool`): ``fork`` shares every
block, and a block that is shared or keyed in the prefix cache is copied before a sequence writes
into it (copy-on-write, done in :meth:`PagedKv.reserve`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NoReturn, Sequence

import numpy as np
import torch

from monobatch.batch import StepBatch
from monobatch.errors import InsufficientMemoryError
from monobatch.kernels.paged_decode import paged_decode_attention, store_kv, triton_usable
from monobatch.kernels.varlen_attention import VarlenMeta, build_meta, tokens_per_tile, varlen_paged_attention
from monobatch.kv.attention import attend_chunk
from monobatch.kv.block_pool import ROOT_HASH, BlockPool, block_hash
from monobatch.kv.store import KvStore, KvUsage


@dataclass(slots=True)
class _EagerStep:
    """A prepared step outside the static decode path.

    Attributes:
        batch: the step.
        write: ``[T]`` int64 pool slot of each new token (device).
        gather: ``[sum S]`` int64 slots of every chunk's keys, in chunk order (torch path; None on
            the varlen path).
        spans: ``(offset in gather, S)`` per chunk (torch path).
        tables: each chunk's block ids (varlen path: the metadata is built at the first layer,
            which knows the query heads).
        meta: the varlen layout, once built.
    """

    batch: StepBatch
    write: torch.Tensor
    gather: torch.Tensor | None
    spans: list[tuple[int, int]]
    tables: list[list[int]]
    meta: VarlenMeta | None = None


@dataclass(slots=True)
class DecodeStep:
    """A decode-only step's attention inputs as device tensors of a fixed batch size B (rows past
    the real ones are padding).

    Attributes:
        slot_mapping: ``[B]`` int64, the pool slot each row's new K/V is written to.
        block_tables: ``[B, nb]`` int32, each row's block ids (``nb`` = blocks of a full context).
        seq_lens: ``[B]`` int32, keys each row attends to (its new token included).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor

    def rows(self, n: int) -> "DecodeStep":
        """The first ``n`` rows (views: same memory, so a graph captured on them sees new values)."""
        return DecodeStep(self.slot_mapping[:n], self.block_tables[:n], self.seq_lens[:n])


class PagedKv(KvStore):
    """Paged storage with a prefix cache.

    Args:
        num_layers, num_kv_heads, head_dim, max_seq_len, dtype, device: see :class:`KvStore`.
        num_blocks: blocks in the pool (``num_blocks * block_size`` tokens in all).
        block_size: tokens per block (16 by default, like vLLM and llama.cpp's server).

    Raises:
        InsufficientMemoryError: the pool cannot be allocated.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_seq_len: int,
                 dtype: torch.dtype, device: torch.device, num_blocks: int, block_size: int = 16) -> None:
        super().__init__(num_layers, num_kv_heads, head_dim, max_seq_len, dtype, device)
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.block_size = block_size
        try:
            self.pool = BlockPool(num_blocks)
            # one scratch block past the pool: padding rows of a captured decode write there
            self.cache = torch.empty(num_layers, 2, (num_blocks + 1) * block_size, num_kv_heads, head_dim,
                                     dtype=dtype, device=self.device)
        except (RuntimeError, MemoryError) as e:  # MemoryError: the host cannot hold the block lists
            raise InsufficientMemoryError(
                f"cannot allocate the KV pool ({num_blocks} blocks, "
                f"{num_blocks * block_size * self.bytes_per_token / 2**20:.0f} MiB); lower --kv-cache-memory") from e
        self._table: dict[int, list[int]] = {}
        self._len: dict[int, int] = {}
        self._tokens: dict[int, list[int]] = {}  # cached token ids, to key full blocks
        self._keys: dict[int, list[bytes]] = {}  # prefix-cache keys of the sequence's full blocks
        self._step: _EagerStep | DecodeStep | None = None
        #: one varlen launch per layer for a step's chunks (CUDA with Triton); else the torch path
        self.varlen = triton_usable(self.device, head_dim)
        self._meta_of: DecodeStep | None = None  # the static decode step _meta was built for
        self._meta: VarlenMeta | None = None
        self.scratch_block = num_blocks  # never allocated: see DecodeStep
        self.max_blocks_per_seq = -(-max_seq_len // block_size)
        self.paged_attention_calls = 0  # attend() calls, one per layer per step (`monobatch parity` reads it)

    # -- queries --------------------------------------------------------------------------------
    def seq_len(self, seq_id: int) -> int:
        return self._len.get(seq_id, 0)

    def num_sequences(self) -> int:
        return len(self._table)

    def block_table(self, seq_id: int) -> list[int]:
        """Block ids of ``seq_id`` in position order (a copy)."""
        return list(self._table.get(seq_id, ()))

    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    def usage(self) -> KvUsage:
        used = self.pool.num_referenced
        return KvUsage(used, self.pool.num_blocks, used * self.block_size * self.bytes_per_token, self.pool.num_evictable)

    def describe(self) -> str:
        n, bs = self.pool.num_blocks, self.block_size
        return (f"KV cache: paged, {n} blocks x {bs} tokens = {n * bs} tokens "
                f"({n * bs * self.bytes_per_token / 2**20:.0f} MiB, {str(self.dtype).removeprefix('torch.')}), "
                "prefix cache on")

    # -- allocation -------------------------------------------------------------------------------
    def _needs_copy(self, seq_id: int) -> bool:
        """True when the block holding the next position is shared or cached (copy before writing).
        Blocks past it are never shared: fork shares only blocks holding tokens."""
        n, table = self._len.get(seq_id, 0), self._table.get(seq_id, [])
        if n // self.block_size >= len(table):
            return False
        block = table[n // self.block_size]
        return self.pool.ref[block] > 1 or self.pool.is_cached(block)

    def reserve(self, seq_id: int, num_tokens: int) -> bool:
        """Allocate blocks (and copy a shared tail block) so ``seq_id`` can hold ``num_tokens``.
        Returns False, allocating nothing, when the pool has too few free + evictable blocks."""
        table = self._table.get(seq_id, [])
        if num_tokens <= self._len.get(seq_id, 0):
            return True
        copy = self._needs_copy(seq_id)
        need = max(-(-num_tokens // self.block_size) - len(table), 0) + copy
        if need > self.pool.num_available:
            return False
        table = self._table.setdefault(seq_id, table)
        self._len.setdefault(seq_id, 0)
        self._tokens.setdefault(seq_id, [])
        self._keys.setdefault(seq_id, [])
        if copy:
            i = self._len[seq_id] // self.block_size
            old, new = table[i], self.pool.allocate()
            self._block(new).copy_(self._block(old))
            self.pool.release(old)
            table[i] = new
        while len(table) * self.block_size < num_tokens:
            table.append(self.pool.allocate())
        return True

    def _block(self, block: int) -> torch.Tensor:
        """The slots of one block across layers: ``[layers, 2, bs, n_kv, hd]`` (a view)."""
        bs = self.block_size
        return self.cache[:, :, block * bs:(block + 1) * bs]

    def adopt_prefix(self, seq_id: int, token_ids: Sequence[int]) -> int:
        if self._table.get(seq_id):
            raise ValueError(f"sequence {seq_id} already holds KV")
        bs, parent = self.block_size, ROOT_HASH
        table, keys = [], []
        for i in range(len(token_ids) // bs):
            ids = token_ids[i * bs:(i + 1) * bs]
            key = block_hash(parent, ids)
            block = self.pool.lookup(key, parent, ids)
            if block is None:
                break
            table.append(block)
            keys.append(key)
            parent = key
        n = len(table) * bs
        self._table[seq_id], self._keys[seq_id] = table, keys
        self._len[seq_id], self._tokens[seq_id] = n, list(token_ids[:n])
        return n

    # -- a step -------------------------------------------------------------------------------------
    def prepare(self, batch: StepBatch) -> None:
        """Check positions, allocate what :meth:`reserve` did not, and build the step's slot
        mapping (where each new token is written) and gather indices (each chunk's keys).

        Raises:
            ValueError: a gap or an overflow of the context. InsufficientMemoryError: the pool
                has no free or evictable block left.
        """
        bs = self.block_size
        write, gather, spans, tables = [], [], [], []
        offset = 0
        for c in batch.chunks:
            self.check_chunk(c)
            if not self.reserve(c.seq_id, c.end_pos):
                self._pool_full()
            table = self._table[c.seq_id]
            tables.append(table[:-(-c.end_pos // bs)])
            first = c.pos // bs  # the slots of positions pos .. end_pos - 1 (the chunk's new tokens)
            blocks = np.asarray(table[first:-(-c.end_pos // bs)], dtype=np.int64)
            slots = (blocks[:, None] * bs + np.arange(bs)).reshape(-1)
            write.append(slots[c.pos - first * bs:c.end_pos - first * bs])
            if not self.varlen:
                every = (np.asarray(tables[-1], dtype=np.int64)[:, None] * bs + np.arange(bs)).reshape(-1)
                gather.append(every[:c.end_pos])
                spans.append((offset, c.end_pos))
                offset += c.end_pos
        if not batch.chunks:
            self._step = None
            return
        slots = torch.from_numpy(np.concatenate(write + gather))
        if self.device.type == "cuda":
            slots = slots.pin_memory().to(self.device, non_blocking=True)
        else:
            slots = slots.to(self.device)
        T = batch.num_tokens
        self._step = _EagerStep(batch, slots[:T], None if self.varlen else slots[T:], spans, tables)

    def prepare_decode(self, batch: StepBatch, host: DecodeStep, device: DecodeStep) -> None:
        """:meth:`prepare` for a decode-only ``batch`` into static tensors: each row's slot, block
        table and length go into ``host``; :meth:`attend` then reads ``device``, which the caller
        fills from ``host`` before the forward (:class:`monobatch.engine.cuda_graphs.DecodeInputs`:
        one copy for all of a step's inputs). Rows past the batch's are padding: they write to
        the scratch block and attend to one key.

        Raises:
            ValueError: a chunk that is not one token, or a gap / overflow of the context.
            InsufficientMemoryError: the pool has no free or evictable block left.
        """
        bs, n = self.block_size, len(batch.chunks)
        slots, lens = [], []
        for i, c in enumerate(batch.chunks):
            if c.length != 1:
                raise ValueError("prepare_decode takes one token per sequence")
            self.check_chunk(c)
            if not self.reserve(c.seq_id, c.end_pos):
                self._pool_full()
            table = self._table[c.seq_id]
            slots.append(table[c.pos // bs] * bs + c.pos % bs)
            lens.append(c.end_pos)
            width = len(table)
            host.block_tables[i, :width] = torch.as_tensor(table, dtype=torch.int32)
        pad = host.slot_mapping.shape[0] - n
        host.slot_mapping.copy_(torch.as_tensor(slots + [self.scratch_block * bs] * pad, dtype=torch.int64))
        host.seq_lens.copy_(torch.as_tensor(lens + [1] * pad, dtype=torch.int32))
        if pad:
            host.block_tables[n:, 0] = self.scratch_block
        self._step, self._meta_of = device, None

    def _pool_full(self) -> NoReturn:
        u = self.usage()
        raise InsufficientMemoryError(
            f"the KV pool is full ({u.used_blocks} of {u.total_blocks} blocks in use); "
            "raise --kv-cache-memory or run fewer sequences at once")

    def bind_decode(self, step: DecodeStep) -> None:
        """Make :meth:`attend` read ``step`` as it stands (graph capture and warm-up)."""
        self._step, self._meta_of = step, None

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        self.paged_attention_calls += 1
        k_cache, v_cache = self.cache[layer, 0], self.cache[layer, 1]  # (slots, n_kv, hd)
        if isinstance(self._step, DecodeStep):  # static decode step: no host work (capturable)
            step = self._step
            if self.batch_invariant and self.varlen:  # the kernel and tile prefill rows run
                store_kv(k, v, k_cache, v_cache, step.slot_mapping)
                return varlen_paged_attention(q, k_cache, v_cache, self._decode_meta(step, q.shape[1]), self.block_size)
            return paged_decode_attention(q, k_cache, v_cache, step.block_tables, step.seq_lens, self.block_size,
                                          k, v, step.slot_mapping)  # (stores k and v first)
        step = self._step
        assert isinstance(step, _EagerStep) and step.batch is batch, "prepare(batch) first"
        if self.varlen:
            if step.meta is None:  # the first layer of the step: lay the chunks out as tiles
                bt = tokens_per_tile(q.shape[1], self.num_kv_heads, self.batch_invariant or batch.row_tile > 0)
                step.meta = build_meta([(c.start, c.length, c.pos) for c in batch.chunks], step.tables, bt,
                                       self.device)
            store_kv(k, v, k_cache, v_cache, step.write)
            return varlen_paged_attention(q, k_cache, v_cache, step.meta, self.block_size)
        k_cache.index_copy_(0, step.write, k)
        v_cache.index_copy_(0, step.write, v)
        keys, values = k_cache[step.gather], v_cache[step.gather]  # (sum of S, n_kv, hd): every chunk's keys
        out = torch.empty_like(q)
        for c, (o, S) in zip(batch.chunks, step.spans):
            s, e = c.start, c.start + c.length
            out[s:e] = attend_chunk(q[s:e], keys[o:o + S], values[o:o + S], c.pos, batch.row_tile > 0)
        return out

    def _decode_meta(self, step: DecodeStep, num_q_heads: int) -> VarlenMeta:
        """The varlen layout of a static decode step (row b = chunk b = tile b, one token at
        position ``seq_lens[b] - 1``, in the deterministic tile), built on the device at the
        step's first layer (a graph captures it once per replay) and reused by its other layers;
        :meth:`prepare_decode` and :meth:`bind_decode` drop it."""
        if self._meta_of is not step:
            B = step.seq_lens.shape[0]
            rows = torch.arange(B, dtype=torch.int32, device=self.device)
            self._meta = VarlenMeta(step.block_tables, rows, torch.ones_like(rows), step.seq_lens - 1, rows,
                                    torch.zeros_like(rows), tokens_per_tile(num_q_heads, self.num_kv_heads, True))
            self._meta_of = step
        return self._meta

    def commit(self, batch: StepBatch) -> None:
        """Advance each sequence and key the blocks that became full in the prefix cache."""
        bs = self.block_size
        for c in batch.chunks:
            assert len(c.token_ids) == c.length, "StepBatch.build records each chunk's token ids"
            self._len[c.seq_id] = c.end_pos
            tokens, keys, table = self._tokens[c.seq_id], self._keys[c.seq_id], self._table[c.seq_id]
            tokens.extend(c.token_ids)
            while len(keys) < c.end_pos // bs:
                i = len(keys)
                parent = keys[-1] if keys else ROOT_HASH
                ids = tokens[i * bs:(i + 1) * bs]
                key = block_hash(parent, ids)
                self.pool.register(table[i], key, parent, ids)
                keys.append(key)
        self._step = None

    # -- lifetime -------------------------------------------------------------------------------------
    def trim(self, seq_id: int, n: int) -> None:
        """Rewind to ``n`` tokens; blocks past them are released (a kept, partly overwritten
        block is copied first if it is shared or cached — see :meth:`reserve`)."""
        have = self._len.get(seq_id)
        if have is None or n >= have:
            return
        n = max(n, 0)
        table = self._table[seq_id]
        keep = -(-n // self.block_size)
        for block in reversed(table[keep:]):
            self.pool.release(block)
        del table[keep:]
        self._len[seq_id] = n
        del self._tokens[seq_id][n:]
        del self._keys[seq_id][n // self.block_size:]

    def fork(self, src: int, dst: int) -> None:
        """Share ``src``'s blocks that hold tokens with ``dst`` (no copy now: the shared partial
        block is copied when either writes into it, see :meth:`reserve`)."""
        if self._table.get(dst):
            raise ValueError(f"sequence {dst} already holds KV")
        n = self._len.get(src, 0)
        table = list(self._table.get(src, [])[:-(-n // self.block_size)])
        for block in table:
            self.pool.share(block)
        self._table[dst], self._len[dst] = table, self._len.get(src, 0)
        self._tokens[dst], self._keys[dst] = list(self._tokens.get(src, [])), list(self._keys.get(src, []))

    def free(self, seq_id: int) -> None:
        """Release ``seq_id``'s blocks, last first, so the LRU evicts a prefix's tail before its head."""
        for block in reversed(self._table.pop(seq_id, [])):
            self.pool.release(block)
        for state in (self._len, self._tokens, self._keys):
            state.pop(seq_id, None)
