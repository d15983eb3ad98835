"""The server's `/metrics`, in Prometheus' text format through `prometheus_client`.

Counts and gauges are read from the server, engine thread and engine when Prometheus scrapes
(a custom collector: nothing to keep in step), and the latencies are histograms the engine
feeds as tokens come out: time to first token (from the moment the sequence is created,
after its prompt is tokenized, to its first sampled token, queueing included) and the time
between consecutive tokens of a sequence. Each server has its own registry, so several in
one process (the tests) never share a metric.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

# Seconds: from a few milliseconds (a small model's decode step) to a minute in the queue.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
CONTENT_TYPE = CONTENT_TYPE_LATEST


class ServeMetrics:
    def __init__(self, server):
        self.registry = CollectorRegistry()
        self.ttft = Histogram("llmsplit_time_to_first_token_seconds",
                              "From a sequence's creation (prompt tokenized) to its first token.",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("llmsplit_inter_token_latency_seconds",
                             "Between consecutive tokens of one sequence.", buckets=LATENCY_BUCKETS,
                             registry=self.registry)
        self.registry.register(_Live(server))

    def observe(self, first: bool, seconds: float) -> None:
        """The engine's latency hook (engine thread): a first token, or the next one."""
        (self.ttft if first else self.itl).observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _Live:
    """What the server, its engine thread and engine count right now."""

    def __init__(self, server):
        self.server = server

    def collect(self):
        s = self.server
        c = s.scheduler.stats()
        statuses = CounterMetricFamily("llmsplit_http_responses", "HTTP responses sent, by status code.",
                                       labels=["status"])
        for status, n in sorted(s.statuses.items()):
            statuses.add_metric([str(status)], n)
        yield statuses
        yield CounterMetricFamily("llmsplit_requests_finished", "Generation requests answered in full.",
                                  value=s.scheduler.finished_requests)
        yield CounterMetricFamily("llmsplit_requests_failed", "Generation requests failed by the engine or shutdown.",
                                  value=s.scheduler.failed_requests)
        gauges = [("requests_preparing", "Requests in their chat template or tokenizer (worker threads).",
                   s.off_loop.active),
                  ("requests_running", "Sequences in the running batch.", c["running"]),
                  ("requests_waiting", "Sequences accepted and waiting for a batch slot (queue length).", c["waiting"]),
                  ("requests_preempted", "Waiting sequences that were preempted (to be recomputed).", c["preempted"]),
                  ("kv_blocks_used", "KV-cache blocks held by sequences.", c["kv_blocks_used"]),
                  ("kv_blocks_total", "KV-cache blocks in the pool.", c["kv_blocks_total"]),
                  ("kv_usage", "Share of the KV-cache pool held by sequences.",
                   c["kv_blocks_used"] / c["kv_blocks_total"]),
                  ("kv_tokens_reserved", "Token slots of the blocks held by sequences.", c["kv_tokens_reserved"]),
                  ("kv_tokens_used", "Tokens those blocks hold (the rest is the waste of last blocks).",
                   c["kv_tokens_used"]),
                  ("generated_tokens_per_second", "Tokens sampled per second over the last 10 s.", c["tokens_per_s"])]
        for name, help_text, value in gauges:
            yield GaugeMetricFamily(f"llmsplit_{name}", help_text, value=value)
        counters = [("prompt_tokens", "Prompt tokens prefilled.", "prompt_tokens"),
                    ("generated_tokens", "Tokens sampled.", "generated_tokens"),
                    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_cache_queries"),
                    ("prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed).",
                     "prefix_cache_hits"),
                    ("preemptions", "Sequences preempted for want of KV blocks (recomputed later).", "preemptions"),
                    ("recomputed_tokens", "Tokens prefilled again after a preemption.", "recomputed_tokens")]
        for name, help_text, key in counters:
            yield CounterMetricFamily(f"llmsplit_{name}", help_text, value=c[key])
        queries = c["prefix_cache_queries"]
        yield GaugeMetricFamily("llmsplit_prefix_cache_hit_rate", "Prompt tokens found cached over those looked up.",
                                value=c["prefix_cache_hits"] / queries if queries else 0.0)
        if "speculative_proposed_tokens" in c:  # --speculative
            yield from _speculative_metrics(c)


def _speculative_metrics(c: dict):
    """Speculative decoding's counters (engine/speculative.py), and the two rates they give."""
    for name, help_text in (("proposed_tokens", "Tokens proposed and verified."),
                            ("accepted_tokens", "Proposed tokens the model took as its own."),
                            ("verify_steps", "Steps of one sequence that verified proposals."),
                            ("emitted_tokens", "Tokens those steps produced (accepted, plus the model's own one).")):
        yield CounterMetricFamily(f"llmsplit_speculative_{name}", help_text, value=c[f"speculative_{name}"])
    proposed, steps = c["speculative_proposed_tokens"], c["speculative_verify_steps"]
    yield GaugeMetricFamily("llmsplit_speculative_acceptance_rate", "Accepted over proposed tokens.",
                            value=c["speculative_accepted_tokens"] / proposed if proposed else 0.0)
    yield GaugeMetricFamily("llmsplit_speculative_tokens_per_step", "Tokens a verifying step produced, on average.",
                            value=c["speculative_emitted_tokens"] / steps if steps else 0.0)
