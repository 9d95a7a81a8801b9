"""The periodic log line (vLLM's ``LoggingStatLogger``): throughput, queues and KV usage."""

from __future__ import annotations

import logging
import threading
import time

from pagedllm.core.sched_output import SchedulerStats
from pagedllm.metrics.stats import IterationStats

logger = logging.getLogger(__name__)

DEFAULT_LOG_INTERVAL_S = 10.0


class LoggingStatLogger:
    """Accumulates token counts between log lines and logs, at most every ``interval_s``:

        Avg prompt throughput: 12.3 tokens/s, Avg generation throughput: 45.6 tokens/s,
        Running: 3 reqs, Waiting: 0 reqs, KV cache usage: 1.2% (450/455 blocks free), Preemptions: 0,
        Prefix cache hit rate: 87.5%

    The hit rate is hits / queries (tokens) over the interval since the last line (0.0% when no
    request was admitted in it).

    ``record`` runs in the engine thread; ``maybe_log`` may run in any thread. A line is skipped
    when nothing happened since the last one and no request is queued (an idle server stays quiet).

    Args:
        interval_s: seconds between log lines.
        log_on_record: also call ``maybe_log`` after each ``record`` (where nobody calls it on a
            timer: the server's engine-core processes, whose stats arrive with their outputs).
    """

    def __init__(self, interval_s: float = DEFAULT_LOG_INTERVAL_S, log_on_record: bool = False) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self.log_on_record = log_on_record
        self._lock = threading.Lock()
        self._last_log = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._finished = 0
        self._preemptions_total = 0
        self._sched: SchedulerStats | None = None
        self._prefix_seen: tuple[int, int] | None = None  # (queries, hits) totals at the last line
        self._spec_seen: tuple[int, int, int] = (0, 0, 0)   # (drafts, draft tokens, accepted) totals

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        with self._lock:
            self._sched = scheduler_stats
            self._prompt_tokens += iteration_stats.num_prompt_tokens
            self._generation_tokens += iteration_stats.num_generation_tokens
            self._finished += len(iteration_stats.finished)
            self._preemptions_total += iteration_stats.num_preempted
        if self.log_on_record:
            self.maybe_log()

    def seconds_to_next_log(self, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        return max(0.0, self._last_log + self.interval_s - now)

    def log(self) -> bool:
        """Log a line now if there is news (vLLM's ``StatLoggerBase.log``; ``do_log_stats``).

        Returns:
            True when a line was logged.
        """
        return self.maybe_log(force=True)

    def maybe_log(self, now: float | None = None, force: bool = False) -> bool:
        """Log a line if ``interval_s`` has passed since the last one (or ``force``) and there is news.

        Returns:
            True when a line was logged.
        """
        now = time.monotonic() if now is None else now
        with self._lock:
            elapsed = max(now - self._last_log, 1e-9)
            if elapsed < self.interval_s and not force:
                return False
            s = self._sched
            busy = s is not None and (s.num_running or s.num_waiting)
            active = self._prompt_tokens or self._generation_tokens or self._finished or busy
            prompt_tps = self._prompt_tokens / elapsed
            gen_tps = self._generation_tokens / elapsed
            self._last_log = now
            self._prompt_tokens = self._generation_tokens = self._finished = 0
            if s is not None:
                q0, h0 = self._prefix_seen or (0, 0)
                queries, hits = s.prefix_cache_queries_total - q0, s.prefix_cache_hits_total - h0
                self._prefix_seen = (s.prefix_cache_queries_total, s.prefix_cache_hits_total)
                spec = self._spec_line(s.spec_decoding_stats)
        if not active or s is None:
            return False
        logger.info("Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                    "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%% (%d/%d blocks free), "
                    "Preemptions: %d, Prefix cache hit rate: %.1f%%", prompt_tps, gen_tps, s.num_running,
                    s.num_waiting, 100.0 * s.kv_cache_usage, s.num_free_blocks, s.num_blocks,
                    self._preemptions_total, 100.0 * hits / queries if queries else 0.0)
        if len(s.kv_cache_group_usage) > 1:
            logger.info("KV cache usage per group: %s", ", ".join(
                f"{g}: {100.0 * u:.1f}%" for g, u in enumerate(s.kv_cache_group_usage)))
        if spec:
            logger.info(spec)
        return True

    def _spec_line(self, stats) -> str | None:
        """[speculative decoding] vLLM's "SpecDecoding metrics" line over the interval, or None."""
        if stats is None:
            return None
        d0, t0, a0 = self._spec_seen
        drafts, tokens, accepted = (stats.num_drafts - d0, stats.num_draft_tokens - t0,
                                    stats.num_accepted_tokens - a0)
        self._spec_seen = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
        if not drafts:
            return None
        return (f"SpecDecoding metrics: Mean acceptance length: {1 + accepted / drafts:.2f}, "
                f"Accepted: {accepted} tokens, Drafted: {tokens} tokens, "
                f"Avg Draft acceptance rate: {100.0 * accepted / tokens:.1f}%")
