"""SchedulerStats: what the engine reports for a server's /metrics (Prometheus names in the ADR).

Counters are totals since start; gauges are the state after the last step. Per-request TTFT and
ITL come with each request's final :class:`monobatch.engine.finish.RequestMetrics`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SchedulerStats:
    """A snapshot of the decode loop.

    Attributes:
        num_running / num_waiting: sequences admitted (holding KV) / queued (gauges).
        kv_used_blocks / kv_total_blocks: paged blocks referenced / in the pool (dense storage:
            sequences holding a buffer / 0).
        kv_cached_blocks: unreferenced blocks kept for the prefix cache (evictable).
        kv_used_bytes: KV bytes held by sequences.
        prefix_cache_queries / prefix_cache_hits: prompt tokens looked up in / served by the
            prefix cache at a request's first admission (counters, tokens; vLLM's definition;
            a preempted request's recompute is not counted again).
        prompt_tokens_total / generation_tokens_total: prompt tokens of admitted requests (once
            each) / tokens generated (counters).
        num_preemptions: sequences preempted (recompute) for lack of KV blocks (counter).
        num_requests_finished: requests that ended, any finish_reason (counter).
        paged_attention_calls: attention calls served by paged KV storage, one per layer per
            step (counter; 0 on dense storage): ``monobatch parity``'s proof that paged attention ran.
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_used_blocks: int = 0
    kv_total_blocks: int = 0
    kv_cached_blocks: int = 0
    kv_used_bytes: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prompt_tokens_total: int = 0
    generation_tokens_total: int = 0
    num_preemptions: int = 0
    num_requests_finished: int = 0
    paged_attention_calls: int = 0

    @property
    def kv_usage(self) -> float:
        """Fraction of the KV pool referenced by sequences, 0..1 (0 for dense storage)."""
        return self.kv_used_blocks / self.kv_total_blocks if self.kv_total_blocks else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """hits / queries (0 before any query)."""
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
