"""``GET /metrics``: Prometheus text from prometheus_client, one registry per app.

Gauges and counters the scheduler owns (running/waiting requests, KV usage, prefix-cache queries
and hits, prompt and generation tokens, preemptions) are read from the engine thread's latest
published stats by a custom collector, so a scrape never waits for a step (it shows the state
after the last step: during a long prefill chunk, one step behind). Latency histograms (TTFT,
inter-token latency, end-to-end; timed from the HTTP request's arrival) and finished requests
per reason are observed on the event loop when a request's final output arrives; an aborted
sequence counts in ``request_success{finished_reason="abort"}`` and TTFT/ITL for the tokens it
got, not in the end-to-end histogram.
"""

from __future__ import annotations

from typing import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from monobatch.engine.finish import RowOutput
from monobatch.engine.sequence import FinishReason

PREFIX = "monobatch_"
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                    20.0, 40.0, 80.0)

#: name -> (kind, help, stats field)
_ENGINE_METRICS = {
    "num_requests_running": ("gauge", "Sequences running in the scheduler (holding KV).", "num_running"),
    "num_requests_waiting": ("gauge", "Sequences waiting for admission.", "num_waiting"),
    "kv_cache_usage_perc": ("gauge", "Fraction of KV blocks in use (0..1).", "kv_usage"),
    "kv_cache_used_blocks": ("gauge", "KV blocks referenced by running sequences.", "kv_used_blocks"),
    "kv_cache_total_blocks": ("gauge", "KV blocks in the pool.", "kv_total_blocks"),
    "kv_cache_cached_blocks": ("gauge", "Unreferenced KV blocks kept for the prefix cache (evictable).",
                               "kv_cached_blocks"),
    "kv_cache_used_bytes": ("gauge", "KV bytes held by sequences.", "kv_used_bytes"),
    "prefix_cache_queries": ("counter", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
    "prefix_cache_hits": ("counter", "Prompt tokens adopted from the prefix cache.", "prefix_cache_hits"),
    "prompt_tokens": ("counter", "Prompt tokens of admitted requests.", "prompt_tokens_total"),
    "generation_tokens": ("counter", "Generated tokens.", "generation_tokens_total"),
    "num_preemptions": ("counter", "Sequences preempted (recomputed later).", "num_preemptions"),
    "num_requests_finished": ("counter", "Sequences that ended, any finish reason.", "num_requests_finished"),
    "paged_attention_calls": ("counter", "Attention calls on paged KV storage (one per layer per step; 0 on dense).",
                              "paged_attention_calls"),
}


class _EngineCollector:
    """Yields the scheduler's stats as Prometheus metric families at scrape time."""

    def __init__(self, read: Callable[[], dict | None]) -> None:
        self._read = read

    def collect(self) -> Iterator[Metric]:
        stats = self._read()
        if stats is None:  # still loading
            return
        for name, (kind, help_text, field) in _ENGINE_METRICS.items():
            family = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            yield family(PREFIX + name, help_text, value=float(stats[field]))


class ServerMetrics:
    """The app's registry and the metrics observed on the HTTP side.

    Args:
        read_stats: returns the engine's latest stats dict, or None while the model loads.
    """

    def __init__(self, read_stats: Callable[[], dict | None]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(read_stats))
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "HTTP arrival to first token.",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Time between two tokens of a request.",
                             buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds",
                             "HTTP arrival to the last token (sequences that were not aborted).",
                             buckets=_LATENCY_BUCKETS + (160.0, 320.0), registry=self.registry)
        self.finished = Counter(PREFIX + "request_success", "Sequences finished, by finish reason.",
                                ["finished_reason"], registry=self.registry)

    def observe_final(self, out: RowOutput) -> None:
        """Record a sequence's final output (timings and finish reason)."""
        self.finished.labels(out.finish_reason.value).inc()
        m = out.metrics
        if m is None:
            return
        if m.first_token_time is not None:
            self.ttft.observe(m.ttft_ms / 1000)
        if out.finish_reason is not FinishReason.ABORT:
            self.e2e.observe(max(m.finished_time - m.arrival_time, 0.0))
        for gap_ms in m.itl_ms:
            self.itl.observe(gap_ms / 1000)

    def render(self) -> bytes:
        """The exposition text."""
        return generate_latest(self.registry)
