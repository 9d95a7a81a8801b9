"""Prometheus metrics with vLLM's names under the ``pagedllm:`` prefix.

Every metric carries a ``model_name`` label (the first served name). Metrics live in a
``CollectorRegistry`` owned by the logger (no process-global state); the server exposes it at
``GET /metrics``, without prometheus-client's ``*_created`` series. Only metrics of features that
exist are exported.

| name | type | meaning |
|---|---|---|
| pagedllm:num_requests_running | gauge | requests in the running queue |
| pagedllm:num_requests_waiting | gauge | requests waiting (new and preempted) |
| pagedllm:kv_cache_usage_perc | gauge | fraction of KV blocks in use, 0..1 |
| pagedllm:num_free_blocks | gauge | KV blocks in the free queue |
| pagedllm:num_total_blocks | gauge | KV blocks in the pool |
| pagedllm:num_requests_swapped | gauge | requests whose KV blocks are in the host pool (swap preemption) |
| pagedllm:num_preemptions_total{mode} | counter | requests preempted, by mode: recompute, swap |
| pagedllm:prefix_cache_queries_total | counter | tokens looked up in the prefix cache (admitted requests' tokens) |
| pagedllm:prefix_cache_hits_total | counter | of those, tokens found cached (hit rate = hits / queries) |
| pagedllm:prompt_tokens_total | counter | prompt tokens of requests that got their first token |
| pagedllm:generation_tokens_total | counter | sampled tokens |
| pagedllm:request_success_total{finished_reason} | counter | finished requests: stop, length, abort |
| pagedllm:time_to_first_token_seconds | histogram | arrival to first token |
| pagedllm:inter_token_latency_seconds | histogram | time between a request's tokens |
| pagedllm:e2e_request_latency_seconds | histogram | arrival to finish |
| pagedllm:iteration_tokens_total | histogram | tokens in one forward (prefill + decode) |
| pagedllm:request_prompt_tokens | histogram | prompt length of finished requests |
| pagedllm:request_generation_tokens | histogram | generated tokens of finished requests |
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagedllm.core.sched_output import SchedulerStats
from pagedllm.metrics.stats import IterationStats

_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0]
_E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                480.0, 960.0, 1920.0, 7680.0]
FINISH_REASONS = ("stop", "length", "abort")

# No `*_created` series (one per counter / histogram child, a start timestamp nobody charts), as
# vLLM. prometheus-client reads this process-wide switch at every collection.
prometheus_client.disable_created_metrics()


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``max_value`` (vLLM's token-count buckets)."""
    buckets, exponent = [], 0
    while True:
        for m in (1, 2, 5):
            value = m * 10 ** exponent
            if value > max_value:
                return buckets
            buckets.append(value)
        exponent += 1


class PrometheusStatLogger:
    """A ``StatLogger`` that updates Prometheus metrics.

    Args:
        model_name: value of the ``model_name`` label.
        max_model_len: tokens per request (upper bucket of the token-count histograms).
        max_num_batched_tokens: tokens per step (upper bucket of ``iteration_tokens_total``).
        registry: where the metrics are registered; a fresh one when None.
        initial: scheduler stats to show before the first step (e.g. the pool's block count).
    """

    def __init__(self, model_name: str, max_model_len: int, max_num_batched_tokens: int,
                 registry: CollectorRegistry | None = None, initial: SchedulerStats | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self._labels = {"model_name": model_name}

        def gauge(name, doc):
            return Gauge(name, doc, labels, registry=r).labels(**self._labels)

        def counter(name, doc):
            return Counter(name, doc, labels, registry=r).labels(**self._labels)

        def histogram(name, doc, buckets):
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(**self._labels)

        self.num_requests_running = gauge("pagedllm:num_requests_running", "Requests in the running queue.")
        self.num_requests_waiting = gauge("pagedllm:num_requests_waiting",
                                          "Requests waiting to be scheduled (new and preempted).")
        self.kv_cache_usage = gauge("pagedllm:kv_cache_usage_perc",
                                    "KV cache usage: fraction of KV blocks in use (1 = 100%).")
        self.num_free_blocks = gauge("pagedllm:num_free_blocks", "KV blocks in the free queue.")
        self.num_total_blocks = gauge("pagedllm:num_total_blocks", "KV blocks in the pool.")
        self.num_requests_swapped = gauge("pagedllm:num_requests_swapped",
                                          "Requests whose KV blocks are in the host pool (swap preemption).")
        preemptions = Counter("pagedllm:num_preemptions", "Requests preempted, by mode (recompute, swap).",
                              labels + ["mode"], registry=r)
        self.num_preemptions = {mode: preemptions.labels(mode=mode, **self._labels) for mode in ("recompute", "swap")}
        # The scheduler reports running totals per mode; the counters advance by the difference.
        self._preemptions_seen = dict((initial.num_preemptions_by_mode if initial is not None else {}) or {})
        self.prefix_cache_queries = counter("pagedllm:prefix_cache_queries",
                                            "Tokens looked up in the prefix cache (tokens of admitted requests).")
        self.prefix_cache_hits = counter("pagedllm:prefix_cache_hits", "Tokens found in the prefix cache.")
        # The scheduler reports running totals; the counters advance by the difference.
        self._queries_seen = 0 if initial is None else initial.prefix_cache_queries_total
        self._hits_seen = 0 if initial is None else initial.prefix_cache_hits_total
        self.prompt_tokens = counter("pagedllm:prompt_tokens", "Prompt tokens processed (once per request).")
        self.generation_tokens = counter("pagedllm:generation_tokens", "Generated tokens.")
        success = Counter("pagedllm:request_success", "Finished requests, by finish reason.",
                          labels + ["finished_reason"], registry=r)
        self.request_success = {reason: success.labels(finished_reason=reason, **self._labels)
                                for reason in FINISH_REASONS}
        self._success = success
        self.ttft = histogram("pagedllm:time_to_first_token_seconds", "Time to first token (s).", _TTFT_BUCKETS)
        self.itl = histogram("pagedllm:inter_token_latency_seconds", "Time between a request's tokens (s).",
                             _ITL_BUCKETS)
        self.e2e = histogram("pagedllm:e2e_request_latency_seconds", "Arrival to finish (s).", _E2E_BUCKETS)
        self.iteration_tokens = histogram("pagedllm:iteration_tokens_total", "Tokens in one engine step.",
                                          build_1_2_5_buckets(max(max_num_batched_tokens, 1)))
        token_buckets = build_1_2_5_buckets(max(max_model_len, 1))
        self.request_prompt_tokens = histogram("pagedllm:request_prompt_tokens",
                                               "Prompt tokens of finished requests.", token_buckets)
        self.request_generation_tokens = histogram("pagedllm:request_generation_tokens",
                                                   "Generated tokens of finished requests.", token_buckets)
        if initial is not None:
            self._set_gauges(initial)

    def _set_gauges(self, s: SchedulerStats) -> None:
        self.num_requests_running.set(s.num_running)
        self.num_requests_waiting.set(s.num_waiting)
        self.kv_cache_usage.set(s.kv_cache_usage)
        self.num_free_blocks.set(s.num_free_blocks)
        self.num_total_blocks.set(s.num_blocks)
        self.num_requests_swapped.set(s.num_swapped)

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        self._set_gauges(scheduler_stats)
        s = scheduler_stats
        if s.prefix_cache_queries_total > self._queries_seen:
            self.prefix_cache_queries.inc(s.prefix_cache_queries_total - self._queries_seen)
            self._queries_seen = s.prefix_cache_queries_total
        if s.prefix_cache_hits_total > self._hits_seen:
            self.prefix_cache_hits.inc(s.prefix_cache_hits_total - self._hits_seen)
            self._hits_seen = s.prefix_cache_hits_total
        for mode, total in s.num_preemptions_by_mode.items():
            seen = self._preemptions_seen.get(mode, 0)
            if total > seen and mode in self.num_preemptions:
                self.num_preemptions[mode].inc(total - seen)
                self._preemptions_seen[mode] = total
        it = iteration_stats
        if it.num_prompt_tokens:
            self.prompt_tokens.inc(it.num_prompt_tokens)
        if it.num_generation_tokens:
            self.generation_tokens.inc(it.num_generation_tokens)
        if it.num_scheduled_tokens:
            self.iteration_tokens.observe(it.num_scheduled_tokens)
        for ttft in it.time_to_first_tokens:
            self.ttft.observe(ttft)
        for itl in it.inter_token_latencies:
            self.itl.observe(itl)
        for f in it.finished:
            counter = self.request_success.get(f.finish_reason)
            if counter is None:
                counter = self.request_success[f.finish_reason] = self._success.labels(
                    finished_reason=f.finish_reason, **self._labels)
            counter.inc()
            self.e2e.observe(f.e2e_latency)
            self.request_prompt_tokens.observe(f.num_prompt_tokens)
            self.request_generation_tokens.observe(f.num_generation_tokens)
