"""BlockManager: which blocks each sequence holds — one block table per layer group, the prefix
cache's keys, copy-on-write, and the release of blocks that left a sliding window (ADR 0005).

No tensors here (:class:`monobatch.kv.paged.PagedKv` owns the pool's memory and copies a block's
contents through the ``copy_block`` callback); a block is an int of one shared
:class:`~monobatch.kv.block_pool.BlockPool`.

Layer groups (vLLM's hybrid KV-cache manager): the layers are cut into groups of equal size, each
all full-attention or all of one sliding window, and a block holds ``block_size`` tokens of the
layers of one group, so every group allocates pages of one size from one pool::

    windows  [512, 512, 512, 512, 512, 0, ...]      per layer (0 = full attention)
    groups   (0, (5, 11, 17)) (512, (0, 1, 2)) (512, (3, 4, 6)) ...
    tables   seq -> [[b0, b1, b2, ...],              full group: every block
                     [None, None, b7, b8, ...], ...] local group: None once past the window

A model without windows has one group of all its layers (ADR 0002's layout, unchanged).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Sequence

from monobatch.kv.attention import window_start
from monobatch.kv.block_pool import ROOT_HASH, BlockPool, block_hash

#: Stamps of block-table changes (BlockManager.stamp), one count for every manager in the process:
#: a host buffer that outlives one manager never takes another's stamp for its own.
_STAMPS = itertools.count(1)


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Layers whose KV share block tables: ``window`` 0 (full attention) or their sliding window."""

    window: int
    layers: tuple[int, ...]


def layer_groups(windows: Sequence[int]) -> tuple[LayerGroup, ...]:
    """Cut the layers into groups of one window and equal size (the gcd of each window's layer
    count), full-attention groups first, layers in order within each window.

    Args:
        windows: per layer, its window (0 = full attention).
    """
    by_window: dict[int, list[int]] = {}
    for layer, w in enumerate(windows):
        by_window.setdefault(int(w), []).append(layer)
    size = math.gcd(*(len(layers) for layers in by_window.values())) if by_window else 1
    return tuple(LayerGroup(w, tuple(layers[i:i + size]))
                 for w, layers in sorted(by_window.items()) for i in range(0, len(layers), size))


def blocks_per_sequence(windows: Sequence[int], max_seq_len: int, block_size: int, chunk: int) -> int:
    """The most blocks one sequence ever holds (all groups): a full context in every full group,
    and in a local group its window plus the largest chunk a step computes (``chunk`` tokens),
    at most a context. A pool at least this large lets every admitted request finish alone."""
    context = -(-max_seq_len // block_size)
    return sum(context if g.window == 0 else min(context, -(-(g.window - 1 + chunk) // block_size) + 1)
               for g in layer_groups(windows))


class BlockManager:
    """Per-sequence block tables over one pool, for every layer group.

    Args:
        num_blocks: blocks in the pool.
        block_size: tokens per block.
        groups: from :func:`layer_groups`.
        copy_block: ``copy_block(src, dst)`` copies a block's contents (copy-on-write).

    Attributes:
        pool: the :class:`BlockPool` (free list, reference counts, prefix cache).
    """

    def __init__(self, num_blocks: int, block_size: int, groups: Sequence[LayerGroup],
                 copy_block: Callable[[int, int], None]) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.groups = tuple(groups)
        self._copy_block = copy_block
        self._tables: dict[int, list[list[int | None]]] = {}
        self._len: dict[int, int] = {}
        self._tokens: dict[int, list[int]] = {}  # cached token ids, to key full blocks
        self._keys: dict[int, list[bytes]] = {}  # chained prefix-cache keys of the full blocks
        self._stamp: dict[int, int] = {}  # seq -> the stamp of its tables' last change (see stamp)
        # seq -> tokens it can hold with nothing to allocate or copy, as the last reserve found
        # (every block past the one being written is its own and uncached); dropped by whatever
        # may share one of its blocks or shorten its tables (fork, trim, adopt_prefix, free)
        self._room: dict[int, int] = {}
        self._local = [(g, grp.window) for g, grp in enumerate(self.groups) if grp.window]  # sliding-window groups

    # -- queries ----------------------------------------------------------------------------------
    def seq_len(self, seq_id: int) -> int:
        """Tokens cached for ``seq_id`` (0 when unknown)."""
        return self._len.get(seq_id, 0)

    def num_sequences(self) -> int:
        """Sequences holding blocks (or an empty table)."""
        return len(self._tables)

    def table(self, seq_id: int, group: int = 0) -> list[int | None]:
        """``group``'s block ids of ``seq_id`` in position order (None: released), a copy."""
        tables = self._tables.get(seq_id)
        return list(tables[group]) if tables else []

    def tables(self, seq_id: int) -> list[list[int | None]]:
        """Every group's block table of ``seq_id``, as held (not a copy: read, never change it)."""
        return self._tables[seq_id]

    def stamp(self, seq_id: int) -> int:
        """A number that changes whenever any of ``seq_id``'s block tables does (a block appended,
        copied on write, released past a window, trimmed; a new table), unique across sequences,
        changes and managers: two equal stamps mean the same tables. 0 for an unknown sequence. Lets a
        caller that mirrors the tables elsewhere (:meth:`PagedKv.prepare_decode`'s host buffer)
        rewrite a row only when its table changed."""
        return self._stamp.get(seq_id, 0)

    def blocks(self, seq_id: int, group: int, start: int, end: int) -> list[int]:
        """``group``'s blocks holding positions ``start .. end - 1`` of ``seq_id`` (all held)."""
        bs = self.block_size
        out = self._tables[seq_id][group][start // bs:-(-end // bs)]
        assert None not in out, "a released block was asked for"
        return out  # type: ignore[return-value]

    def _key(self, key: bytes, group: int) -> bytes:
        """The pool's key of a group's block: the prefix digest (+ the group, when several)."""
        return key if len(self.groups) == 1 else key + bytes([group])

    # -- allocation -----------------------------------------------------------------------------------
    def _needs_copy(self, table: list[int | None], n: int) -> bool:
        """The block holding position ``n`` (the next write) is shared or cached: copy it first.
        Blocks past it are never shared: fork shares only blocks holding tokens."""
        i = n // self.block_size
        if i >= len(table) or table[i] is None:
            return False
        block = table[i]
        return self.pool.ref[block] > 1 or self.pool.is_cached(block)

    def reserve(self, seq_id: int, num_tokens: int) -> bool:
        """Allocate (and copy a shared tail block) so ``seq_id`` can hold ``num_tokens`` in every
        group. Returns False, allocating nothing, when the pool has too few free + evictable blocks."""
        if num_tokens <= self._room.get(seq_id, 0):  # most decode steps (two calls a step: hot)
            return True
        n = self._len.get(seq_id, 0)
        if num_tokens <= n:
            return True
        bs = self.block_size
        want = -(-num_tokens // bs)
        held = self._tables.get(seq_id)
        if held:  # a decode step inside its last block: nothing to allocate or copy (checked inline: hot)
            i, ref, cached = n // bs, self.pool.ref, self.pool.is_cached
            for t in held:
                if len(t) < want:
                    break
                b = t[i] if i < len(t) else None
                if b is not None and (ref[b] > 1 or cached(b)):
                    break
            else:
                self._room[seq_id] = min(len(t) for t in held) * bs
                return True
        tables = held or [[] for _ in self.groups]
        copies = [self._needs_copy(t, n) for t in tables]
        need = sum(max(want - len(t), 0) + c for t, c in zip(tables, copies))
        if need > self.pool.num_available:
            return False
        self._tables.setdefault(seq_id, tables)
        self._len.setdefault(seq_id, 0)
        self._tokens.setdefault(seq_id, [])
        self._keys.setdefault(seq_id, [])
        for table, copy in zip(tables, copies):
            if copy:
                i = n // self.block_size
                old, new = table[i], self.pool.allocate()
                self._copy_block(old, new)
                self.pool.release(old)
                table[i] = new
            while len(table) < want:
                table.append(self.pool.allocate())
        self._stamp[seq_id] = next(_STAMPS)
        self._room[seq_id] = min(len(t) for t in tables) * bs
        return True

    # -- the prefix cache ---------------------------------------------------------------------------
    def adopt_prefix(self, seq_id: int, token_ids: Sequence[int]) -> int:
        """Start ``seq_id`` (holding nothing) from cached blocks: the longest whole-block prefix
        of ``P`` tokens such that every full group holds all its blocks and every local group
        the blocks of positions ``P - window + 1 .. P - 1`` (what the next query reads).

        Returns:
            ``P``, the tokens adopted.

        Raises:
            ValueError: ``seq_id`` already holds blocks.
        """
        if any(self._tables.get(seq_id) or ()):
            raise ValueError(f"sequence {seq_id} already holds KV")
        bs, pool = self.block_size, self.pool
        full = [g for g, grp in enumerate(self.groups) if grp.window == 0]
        local = [g for g, grp in enumerate(self.groups) if grp.window > 0]
        chain: list[tuple[bytes, bytes, Sequence[int]]] = []  # (key, parent, ids) of each block
        parent = ROOT_HASH
        for i in range(len(token_ids) // bs):
            ids = token_ids[i * bs:(i + 1) * bs]
            key = block_hash(parent, ids)
            if any(pool.find(self._key(key, g), parent, ids) is None for g in full):
                break
            chain.append((key, parent, ids))
            parent = key
        n = len(chain)

        def first_block(g: int, blocks: int) -> int:
            return window_start(self.groups[g].window, blocks * bs) // bs

        def window_cached(blocks: int) -> bool:
            return all(pool.find(self._key(chain[i][0], g), chain[i][1], chain[i][2]) is not None
                       for g in local for i in range(first_block(g, blocks), blocks))

        while n and not window_cached(n):
            n -= 1
        tables: list[list[int | None]] = []
        for g, grp in enumerate(self.groups):
            lo = first_block(g, n) if grp.window else 0
            tables.append([None] * lo + [pool.lookup(self._key(chain[i][0], g), chain[i][1], chain[i][2])
                                         for i in range(lo, n)])
        self._tables[seq_id], self._keys[seq_id] = tables, [key for key, _, _ in chain[:n]]
        self._stamp[seq_id] = next(_STAMPS)
        self._room.pop(seq_id, None)
        self._len[seq_id], self._tokens[seq_id] = n * bs, list(token_ids[:n * bs])
        return n * bs

    def commit(self, seq_id: int, end: int, token_ids: Sequence[int]) -> None:
        """``seq_id`` now caches ``end`` tokens, the last ``len(token_ids)`` of them new: key the
        blocks that became full (in every group), then release local blocks no later query sees
        (block ``i`` once ``(i + 1) * block_size <= end - window + 1``)."""
        bs = self.block_size
        self._len[seq_id] = end
        tokens, keys, tables = self._tokens[seq_id], self._keys[seq_id], self._tables[seq_id]
        tokens.extend(token_ids)
        while len(keys) < end // bs:
            i = len(keys)
            parent = keys[-1] if keys else ROOT_HASH
            ids = tokens[i * bs:(i + 1) * bs]
            key = block_hash(parent, ids)
            for g, table in enumerate(tables):
                self.pool.register(table[i], self._key(key, g), parent, ids)
            keys.append(key)
        for g, window in self._local:
            table = tables[g]
            for i in range(window_start(window, end) // bs - 1, -1, -1):  # newest first
                if table[i] is None:
                    break  # released before (released blocks are a prefix of the table)
                self.pool.release(table[i])
                table[i] = None
                self._stamp[seq_id] = next(_STAMPS)

    # -- lifetime ------------------------------------------------------------------------------------
    def trim(self, seq_id: int, n: int) -> None:
        """Rewind to ``n`` tokens; blocks past them are released.

        Raises:
            ValueError: a local group released blocks that position ``n`` would need again.
        """
        have = self._len.get(seq_id)
        if have is None or n >= have:
            return
        n, bs = max(n, 0), self.block_size
        tables, keep = self._tables[seq_id], -(-n // bs)
        for grp, table in zip(self.groups, tables):
            if grp.window and None in table[window_start(grp.window, n) // bs:keep]:
                raise ValueError(f"sequence {seq_id}: cannot rewind to {n} tokens, past its sliding window")
        for table in tables:
            for block in reversed(table[keep:]):
                if block is not None:
                    self.pool.release(block)
            del table[keep:]
        self._stamp[seq_id] = next(_STAMPS)
        self._room.pop(seq_id, None)
        self._len[seq_id] = n
        del self._tokens[seq_id][n:]
        del self._keys[seq_id][n // bs:]

    def fork(self, src: int, dst: int) -> None:
        """Share ``src``'s blocks that hold tokens with ``dst`` (copied when either writes into a
        shared one, see :meth:`reserve`).

        Raises:
            ValueError: ``dst`` already holds blocks.
        """
        if any(self._tables.get(dst) or ()):
            raise ValueError(f"sequence {dst} already holds KV")
        n = self._len.get(src, 0)
        held = -(-n // self.block_size)
        tables = [list(t[:held]) for t in self._tables.get(src) or [[] for _ in self.groups]]
        for table in tables:
            for block in table:
                if block is not None:
                    self.pool.share(block)
        self._tables[dst], self._len[dst] = tables, n
        self._stamp[dst] = next(_STAMPS)
        self._room.pop(src, None)  # its block being written may be shared now (copied on its next write)
        self._room.pop(dst, None)
        self._tokens[dst], self._keys[dst] = list(self._tokens.get(src, [])), list(self._keys.get(src, []))

    def free(self, seq_id: int) -> None:
        """Release ``seq_id``'s blocks, last first, so the LRU evicts a prefix's tail before its
        head; unknown ids are ignored."""
        for table in self._tables.pop(seq_id, []):
            for block in reversed(table):
                if block is not None:
                    self.pool.release(block)
        for state in (self._len, self._tokens, self._keys, self._stamp, self._room):
            state.pop(seq_id, None)
