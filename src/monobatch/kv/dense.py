"""DenseKv: one contiguous KV buffer per sequence, grown in chunks up to the context length.

Dense storage has no blocks and so no prefix cache: every prompt is computed in full (see the
ADR). It is the fastest layout at B=1 — attention reads a contiguous slice, no gather.

On CUDA (Triton) each chunk's attention (one launch per chunk and layer) is the varlen kernel
paged storage runs
(:func:`monobatch.kernels.varlen_attention.varlen_paged_attention`), reading the buffer as
blocks of :data:`~monobatch.defaults.DENSE_KV_GROWTH` tokens in order, so dense and paged storage
compute a token with the same kernel and tile — the same bits under ``--deterministic``.

A sliding-window layer (ADR 0005) reads only its window of the buffer; the buffer keeps every
position (without blocks there is nothing to give back).
"""

from __future__ import annotations

from typing import Sequence

import torch

from monobatch import defaults
from monobatch.batch import StepBatch
from monobatch.errors import InsufficientMemoryError
from monobatch.kernels import cpu_ops
from monobatch.kernels.paged_decode import triton_usable
from monobatch.kernels.varlen_attention import VarlenMeta, build_meta, tokens_per_tile, varlen_paged_attention
from monobatch.kv.attention import attend_chunk
from monobatch.kv.store import KvStore, KvUsage


class DenseKv(KvStore):
    """Dense storage: sequence -> buffer ``[layers, 2, capacity, n_kv, hd]`` (token-major).

    Capacity grows in steps of ``growth`` tokens (copying the buffer), capped at
    ``max_seq_len``.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_seq_len: int,
                 dtype: torch.dtype, device: torch.device, growth: int = defaults.DENSE_KV_GROWTH,
                 windows: Sequence[int] | None = None) -> None:
        super().__init__(num_layers, num_kv_heads, head_dim, max_seq_len, dtype, device, windows)
        self.growth = growth
        self._buf: dict[int, torch.Tensor] = {}
        self._len: dict[int, int] = {}
        #: the varlen kernel on CUDA; the chunk layouts of the prepared step, built at its first layer
        self.varlen = triton_usable(self.device, head_dim)
        self._metas: list[VarlenMeta] | None = None
        #: CPU, float32: decode chunks (every chunk in deterministic mode) stored and attended in
        #: place by one call per chunk and layer (:func:`cpu_ops.attention`, the buffer as one block)
        self.cpu_kernel = not self.varlen and cpu_ops.enabled(torch.empty(0, dtype=dtype, device=self.device))
        #: per chunk of the prepared step: (write slots, kernel rows, table) or None (torch path)
        self._kernel_args: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None] = []
        self._kernel_batch: StepBatch | None = None  # the step they were built for

    def seq_len(self, seq_id: int) -> int:
        return self._len.get(seq_id, 0)

    def num_sequences(self) -> int:
        return len(self._buf)

    def capacity(self, seq_id: int) -> int:
        """Tokens ``seq_id``'s buffer holds before it must grow (0 when it has none)."""
        buf = self._buf.get(seq_id)
        return 0 if buf is None else buf.shape[2]

    def usage(self) -> KvUsage:
        return KvUsage(len(self._buf), 0, sum(b.numel() * b.element_size() for b in self._buf.values()))

    def describe(self) -> str:
        grown = (f"grown by {self.growth} tokens up to {self.max_seq_len}" if self.growth < self.max_seq_len
                 else f"of {self.max_seq_len} tokens")
        return (f"KV cache: dense, one buffer per sequence {grown} "
                f"({self.bytes_per_token / 1024:.0f} KiB per token, {str(self.dtype).removeprefix('torch.')})")

    def _reserve(self, seq_id: int, need: int) -> None:
        cap = self.capacity(seq_id)
        if need <= cap:
            return
        new_cap = min(-(-need // self.growth) * self.growth, self.max_seq_len)
        try:
            new = torch.empty(self.num_layers, 2, new_cap, self.num_kv_heads, self.head_dim,
                              dtype=self.dtype, device=self.device)
        except RuntimeError as e:  # CPU allocators raise RuntimeError; CUDA's OOM error subclasses it
            raise InsufficientMemoryError(
                f"out of memory growing the KV cache of sequence {seq_id} to {new_cap} tokens "
                f"({self.num_sequences()} sequences hold {self.used_bytes() / 2**20:.0f} MiB); "
                "lower --ctx-size or run fewer sequences at once") from e
        if cap:
            n = self._len[seq_id]
            new[:, :, :n] = self._buf[seq_id][:, :, :n]
        self._buf[seq_id] = new

    def prepare(self, batch: StepBatch) -> None:
        """Grow each chunk's buffer to fit (see :meth:`KvStore.prepare`).

        Raises:
            ValueError: a gap or an overflow of the context. InsufficientMemoryError: the
                allocator cannot grow a buffer (the scheduler aborts the step's sequences).
        """
        for c in batch.chunks:
            self.check_chunk(c)
            self._reserve(c.seq_id, c.end_pos)
            self._len.setdefault(c.seq_id, 0)
        self._metas = None
        # per kernel chunk: write slots (its positions), rows (row, position, table 0), the table [0]
        self._kernel_args = [(torch.arange(c.pos, c.end_pos), torch.tensor([(i, c.pos + i, 0) for i in range(c.length)]),
                              torch.zeros(1, dtype=torch.int32))
                             if self.cpu_kernel and (c.length == 1 or batch.row_tile > 0) else None
                             for c in batch.chunks]
        self._kernel_batch = batch

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if self.varlen and self._metas is None:  # the step's first layer: each chunk's layout
            det, g = self.batch_invariant or batch.row_tile > 0, self.growth
            bt = tokens_per_tile(q.shape[1], self.num_kv_heads, det)
            self._metas = [build_meta([(0, c.length, c.pos)], [list(range(-(-c.end_pos // g)))], bt, self.device,
                                      fixed_split=det) for c in batch.chunks]
        for i, c in enumerate(batch.chunks):
            s, e = c.start, c.start + c.length
            cache = self._buf[c.seq_id][layer]  # (2, cap, n_kv, hd)
            if self._kernel_batch is batch and self._kernel_args[i] is not None:  # stores and attends in place
                write, rows, table = self._kernel_args[i]
                cpu_ops.attention(q[s:e], k[s:e], v[s:e], cache[0], cache[1], write, rows, table, cache.shape[1],
                                  self.windows[layer], out[s:e])
                continue
            cache[0, c.pos:c.end_pos] = k[s:e]
            cache[1, c.pos:c.end_pos] = v[s:e]
            if self.varlen:  # the buffer as blocks of `growth` tokens, block i = tokens i*g .. (i+1)*g - 1
                out[s:e] = varlen_paged_attention(q[s:e], cache[0], cache[1], self._metas[i], self.growth,
                                                  window=self.windows[layer])
            else:
                ks = self.key_start(layer, c.pos)  # 0 unless a window hides the oldest positions
                out[s:e] = attend_chunk(q[s:e], cache[0, ks:c.end_pos], cache[1, ks:c.end_pos], c.pos,
                                        batch.row_tile > 0, self.windows[layer], ks)
        return out

    def commit(self, batch: StepBatch) -> None:
        for c in batch.chunks:
            self._len[c.seq_id] = c.end_pos

    def trim(self, seq_id: int, n: int) -> None:
        if seq_id in self._len:
            self._len[seq_id] = min(self._len[seq_id], max(n, 0))

    def fork(self, src: int, dst: int) -> None:
        if self.seq_len(dst) or dst in self._buf:
            raise ValueError(f"sequence {dst} already holds KV")
        n = self.seq_len(src)
        if n:
            self._reserve(dst, n)
            self._buf[dst][:, :, :n] = self._buf[src][:, :, :n]
        self._len[dst] = n

    def free(self, seq_id: int) -> None:
        self._buf.pop(seq_id, None)
        self._len.pop(seq_id, None)
