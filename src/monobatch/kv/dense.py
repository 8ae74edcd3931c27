"""DenseKv: one contiguous KV buffer per sequence, grown in chunks up to the context length."""

from __future__ import annotations

import torch

from monobatch import defaults
from monobatch.engine.batch import StepBatch
from monobatch.errors import InsufficientMemoryError
from monobatch.kv.attention import attend_chunk
from monobatch.kv.store import KvStore


class DenseKv(KvStore):
    """Dense storage: sequence -> buffer ``[layers, 2, n_kv, capacity, hd]``.

    Capacity grows in steps of ``growth`` tokens (copying the buffer), capped at
    ``max_seq_len``. Fastest at B=1: attention reads a contiguous slice, no gather.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_seq_len: int,
                 dtype: torch.dtype, device: torch.device, growth: int = defaults.DENSE_KV_GROWTH) -> None:
        super().__init__(num_layers, num_kv_heads, head_dim, max_seq_len, dtype, device)
        self.growth = growth
        self._buf: dict[int, torch.Tensor] = {}
        self._len: dict[int, int] = {}

    def seq_len(self, seq_id: int) -> int:
        return self._len.get(seq_id, 0)

    def num_sequences(self) -> int:
        return len(self._buf)

    def used_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buf.values())

    def _reserve(self, seq_id: int, need: int) -> None:
        buf = self._buf.get(seq_id)
        cap = 0 if buf is None else buf.shape[3]
        if need <= cap:
            return
        new_cap = min(-(-need // self.growth) * self.growth, self.max_seq_len)
        try:
            new = torch.empty(self.num_layers, 2, self.num_kv_heads, new_cap, self.head_dim,
                              dtype=self.dtype, device=self.device)
        except RuntimeError as e:  # CPU allocators raise RuntimeError; CUDA's OOM error subclasses it
            raise InsufficientMemoryError(
                f"out of memory growing the KV cache of sequence {seq_id} to {new_cap} tokens "
                f"({self.num_sequences()} sequences hold {self.used_bytes() / 2**20:.0f} MiB); "
                "lower --ctx-size or run fewer sequences at once") from e
        if buf is not None:
            n = self._len[seq_id]
            new[:, :, :, :n] = buf[:, :, :, :n]
        self._buf[seq_id] = new

    def prepare(self, batch: StepBatch) -> None:
        """Grow each chunk's buffer to fit (see :meth:`KvStore.prepare`).

        Raises:
            ValueError: a gap or an overflow of the context. InsufficientMemoryError: the
                allocator cannot grow a buffer (the scheduler aborts the step's sequences).
        """
        for c in batch.chunks:
            have = self.seq_len(c.seq_id)
            if c.pos != have:
                raise ValueError(f"sequence {c.seq_id}: chunk starts at {c.pos} but {have} tokens are cached")
            if c.end_pos > self.max_seq_len:
                raise ValueError(f"sequence {c.seq_id}: {c.end_pos} tokens exceed the context ({self.max_seq_len})")
            self._reserve(c.seq_id, c.end_pos)
            self._len.setdefault(c.seq_id, 0)

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        out = torch.empty_like(q)
        for c in batch.chunks:
            s, e = c.start, c.start + c.length
            cache = self._buf[c.seq_id][layer]  # (2, n_kv, cap, hd)
            cache[0, :, c.pos:c.end_pos] = k[s:e].transpose(0, 1)
            cache[1, :, c.pos:c.end_pos] = v[s:e].transpose(0, 1)
            out[s:e] = attend_chunk(q[s:e], cache[0, :, :c.end_pos], cache[1, :, :c.end_pos], c.pos)
        return out

    def commit(self, batch: StepBatch) -> None:
        for c in batch.chunks:
            self._len[c.seq_id] = c.end_pos

    def trim(self, seq_id: int, n: int) -> None:
        if seq_id in self._len:
            self._len[seq_id] = min(self._len[seq_id], max(n, 0))

    def free(self, seq_id: int) -> None:
        self._buf.pop(seq_id, None)
        self._len.pop(seq_id, None)
