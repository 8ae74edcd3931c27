"""BlockPool: the bookkeeping of paged KV — free list, reference counts and the prefix cache.

No tensors here (those live in :class:`monobatch.kv.paged.PagedKv`); a block is an int.

Prefix cache (vLLM's automatic prefix caching, SGLang's radix cache in block form): a *full*
block is keyed by a chained digest ``blake2b(parent_key || token_ids)`` (128 bits), so one key
names the whole prefix up to the block's end. The digest is cryptographic because a collision
would hand a sequence KV computed after another prefix, and Python's ``hash`` of a tuple can be
collided on purpose (vLLM's CVE-2025-25183 was this). A hit is also confirmed by comparing the
stored parent key and token ids. A block whose last reference goes away keeps its key and becomes
*evictable*: it still serves hits until a fresh block is needed, then the least recently
released one is reused (LRU).

States of a block::

    free  --allocate-->  referenced  --release (ref 0, no key)-->  free
                          |   ^
              register key|   |lookup hit
                          v   |
                       referenced+key --release (ref 0)--> evictable --evict (LRU)--> free
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from typing import Sequence

#: The parent key of a sequence's first block.
ROOT_HASH = b""


def block_hash(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The chained key of a full block (16 bytes): depends on every token of the prefix it ends."""
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


class BlockPool:
    """Blocks ``0 .. num_blocks-1`` with reference counts, a free list and the prefix cache.

    Args:
        num_blocks: blocks in the pool.

    Attributes:
        ref: reference count per block (sequences whose block table holds it).
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        # A stack: the most recently freed block is reused first (its pages are touched and warm;
        # a FIFO would walk the whole pool and fault in fresh pages on every request).
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 with a key, oldest first
        self._key: dict[int, tuple[bytes, bytes, tuple[int, ...]]] = {}  # block -> (key, parent, ids)
        self._by_hash: dict[bytes, int] = {}  # key -> block

    # -- counts -------------------------------------------------------------------------------
    @property
    def num_available(self) -> int:
        """Blocks an allocation may take now: free plus evictable."""
        return len(self._free) + len(self._evictable)

    @property
    def num_evictable(self) -> int:
        """Unreferenced blocks kept for the prefix cache."""
        return len(self._evictable)

    @property
    def num_referenced(self) -> int:
        """Blocks held by at least one sequence."""
        return self.num_blocks - self.num_available

    # -- allocation ---------------------------------------------------------------------------
    def allocate(self) -> int:
        """A fresh block with reference count 1, evicting the least recently released cached
        block when the free list is empty.

        Raises:
            MemoryError: no block is free or evictable (callers check :attr:`num_available`).
        """
        if self._free:
            block = self._free.pop()
        elif self._evictable:
            block, _ = self._evictable.popitem(last=False)
            self._forget(block)
        else:
            raise MemoryError("KV block pool exhausted")
        self.ref[block] = 1
        return block

    def share(self, block: int) -> None:
        """One more sequence holds ``block`` (fork)."""
        assert self.ref[block] > 0, "sharing an unreferenced block"
        self.ref[block] += 1

    def release(self, block: int) -> None:
        """One holder fewer; at zero the block becomes evictable (keyed) or free."""
        assert self.ref[block] > 0, f"block {block} released more often than held"
        self.ref[block] -= 1
        if self.ref[block] == 0:
            if block in self._key:
                self._evictable[block] = None  # most recently released: evicted last
            else:
                self._free.append(block)

    # -- prefix cache ---------------------------------------------------------------------------
    def register(self, block: int, key: bytes, parent: bytes, token_ids: Sequence[int]) -> None:
        """Key a full, computed, referenced block. A prefix already cached in another block keeps
        that block (two sequences computed it at once); this one stays private."""
        if key in self._by_hash or block in self._key:
            return
        self._key[block] = (key, parent, tuple(token_ids))
        self._by_hash[key] = block

    def find(self, key: bytes, parent: bytes, token_ids: Sequence[int]) -> int | None:
        """The cached block for this prefix (its key, parent key and token ids all match), taking
        no reference; None on a miss."""
        block = self._by_hash.get(key)
        if block is None or self._key[block] != (key, parent, tuple(token_ids)):
            return None
        return block

    def lookup(self, key: bytes, parent: bytes, token_ids: Sequence[int]) -> int | None:
        """The cached block for this prefix, taken with one more reference; None on a miss."""
        block = self.find(key, parent, token_ids)
        if block is None:
            return None
        if self.ref[block] == 0:
            del self._evictable[block]
        self.ref[block] += 1
        return block

    def is_cached(self, block: int) -> bool:
        """True when ``block`` is keyed in the prefix cache (its contents must not change)."""
        return block in self._key

    def clear_cache(self) -> int:
        """Drop every evictable block from the prefix cache (vLLM's ``reset_prefix_cache``): they
        become free. Blocks held by sequences keep their keys. Returns how many were freed."""
        freed = list(self._evictable)
        self._evictable.clear()
        for block in freed:
            self._forget(block)
            self._free.append(block)
        return len(freed)

    def _forget(self, block: int) -> None:
        key, _, _ = self._key.pop(block)
        del self._by_hash[key]
