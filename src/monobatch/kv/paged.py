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

Sliding-window layers (ADR 0005): the layers are cut into groups of equal size
(:func:`monobatch.kv.block_manager.layer_groups`), each with its own block table per sequence
over the one pool, and the pool's layer axis is a group's layers (``pool[i]`` is the ``i``-th
layer of whichever group owns a block). A local group's blocks are released once they leave its
window (:class:`~monobatch.kv.block_manager.BlockManager` keeps the tables); a model without
windows has one group of all its layers — the layout above.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import NoReturn, Sequence

import numpy as np
import torch

from monobatch.batch import StepBatch
from monobatch.errors import InsufficientMemoryError
from monobatch.kernels import cpu_ops
from monobatch.kernels.paged_decode import paged_decode_attention, store_kv, triton_usable
from monobatch.kernels.varlen_attention import (VarlenMeta, build_meta, tile_layout, tokens_per_tile,
                                                varlen_paged_attention)
from monobatch.kv.attention import attend_chunk
from monobatch.kv.block_manager import BlockManager, layer_groups
from monobatch.kv.store import KvStore, KvUsage


@dataclass(slots=True)
class _EagerStep:
    """A prepared step outside the static decode path, one layer group's part of it (a model
    without windows has one group).

    Attributes:
        batch: the step.
        write: ``[T]`` int64 pool slot of each new token (device).
        gather: ``[sum S]`` int64 slots of every chunk's keys, in chunk order (torch path; None on
            the varlen path).
        spans: ``(offset in gather, S, key_start)`` per chunk (torch path): the chunk's keys are
            positions ``key_start .. end_pos - 1`` (``key_start`` > 0 only past a window).
        tables: each chunk's block ids (varlen path: the metadata is built at the first layer,
            which knows the query heads; released blocks of a local group are the scratch block).
        meta: the varlen layout, once built.
        rows, flat_tables: the CPU kernel's rows (int64 ``[R, 3]``: row, position, offset of the
            chunk's table in ``flat_tables``, int32) for the chunks it attends (None: no kernel);
            those chunks' ``spans`` entries are None (no gather).
    """

    batch: StepBatch
    write: torch.Tensor
    gather: torch.Tensor | None
    spans: list[tuple[int, int, int] | None]
    tables: list[list[int]]
    meta: VarlenMeta | None = None
    rows: torch.Tensor | None = None
    flat_tables: torch.Tensor | None = None


@dataclass(slots=True)
class DecodeStep:
    """A decode-only step's attention inputs as device tensors of a fixed batch size B (rows past
    the real ones are padding).

    Attributes:
        slot_mapping: ``[G, B]`` int64, per layer group, the pool slot each row's new K/V is
            written to (G = 1 without sliding windows).
        block_tables: ``[B, G, nb]`` int32, each row's block ids per group (``nb`` = blocks of a
            full context; a local group's released blocks are the scratch block).
        seq_lens: ``[B]`` int32, keys each row attends to (its new token included).
        positions: ``[B]`` int32, the position of each row's new token (``seq_lens - 1``; 0 on
            padding rows): the deterministic varlen layout's chunk positions, written on the host
            with the lengths, so no launch derives them on the device; None: derived there.
        written: for a host buffer that :meth:`PagedKv.prepare_decode` fills step after step: row
            -> the :meth:`BlockManager.stamp` of the tables its ``block_tables`` row holds, so a
            row whose sequence's tables did not change since is not rewritten (most rows of most
            steps); None: not tracked (every row written).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    positions: torch.Tensor | None = None
    written: dict[int, int] | None = None

    def rows(self, n: int) -> "DecodeStep":
        """The first ``n`` rows (views: same memory, so a graph captured on them sees new values)."""
        return DecodeStep(self.slot_mapping[:, :n], self.block_tables[:n], self.seq_lens[:n],
                          None if self.positions is None else self.positions[:n], self.written)

    def group(self, g: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Group ``g``'s ``(slot_mapping [B], block_tables [B, nb])`` (views)."""
        return self.slot_mapping[g], self.block_tables[:, g]


@dataclass(slots=True)
class PrefillStep:
    """A step with prompt chunks as device tensors of fixed sizes — T token rows, N chunks (plus
    one empty chunk that padding tiles point to), NT tiles — for a captured prefill graph
    (:class:`monobatch.engine.cuda_graphs.PrefillGraphs`). Rows, chunks and tiles past the real
    ones are padding: padding rows write their K/V to the scratch block and their attention
    output is zero (no tile covers them); padding tiles point to an empty chunk.

    Attributes:
        write: ``[G, T]`` int64, per layer group, the pool slot of each row's new K/V.
        block_tables: ``[N + 1, G, nb]`` int32 block ids of each chunk's sequence per group.
        chunks: ``[3, N + 1]`` int32 rows: each chunk's first row in the step, its length, the
            position of its first token (:class:`~monobatch.kernels.varlen_attention.VarlenMeta`).
        tiles: ``[2, NT]`` int32 rows: each tile's chunk and first token in it.
        tokens_per_tile: the tiles' ``BT``.
    """

    write: torch.Tensor
    block_tables: torch.Tensor
    chunks: torch.Tensor
    tiles: torch.Tensor
    tokens_per_tile: int

    def meta(self, g: int, fixed_split: bool = False) -> VarlenMeta:
        """Layer group ``g``'s varlen layout (views); ``fixed_split``: deterministic mode's KV split."""
        return VarlenMeta(self.block_tables[:, g], self.chunks[0], self.chunks[1], self.chunks[2], self.tiles[0],
                          self.tiles[1], self.tokens_per_tile, fixed_split)


class PagedKv(KvStore):
    """Paged storage with a prefix cache.

    Args:
        num_layers, num_kv_heads, head_dim, max_seq_len, dtype, device: see :class:`KvStore`.
        num_blocks: blocks in the pool (``num_blocks * block_size`` tokens of one layer group
            each; with one group, of every layer).
        block_size: tokens per block (16 by default, like vLLM and llama.cpp's server).
        windows: per layer, its sliding window (0 = full attention); see :class:`KvStore`.

    Raises:
        InsufficientMemoryError: the pool cannot be allocated.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_seq_len: int,
                 dtype: torch.dtype, device: torch.device, num_blocks: int, block_size: int = 16,
                 windows: Sequence[int] | None = None) -> None:
        super().__init__(num_layers, num_kv_heads, head_dim, max_seq_len, dtype, device, windows)
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.block_size = block_size
        self.groups = layer_groups(self.windows)
        #: layer -> (its group, its index in the pool's layer axis)
        self._where = {layer: (g, i) for g, grp in enumerate(self.groups) for i, layer in enumerate(grp.layers)}
        group_layers = len(self.groups[0].layers)
        #: bytes of one block (block_size tokens of one group's layers, K and V)
        self.block_bytes = block_size * self.token_bytes(group_layers, num_kv_heads, head_dim, dtype)
        try:
            # the manager calls back through a weak reference: a bound method would make a cycle, and
            # a cycle keeps a dropped pool's GPU memory until the garbage collector runs (the next
            # engine in the process then sizes its pool from what is left, or fails to allocate it)
            me = weakref.ref(self)
            self.blocks = BlockManager(num_blocks, block_size, self.groups, lambda src, dst: me()._copy_block(src, dst))
            self.pool = self.blocks.pool
            # one scratch block past the pool: padding rows of a captured decode write there
            self.cache = torch.empty(group_layers, 2, (num_blocks + 1) * block_size, num_kv_heads, head_dim,
                                     dtype=dtype, device=self.device)
        except (RuntimeError, MemoryError) as e:  # MemoryError: the host cannot hold the block lists
            raise InsufficientMemoryError(
                f"cannot allocate the KV pool ({num_blocks} blocks, "
                f"{num_blocks * self.block_bytes / 2**20:.0f} MiB); lower --kv-cache-memory") from e
        #: per layer, its (k_cache, v_cache) ``[slots, n_kv, hd]`` views of ``cache`` (made once, not per call)
        self._layer_cache = [(self.cache[i, 0], self.cache[i, 1])
                             for i in (self._where[layer][1] for layer in range(num_layers))]
        self._step: list[_EagerStep] | DecodeStep | PrefillStep | None = None
        #: one varlen launch per layer for a step's chunks (CUDA with Triton); else the torch path
        self.varlen = triton_usable(self.device, head_dim)
        #: CPU, float32: the new K/V stored and decode rows (every row in deterministic mode)
        #: attended in place by one call per layer (:func:`cpu_ops.attention`); prompt chunks of the
        #: default mode gather their keys for torch's attention
        self.cpu_kernel = not self.varlen and cpu_ops.enabled(self.cache)
        self._cpu_attention = cpu_ops.op("attention") if self.cpu_kernel else None  # the C++ function, bound once
        self._meta_of: DecodeStep | None = None  # the static decode step _meta was built for
        self._meta: dict[int, VarlenMeta] = {}  # per layer group
        self._decode_consts: dict[int, tuple[torch.Tensor, ...]] = {}  # B -> _decode_meta's row numbers, ones, zeros
        self.scratch_block = num_blocks  # never allocated: see DecodeStep
        self.max_blocks_per_seq = -(-max_seq_len // block_size)
        self.paged_attention_calls = 0  # attend() calls, one per layer per step (`monobatch parity` reads it)

    # -- queries --------------------------------------------------------------------------------
    def seq_len(self, seq_id: int) -> int:
        return self.blocks.seq_len(seq_id)

    def num_sequences(self) -> int:
        return self.blocks.num_sequences()

    def block_table(self, seq_id: int, group: int = 0) -> list[int | None]:
        """Block ids of ``seq_id`` in position order for layer group ``group`` (a copy; None: a
        local group's block released past its window)."""
        return self.blocks.table(seq_id, group)

    def capacity_tokens(self) -> int:
        """Tokens the pool holds in every layer group at once."""
        return self.pool.num_blocks * self.block_size // len(self.groups)

    def usage(self) -> KvUsage:
        used = self.pool.num_referenced
        return KvUsage(used, self.pool.num_blocks, used * self.block_bytes, self.pool.num_evictable)

    def clear_prefix_cache(self) -> int:
        return self.pool.clear_cache()

    def describe(self) -> str:
        n, bs, dtype = self.pool.num_blocks, self.block_size, str(self.dtype).removeprefix('torch.')
        if len(self.groups) == 1:
            return (f"KV cache: paged, {n} blocks x {bs} tokens = {n * bs} tokens "
                    f"({n * self.block_bytes / 2**20:.0f} MiB, {dtype}), prefix cache on")
        local = sorted({g.window for g in self.groups if g.window})
        return (f"KV cache: paged, {n} blocks x {bs} tokens x {len(self.groups[0].layers)} layers "
                f"({n * self.block_bytes / 2**20:.0f} MiB, {dtype}) shared by {len(self.groups)} layer groups; "
                f"sliding window {'/'.join(map(str, local))} on {sum(1 for w in self.windows if w)} of "
                f"{self.num_layers} layers (blocks released past it); prefix cache on")

    # -- allocation -------------------------------------------------------------------------------
    def reserve(self, seq_id: int, num_tokens: int) -> bool:
        """Allocate blocks (and copy a shared tail block) so ``seq_id`` can hold ``num_tokens``, in
        every layer group. Returns False, allocating nothing, when the pool has too few free +
        evictable blocks."""
        return self.blocks.reserve(seq_id, num_tokens)

    def _copy_block(self, src: int, dst: int) -> None:
        """Copy one block's K/V (copy-on-write)."""
        self._block(dst).copy_(self._block(src))

    def _block(self, block: int) -> torch.Tensor:
        """The slots of one block across layers: ``[layers, 2, bs, n_kv, hd]`` (a view)."""
        bs = self.block_size
        return self.cache[:, :, block * bs:(block + 1) * bs]

    def adopt_prefix(self, seq_id: int, token_ids: Sequence[int]) -> int:
        """See :meth:`KvStore.adopt_prefix`; with sliding windows, only a prefix whose window every
        local group still holds (:meth:`BlockManager.adopt_prefix`, ADR 0005)."""
        return self.blocks.adopt_prefix(seq_id, token_ids)

    # -- a step -------------------------------------------------------------------------------------
    def prepare(self, batch: StepBatch) -> None:
        """Check positions, allocate what :meth:`reserve` did not, and build the step's slot
        mapping (where each new token is written) and gather indices (each chunk's keys).

        Raises:
            ValueError: a gap or an overflow of the context. InsufficientMemoryError: the pool
                has no free or evictable block left.
        """
        bs = self.block_size
        for c in batch.chunks:
            self.check_chunk(c)
            if not self.reserve(c.seq_id, c.end_pos):
                self._pool_full()
        if not batch.chunks:
            self._step = None
            return
        parts, sizes, steps = [], [], []
        for g, grp in enumerate(self.groups):
            write, gather, spans, tables = [], [], [], []
            rows, flat_tables, offset = [], [], 0
            for c in batch.chunks:
                table = self.blocks.table(c.seq_id, g)[:-(-c.end_pos // bs)]
                tables.append([self.scratch_block if b is None else b for b in table])
                first = c.pos // bs  # the slots of positions pos .. end_pos - 1 (the chunk's new tokens)
                blocks = np.asarray(table[first:], dtype=np.int64)
                slots = (blocks[:, None] * bs + np.arange(bs)).reshape(-1)
                write.append(slots[c.pos - first * bs:c.end_pos - first * bs])
                if self.cpu_kernel and (c.length == 1 or batch.row_tile > 0):  # no gather: the kernel's rows
                    rows += [(c.start + i, c.pos + i, len(flat_tables)) for i in range(c.length)]
                    flat_tables += tables[-1]
                    spans.append(None)
                elif not self.varlen:
                    ks = self.key_start(grp.layers[0], c.pos)  # the keys the chunk sees: ks .. end_pos - 1
                    held = np.asarray(self.blocks.blocks(c.seq_id, g, ks, c.end_pos), dtype=np.int64)
                    every = (held[:, None] * bs + np.arange(bs)).reshape(-1)
                    gather.append(every[ks - ks // bs * bs:c.end_pos - ks // bs * bs])
                    spans.append((offset, c.end_pos - ks, ks))
                    offset += c.end_pos - ks
            parts += write + gather
            sizes.append((batch.num_tokens, offset))
            step = _EagerStep(batch, None, None, spans, tables)  # slots filled below, one copy for all
            if self.cpu_kernel:
                step.rows = torch.tensor(rows, dtype=torch.int64).view(-1, 3)
                step.flat_tables = torch.tensor(flat_tables, dtype=torch.int32)
            steps.append(step)
        flat = torch.from_numpy(np.concatenate(parts))
        if self.device.type == "cuda":
            flat = flat.pin_memory().to(self.device, non_blocking=True)
        else:
            flat = flat.to(self.device)
        at = 0
        for step, (T, S) in zip(steps, sizes):
            step.write, at = flat[at:at + T], at + T
            if not self.varlen and S:
                step.gather, at = flat[at:at + S], at + S
        self._step = steps

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
        size, scratch = host.slot_mapping.shape[1], self.scratch_block
        # numpy views of the host tensors: a row's table is written with one slice assignment
        # (a torch index_put a row and group cost several us of host time, issue 16)
        tables_np = host.block_tables.numpy()
        written = host.written if host.written is not None else {}
        blocks, seq_len, max_len = self.blocks, self.blocks.seq_len, self.max_seq_len
        reserve, stamp_of = blocks.reserve, blocks.stamp
        positions = [c.pos for c in batch.chunks]
        for i, c in enumerate(batch.chunks):
            seq_id, pos = c.seq_id, c.pos
            if c.length != 1:
                raise ValueError("prepare_decode takes one token per sequence")
            if pos != seq_len(seq_id) or pos + 1 > max_len:
                self.check_chunk(c)  # raises
            if not reserve(seq_id, pos + 1):
                self._pool_full()
            stamp = stamp_of(seq_id)
            if written.get(i) != stamp:  # the row holds another sequence's tables, or older ones
                for g, table in enumerate(blocks.tables(seq_id)):
                    tables_np[i, g, :len(table)] = [scratch if b is None else b for b in table] \
                        if None in table else table
                written[i] = stamp
        if len(written) > n:  # rows of an earlier, larger batch: padding now, rewritten below
            for i in [r for r in written if r >= n]:
                del written[i]
        if n < size:
            tables_np[n:, :, 0] = scratch
        # every row's slot and length from its (now current) table row at once, into numpy views of
        # the host tensors; padding rows write to the scratch block and attend to one key
        pos = np.array(positions, dtype=np.int64)
        slots, lens = host.slot_mapping.numpy(), host.seq_lens.numpy()  # (G, size), (size,)
        slots[:, :n] = tables_np[np.arange(n), :, pos // bs].T.astype(np.int64) * bs + pos % bs  # the block written is held
        slots[:, n:] = scratch * bs
        lens[:n] = pos + 1
        lens[n:] = 1
        if host.positions is not None:  # the deterministic varlen layout's (_decode_meta)
            qpos = host.positions.numpy()
            qpos[:n] = pos
            qpos[n:] = 0
        self._step, self._meta_of = device, None

    def prepare_prefill(self, batch: StepBatch, host: PrefillStep, device: PrefillStep) -> None:
        """:meth:`prepare` for a step a prefill graph runs: the slots, block tables, chunks and
        tiles go into ``host`` (padding past the batch's), :meth:`attend` then reads ``device``,
        which the caller fills from ``host`` before the forward (one copy).

        Raises:
            ValueError: a gap or an overflow of the context, or more rows, chunks or tiles than
                the buffers hold. InsufficientMemoryError: the pool has no free or evictable block.
        """
        bs, n, T = self.block_size, len(batch.chunks), batch.num_tokens
        rows, chunks, tiles = host.write.shape[1], host.chunks.shape[1] - 1, host.tiles.shape[1]
        layout = tile_layout([(c.start, c.length, c.pos) for c in batch.chunks], host.tokens_per_tile)
        if T > rows or n > chunks or len(layout) > tiles:
            raise ValueError(f"a step of {T} tokens in {n} chunks ({len(layout)} tiles) does not fit "
                             f"{rows} rows, {chunks} chunks, {tiles} tiles")
        for c in batch.chunks:
            self.check_chunk(c)
            if not self.reserve(c.seq_id, c.end_pos):
                self._pool_full()
        write = np.full((len(self.groups), rows), self.scratch_block * bs, dtype=np.int64)
        for g in range(len(self.groups)):
            for i, c in enumerate(batch.chunks):
                table = [self.scratch_block if b is None else b for b in self.blocks.table(c.seq_id, g)]
                pos = np.arange(c.pos, c.end_pos)
                write[g, c.start:c.start + c.length] = np.asarray(table, dtype=np.int64)[pos // bs] * bs + pos % bs
                host.block_tables[i, g, :len(table)] = torch.as_tensor(table, dtype=torch.int32)
        host.write.copy_(torch.from_numpy(write))
        meta = np.zeros((3, chunks + 1), dtype=np.int32)  # padding chunks: no tokens
        meta[:, :n] = np.asarray([(c.start, c.length, c.pos) for c in batch.chunks], dtype=np.int32).T.reshape(3, n)
        host.chunks.copy_(torch.from_numpy(meta))
        order = np.zeros((2, tiles), dtype=np.int32)
        order[0, :] = chunks  # padding tiles: the empty chunk past the real ones
        if layout:
            order[:, :len(layout)] = np.asarray(layout, dtype=np.int32).T
        host.tiles.copy_(torch.from_numpy(order))
        self._step = device

    def bind_prefill(self, step: PrefillStep) -> None:
        """Make :meth:`attend` read ``step`` as it stands (graph capture and warm-up)."""
        self._step = step

    def unbind(self) -> None:
        """Forget the bound or prepared step (after a graph capture): :meth:`attend` then needs a
        :meth:`prepare` (or a bind) first."""
        self._step, self._meta_of = None, None

    def _pool_full(self) -> NoReturn:
        u = self.usage()
        raise InsufficientMemoryError(
            f"the KV pool is full ({u.used_blocks} of {u.total_blocks} blocks in use); "
            "raise --kv-cache-memory or run fewer sequences at once")

    def bind_decode(self, step: DecodeStep) -> None:
        """Make :meth:`attend` read ``step`` as it stands (graph capture and warm-up)."""
        self._step, self._meta_of = step, None

    def store_slots(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """The slots :meth:`attend` would :func:`store_kv` this step's keys at wherever it runs the
        varlen kernel on CUDA: a captured prompt step's static slots, a deterministic static
        decode step's, and every eager step's (default mode under ``--enforce-eager`` too);
        None for a default-mode static decode step (its attention launch stores them) and off
        CUDA. The branches follow :meth:`attend`'s."""
        if not (self.varlen and self.device.type == "cuda"):
            return None
        g = self._where[layer][0]
        k_cache, v_cache = self._layer_cache[layer]
        step = self._step
        if isinstance(step, PrefillStep):
            return k_cache, v_cache, step.write[g]
        if isinstance(step, DecodeStep):
            return (k_cache, v_cache, step.group(g)[0]) if self.batch_invariant else None
        if isinstance(step, list) and step[g].batch is not None:
            return k_cache, v_cache, step[g].write
        return None

    def chain_layer(self, layer: int) -> tuple[int, torch.Tensor, torch.Tensor, int] | None:
        if not self.cpu_kernel:
            return None
        return (self._where[layer][0], *self._layer_cache[layer], self.windows[layer])

    def chain_inputs(self, batch: StepBatch, layers: int) -> tuple[list, list, list] | None:
        step = self._step
        # attend()'s CPU-kernel branch with no gather (every chunk's rows in the kernel) in every group
        if not self.cpu_kernel or not isinstance(step, list) or step[0].batch is not batch \
                or any(s.gather is not None or s.rows is None for s in step):
            return None
        self.paged_attention_calls += layers
        return [s.write for s in step], [s.rows for s in step], [s.flat_tables for s in step]

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
               batch: StepBatch) -> torch.Tensor:
        self.paged_attention_calls += 1
        g = self._where[layer][0]
        k_cache, v_cache = self._layer_cache[layer]  # (slots, n_kv, hd)
        if isinstance(self._step, PrefillStep):  # a prefill graph's static step (capturable)
            if k is not None:  # else stored by the fused RoPE (store_slots)
                store_kv(k, v, k_cache, v_cache, self._step.write[g])
            return varlen_paged_attention(q, k_cache, v_cache, self._step.meta(g, self.batch_invariant),
                                          self.block_size, window=self.windows[layer],
                                          out=torch.zeros_like(q))  # padding rows: 0
        if isinstance(self._step, DecodeStep):  # static decode step: no host work (capturable)
            step, window = self._step, self.windows[layer]
            slot_mapping, block_tables = step.group(g)
            if self.batch_invariant and self.varlen:  # the kernel and tile prefill rows run
                if k is not None:
                    store_kv(k, v, k_cache, v_cache, slot_mapping)
                return varlen_paged_attention(q, k_cache, v_cache, self._decode_meta(step, g, q.shape[1]),
                                              self.block_size, window=window)
            return paged_decode_attention(q, k_cache, v_cache, block_tables, step.seq_lens, self.block_size,
                                          k, v, slot_mapping, window)  # (stores k and v first)
        assert isinstance(self._step, list) and self._step[g].batch is batch, "prepare(batch) first"
        step, window = self._step[g], self.windows[layer]
        if self.varlen:
            if step.meta is None:  # the first layer of the step: lay the chunks out as tiles
                det = self.batch_invariant or batch.row_tile > 0
                bt = tokens_per_tile(q.shape[1], self.num_kv_heads, det)
                step.meta = build_meta([(c.start, c.length, c.pos) for c in batch.chunks], step.tables, bt,
                                       self.device, fixed_split=det)
            if k is not None:
                store_kv(k, v, k_cache, v_cache, step.write)
            return varlen_paged_attention(q, k_cache, v_cache, step.meta, self.block_size, window=window)
        if self.cpu_kernel:  # stores the step's K/V, attends the kernel's rows in place
            out = None if step.gather is None else torch.empty(q.shape, dtype=q.dtype, device=q.device)
            out = self._cpu_attention(q, k, v, k_cache, v_cache, step.write, step.rows, step.flat_tables,
                                      self.block_size, window, out)  # cpu_ops.attention (None: every row, a new out)
        else:
            out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
            k_cache.index_copy_(0, step.write, k)
            v_cache.index_copy_(0, step.write, v)
        if step.gather is None:  # every chunk attended by the kernel
            return out
        keys, values = k_cache[step.gather], v_cache[step.gather]  # (sum of S, n_kv, hd): the other chunks' keys
        for c, span in zip(batch.chunks, step.spans):
            if span is not None:
                (o, S, ks), s, e = span, c.start, c.start + c.length
                out[s:e] = attend_chunk(q[s:e], keys[o:o + S], values[o:o + S], c.pos, batch.row_tile > 0, window, ks)
        return out

    def _decode_meta(self, step: DecodeStep, group: int, num_q_heads: int) -> VarlenMeta:
        """The varlen layout of a static decode step for layer group ``group`` (row b = chunk b =
        tile b, one token at position ``seq_lens[b] - 1``, in the deterministic tile), made at the
        step's first layer of the group and reused by its other layers; :meth:`prepare_decode`
        and :meth:`bind_decode` drop them. The chunk positions are the step's ``positions``
        (written on the host; where a step has none, ``seq_lens - 1`` on the device, which a
        graph then recomputes every replay); the row numbers, ones and zeros are constants of B,
        made once (outside any capture: the warm-up runs first), so a captured deterministic
        decode step launches nothing for its layout."""
        if self._meta_of is not step:
            self._meta, self._meta_of = {}, step
        if group not in self._meta:
            B = step.seq_lens.shape[0]
            if B not in self._decode_consts:
                rows = torch.arange(B, dtype=torch.int32, device=self.device)
                self._decode_consts[B] = rows, torch.ones_like(rows), torch.zeros_like(rows)
            rows, ones, zeros = self._decode_consts[B]
            pos = step.seq_lens - 1 if step.positions is None else step.positions
            bt = tokens_per_tile(num_q_heads, self.num_kv_heads, True)
            self._meta[group] = VarlenMeta(step.group(group)[1], rows, ones, pos, rows, zeros, bt, fixed_split=True)
        return self._meta[group]

    def commit(self, batch: StepBatch) -> None:
        """Advance each sequence, key the blocks that became full in the prefix cache, and release
        the local groups' blocks that left their window (:meth:`BlockManager.commit`)."""
        for c in batch.chunks:
            assert len(c.token_ids) == c.length, "StepBatch.build records each chunk's token ids"
            self.blocks.commit(c.seq_id, c.end_pos, c.token_ids)
        self._step = None

    # -- lifetime -------------------------------------------------------------------------------------
    def trim(self, seq_id: int, n: int) -> None:
        """Rewind to ``n`` tokens; blocks past them are released (a kept, partly overwritten
        block is copied first if it is shared or cached — see :meth:`reserve`).

        Raises:
            ValueError: rewinding past a sliding window (its released keys are gone).
        """
        self.blocks.trim(seq_id, n)

    def fork(self, src: int, dst: int) -> None:
        """Share ``src``'s blocks that hold tokens with ``dst`` (no copy now: the shared partial
        block is copied when either writes into it, see :meth:`reserve`)."""
        self.blocks.fork(src, dst)

    def free(self, seq_id: int) -> None:
        """Release ``seq_id``'s blocks, last first, so the LRU evicts a prefix's tail before its head."""
        self.blocks.free(seq_id)
