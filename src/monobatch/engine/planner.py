"""PrefillPlan: the single prefill planner — which prompt tokens come from the prefix cache and
how many are computed this step. Every path (CLI, server, Python API, preemption's recompute)
plans through it.

For a sequence of ``num_tokens`` tokens of which ``num_computed`` have KV::

    [ adopted from the prefix cache | computed in earlier steps | this step's chunk | later ]
      whole blocks, <= num_tokens-1                               <= prefill_chunk
                                                                  <= what is left of the
                                                                     step's token budget

The last token is always computed (its logits draw the next token), so adoption stops at
``num_tokens - 1``.
"""

from __future__ import annotations

from dataclasses import dataclass

from monobatch import defaults
from monobatch.engine.sequence import Sequence
from monobatch.kv.store import KvStore


@dataclass(slots=True)
class PrefillPlan:
    """Chunk size and per-step token budget (tokens), shared by all sequences.

    Attributes:
        prefill_chunk: most tokens of one sequence computed in one step (default 2048).
        token_budget: most tokens computed in one step across all sequences
            (``--max-num-batched-tokens``).
    """

    prefill_chunk: int
    token_budget: int

    def adopt_cached_prefix(self, seq: Sequence, kv: KvStore) -> int:
        """Start ``seq`` (holding no KV) from the prefix cache; sets ``num_computed``.

        Returns:
            Tokens adopted (0 when bypassed, or for storages without a prefix cache).
        """
        if seq.bypass_prefix_cache or kv.block_size is None:
            seq.num_computed = 0
            return 0
        seq.num_computed = kv.adopt_prefix(seq.seq_id, seq.token_slice(0, seq.num_tokens - 1))
        return seq.num_computed

    def chunk_len(self, seq: Sequence, budget: int) -> int:
        """Tokens of ``seq`` to compute now, given ``budget`` tokens left in this step (a prompt
        whose logprobs were asked for goes in chunks of at most ``PROMPT_LOGPROBS_CHUNK``)."""
        chunk = min(self.prefill_chunk, defaults.PROMPT_LOGPROBS_CHUNK) if seq.wants_prompt_logprobs else self.prefill_chunk
        return max(min(seq.num_uncomputed, chunk, budget), 0)

    @staticmethod
    def wants_all_logits(seq: Sequence, start: int) -> bool:
        """True when the chunk starting at ``start`` holds prompt positions whose next-token
        logprobs are still needed (every row of it then returns logits)."""
        return seq.wants_prompt_logprobs and start < len(seq.prompt_ids) - 1
