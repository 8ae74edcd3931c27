"""KvStore: the one interface attention reads and writes the KV cache through.

Storages behind it: :class:`monobatch.kv.dense.DenseKv` (a contiguous buffer per sequence) and,
later, paged storage with a prefix cache. The forward never touches a storage's layout.

Per step the engine calls ``prepare(batch)`` (reserve room, check positions), then each layer
calls ``attend(layer, q, k, v, batch)`` (store the step's K/V, attend), then ``commit(batch)``
(the new tokens become part of each sequence's cached length).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from monobatch.engine.batch import StepBatch


class KvStore(ABC):
    """Key/value cache for any number of sequences, addressed by sequence id.

    Args:
        num_layers, num_kv_heads, head_dim: the model's KV shape.
        max_seq_len: the context length; no sequence may grow past it (tokens).
        dtype, device: storage dtype and device (the model's compute dtype).
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_seq_len: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.max_seq_len = max_seq_len
        self.dtype = dtype
        self.device = torch.device(device)

    @property
    def bytes_per_token(self) -> int:
        """KV bytes one token occupies across all layers (K and V)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * torch.tensor([], dtype=self.dtype).element_size()

    @abstractmethod
    def seq_len(self, seq_id: int) -> int:
        """Tokens cached for ``seq_id`` (0 for an unknown sequence)."""

    @abstractmethod
    def prepare(self, batch: StepBatch) -> None:
        """Reserve room for every chunk of ``batch``.

        Raises:
            ValueError: a chunk does not start at its sequence's cached length, or would pass
                ``max_seq_len``.
        """

    @abstractmethod
    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: StepBatch) -> torch.Tensor:
        """Store this step's keys/values of ``layer`` and return attention outputs.

        Args:
            q: ``[T, n_q, hd]``; k, v: ``[T, n_kv, hd]`` for the batch's T tokens (RoPE applied).

        Returns:
            ``[T, n_q, hd]``, each token attending causally to its own sequence only.
        """

    @abstractmethod
    def commit(self, batch: StepBatch) -> None:
        """Mark the step's tokens as cached (after every layer ran ``attend``)."""

    @abstractmethod
    def trim(self, seq_id: int, n: int) -> None:
        """Keep only the first ``n`` cached tokens of ``seq_id`` (rewind); ``n`` >= current is a no-op."""

    @abstractmethod
    def free(self, seq_id: int) -> None:
        """Release everything held for ``seq_id``; unknown ids are ignored."""

    @abstractmethod
    def num_sequences(self) -> int:
        """Sequences currently holding KV."""

    def used_bytes(self) -> int:
        """Bytes of KV storage currently allocated (for metrics)."""
        return 0
