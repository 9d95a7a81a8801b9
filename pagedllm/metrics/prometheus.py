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
| pagedllm:kv_cache_group_usage_perc | gauge | per KV cache group (label ``kv_cache_group``): fraction of the pool its tables hold |
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
| pagedllm:lora_requests_info{max_lora,running_lora_adapters,waiting_lora_adapters} | gauge | LoRA (vLLM's): the adapters (comma-separated names) of running and waiting requests; the value is the time (s) of the last change; only with LoRA on |
| pagedllm:spec_decode_num_drafts_total | counter | speculative decoding: verification steps with drafts |
| pagedllm:spec_decode_num_draft_tokens_total | counter | draft tokens verified |
| pagedllm:spec_decode_num_accepted_tokens_total | counter | draft tokens accepted (acceptance rate = accepted / draft tokens) |
| pagedllm:spec_decode_num_accepted_tokens_per_pos_total{position} | counter | accepted drafts by position in the draft (0-based) |
"""

from __future__ import annotations

import time

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


def _make_families(registry: CollectorRegistry, max_model_len: int, max_num_batched_tokens: int) -> dict:
    """Every metric family once per registry, labelled ``model_name`` and ``engine`` (the
    data-parallel replica, "0" for a single engine; vLLM's labels)."""
    labels = ["model_name", "engine"]
    r = registry
    token_buckets = build_1_2_5_buckets(max(max_model_len, 1))
    f = {}
    for name, doc in (
            ("num_requests_running", "Requests in the running queue."),
            ("num_requests_waiting", "Requests waiting to be scheduled (new and preempted)."),
            ("kv_cache_usage_perc", "KV cache usage: fraction of KV blocks in use (1 = 100%)."),
            ("num_free_blocks", "KV blocks in the free queue."),
            ("num_total_blocks", "KV blocks in the pool."),
            ("num_requests_swapped", "Requests whose KV blocks are in the host pool (swap preemption).")):
        f[name] = Gauge(f"pagedllm:{name}", doc, labels, registry=r)
    for name, doc in (
            ("prefix_cache_queries", "Tokens looked up in the prefix cache (tokens of admitted requests)."),
            ("prefix_cache_hits", "Tokens found in the prefix cache."),
            ("prompt_tokens", "Prompt tokens processed (once per request)."),
            ("generation_tokens", "Generated tokens."),
            ("spec_decode_num_drafts", "Speculative decoding: verification steps of a request with drafts."),
            ("spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified."),
            ("spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted.")):
        f[name] = Counter(f"pagedllm:{name}", doc, labels, registry=r)
    f["kv_cache_group_usage_perc"] = Gauge(
        "pagedllm:kv_cache_group_usage_perc",
        "Hybrid KV cache: fraction of KV blocks held by one group's tables (1 = 100%).",
        labels + ["kv_cache_group"], registry=r)
    f["num_preemptions"] = Counter("pagedllm:num_preemptions", "Requests preempted, by mode (recompute, swap).",
                                   labels + ["mode"], registry=r)
    f["spec_decode_num_accepted_tokens_per_pos"] = Counter(
        "pagedllm:spec_decode_num_accepted_tokens_per_pos", "Speculative decoding: accepted drafts by position.",
        labels + ["position"], registry=r)
    f["lora_requests_info"] = Gauge(
        "pagedllm:lora_requests_info", "LoRA adapters of the running and waiting requests (value: time of the change).",
        labels + ["max_lora", "waiting_lora_adapters", "running_lora_adapters"], registry=r)
    f["request_success"] = Counter("pagedllm:request_success", "Finished requests, by finish reason.",
                                   labels + ["finished_reason"], registry=r)
    for name, doc, buckets in (
            ("time_to_first_token_seconds", "Time to first token (s).", _TTFT_BUCKETS),
            ("inter_token_latency_seconds", "Time between a request's tokens (s).", _ITL_BUCKETS),
            ("e2e_request_latency_seconds", "Arrival to finish (s).", _E2E_BUCKETS),
            ("iteration_tokens_total", "Tokens in one engine step.", build_1_2_5_buckets(max(max_num_batched_tokens, 1))),
            ("request_prompt_tokens", "Prompt tokens of finished requests.", token_buckets),
            ("request_generation_tokens", "Generated tokens of finished requests.", token_buckets)):
        f[name] = Histogram(f"pagedllm:{name}", doc, labels, buckets=buckets, registry=r)
    return f


class PrometheusStatLogger:
    """A ``StatLogger`` that updates Prometheus metrics of one engine (one data-parallel replica).

    Args:
        model_name: value of the ``model_name`` label.
        max_model_len: tokens per request (upper bucket of the token-count histograms).
        max_num_batched_tokens: tokens per step (upper bucket of ``iteration_tokens_total``).
        registry: where the metrics are registered; a fresh one when None.
        initial: scheduler stats to show before the first step (e.g. the pool's block count).
        engine_index: value of the ``engine`` label (the replica's index).
        families: the metric families to add this engine's series to (``for_engines`` shares
            them between replicas); None creates them in ``registry``.
    """

    def __init__(self, model_name: str, max_model_len: int, max_num_batched_tokens: int,
                 registry: CollectorRegistry | None = None, initial: SchedulerStats | None = None,
                 engine_index: int = 0, families: dict | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        fam = families if families is not None else _make_families(self.registry, max_model_len, max_num_batched_tokens)
        self._labels = {"model_name": model_name, "engine": str(engine_index)}
        self.engine_index = engine_index
        child = {name: family.labels(**self._labels) for name, family in fam.items()
                 if name not in ("num_preemptions", "request_success", "spec_decode_num_accepted_tokens_per_pos",
                                 "lora_requests_info", "kv_cache_group_usage_perc")}
        self._lora_info = fam["lora_requests_info"]
        self._lora_labels: tuple[str, str, str] | None = None   # the series shown now
        self._group_usage = fam["kv_cache_group_usage_perc"]
        self.num_requests_running = child["num_requests_running"]
        self.num_requests_waiting = child["num_requests_waiting"]
        self.kv_cache_usage = child["kv_cache_usage_perc"]
        self.num_free_blocks = child["num_free_blocks"]
        self.num_total_blocks = child["num_total_blocks"]
        self.num_requests_swapped = child["num_requests_swapped"]
        self.num_preemptions = {mode: fam["num_preemptions"].labels(mode=mode, **self._labels)
                                for mode in ("recompute", "swap")}
        # The scheduler reports running totals per mode; the counters advance by the difference.
        self._preemptions_seen = dict((initial.num_preemptions_by_mode if initial is not None else {}) or {})
        self.prefix_cache_queries = child["prefix_cache_queries"]
        self.prefix_cache_hits = child["prefix_cache_hits"]
        # The scheduler reports running totals; the counters advance by the difference.
        self._queries_seen = 0 if initial is None else initial.prefix_cache_queries_total
        self._hits_seen = 0 if initial is None else initial.prefix_cache_hits_total
        # [speculative decoding] running totals too (``SpecDecodingStats``).
        self.spec_decode = {name: child[f"spec_decode_{name}"]
                            for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
        self._per_pos = fam["spec_decode_num_accepted_tokens_per_pos"]
        self._spec_seen: dict = {}
        self.prompt_tokens = child["prompt_tokens"]
        self.generation_tokens = child["generation_tokens"]
        self._success = fam["request_success"]
        self.request_success = {reason: self._success.labels(finished_reason=reason, **self._labels)
                                for reason in FINISH_REASONS}
        self.ttft = child["time_to_first_token_seconds"]
        self.itl = child["inter_token_latency_seconds"]
        self.e2e = child["e2e_request_latency_seconds"]
        self.iteration_tokens = child["iteration_tokens_total"]
        self.request_prompt_tokens = child["request_prompt_tokens"]
        self.request_generation_tokens = child["request_generation_tokens"]
        if initial is not None:
            self._set_gauges(initial)

    @classmethod
    def for_engines(cls, model_name: str, max_model_len: int, max_num_batched_tokens: int,
                    registry: CollectorRegistry, initial: list[SchedulerStats | None]) -> list["PrometheusStatLogger"]:
        """One logger per data-parallel replica (``engine`` label "0".."D-1"), sharing the families
        registered once in ``registry``."""
        families = _make_families(registry, max_model_len, max_num_batched_tokens)
        return [cls(model_name, max_model_len, max_num_batched_tokens, registry, init, engine_index=i,
                    families=families) for i, init in enumerate(initial)]

    @classmethod
    def attach(cls, engine, model_name: str, registry: CollectorRegistry) -> list["PrometheusStatLogger"]:
        """Add a logger per engine to ``engine``'s stat loggers: an ``LLMEngine`` (one) or a
        ``EngineCoreClient`` (one per replica, ``engine`` labels "0".."D-1"). Returns them."""
        sizes = (engine.max_model_len, engine.scheduler_config.max_num_batched_tokens)
        if hasattr(engine, "initial_stats"):   # EngineCoreClient: stat loggers per replica
            loggers = cls.for_engines(model_name, *sizes, registry, initial=engine.initial_stats)
            for replica_loggers, logger in zip(engine.stat_loggers, loggers):
                replica_loggers.append(logger)
            return loggers
        logger = cls(model_name, *sizes, registry, initial=engine.scheduler.make_stats())
        engine.stat_loggers.append(logger)
        return [logger]

    def _set_gauges(self, s: SchedulerStats) -> None:
        self.num_requests_running.set(s.num_running)
        self.num_requests_waiting.set(s.num_waiting)
        self.kv_cache_usage.set(s.kv_cache_usage)
        for g, usage in enumerate(s.kv_cache_group_usage):
            self._group_usage.labels(kv_cache_group=str(g), **self._labels).set(usage)
        self.num_free_blocks.set(s.num_free_blocks)
        self.num_total_blocks.set(s.num_blocks)
        self.num_requests_swapped.set(s.num_swapped)

    def _record_lora(self, s: SchedulerStats) -> None:
        """[LoRA] One ``lora_requests_info`` series: the current adapters (the last one is removed)."""
        labels = (str(s.max_lora), ",".join(s.waiting_lora_adapters), ",".join(s.running_lora_adapters))
        if labels == self._lora_labels:
            return
        if self._lora_labels is not None:
            self._lora_info.remove(*self._labels.values(), *self._lora_labels)
        self._lora_labels = labels
        self._lora_info.labels(*self._labels.values(), *labels).set(time.time())

    def _record_spec_decoding(self, stats) -> None:
        """Advance the speculative-decoding counters to the scheduler's running totals."""
        for name, counter in self.spec_decode.items():
            total = getattr(stats, name)
            if total > self._spec_seen.get(name, 0):
                counter.inc(total - self._spec_seen.get(name, 0))
                self._spec_seen[name] = total
        for pos, total in enumerate(stats.num_accepted_tokens_per_pos):
            key = ("pos", pos)
            child = self._per_pos.labels(position=str(pos), **self._labels)
            if total > self._spec_seen.get(key, 0):
                child.inc(total - self._spec_seen.get(key, 0))
                self._spec_seen[key] = total

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        self._set_gauges(scheduler_stats)
        s = scheduler_stats
        if s.max_lora:
            self._record_lora(s)
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
        if s.spec_decoding_stats is not None:
            self._record_spec_decoding(s.spec_decoding_stats)
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
