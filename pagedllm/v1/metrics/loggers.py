"""``vllm.v1.metrics.loggers``: stat loggers passed to ``AsyncLLM.from_engine_args(stat_loggers=...)``.

As in vLLM, ``stat_loggers`` holds factories: a class (or callable) called with
``(vllm_config, engine_index)`` once per engine, or, for an aggregating class such as
``AggregatedLoggingStatLogger`` (``aggregated = True``), once with ``(vllm_config, engine_indexes)``;
an object that already has ``record`` is used as it is. ``attach_stat_loggers`` wires them.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Iterable

from pagedllm.metrics.loggers import DEFAULT_LOG_INTERVAL_S
from pagedllm.metrics.loggers import LoggingStatLogger as _IntervalLogger

logger = logging.getLogger(__name__)


class LoggingStatLogger(_IntervalLogger):
    """vLLM's per-engine logger: the periodic line of one engine (``metrics/loggers.py``).

    Args:
        vllm_config: vLLM's; unused.
        engine_index: the data-parallel rank it logs for.
    """

    def __init__(self, vllm_config=None, engine_index: int = 0) -> None:
        super().__init__(DEFAULT_LOG_INTERVAL_S)
        self.engine_index = engine_index


class AggregatedLoggingStatLogger:
    """One log line over several data-parallel engines (vLLM's ``AggregatedLoggingStatLogger``):
    summed throughput (tokens/s since the last line), running and waiting requests, the mean KV
    cache usage, and per engine the requests it finished since it started.

    Args:
        vllm_config: vLLM's; unused.
        engine_indexes: the ranks it aggregates (None: [0]).
    Attributes:
        num_finished: rank -> requests that engine finished (from its own stats).
    """

    aggregated = True

    def __init__(self, vllm_config=None, engine_indexes: Iterable[int] | None = None) -> None:
        self.engine_indexes = list(engine_indexes) if engine_indexes is not None else [0]
        self._lock = threading.Lock()
        self._last_log = time.monotonic()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._sched: dict[int, object] = {}
        self.num_finished = {i: 0 for i in self.engine_indexes}

    def record(self, scheduler_stats, iteration_stats, engine_idx: int = 0) -> None:
        """One step's stats of engine ``engine_idx``."""
        with self._lock:
            self._sched[engine_idx] = scheduler_stats
            self._prompt_tokens += iteration_stats.num_prompt_tokens
            self._generation_tokens += iteration_stats.num_generation_tokens
            self.num_finished[engine_idx] = self.num_finished.get(engine_idx, 0) + len(iteration_stats.finished)

    def for_engine(self, engine_idx: int) -> "_EngineView":
        """A ``StatLogger`` for one engine's stat-logger list that records into this one."""
        return _EngineView(self, engine_idx)

    def log(self) -> None:
        """Log the aggregated line now (``do_log_stats``)."""
        now = time.monotonic()
        with self._lock:
            elapsed = max(now - self._last_log, 1e-9)
            prompt_tps, gen_tps = self._prompt_tokens / elapsed, self._generation_tokens / elapsed
            self._prompt_tokens = self._generation_tokens = 0
            self._last_log = now
            stats = list(self._sched.values())
            finished = dict(self.num_finished)
        usage = sum(s.kv_cache_usage for s in stats) / len(stats) if stats else 0.0
        logger.info("%d engine(s) %s: Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f "
                    "tokens/s, Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Finished per engine: %s",
                    len(self.engine_indexes), self.engine_indexes, prompt_tps, gen_tps,
                    sum(s.num_running for s in stats), sum(s.num_waiting for s in stats), 100.0 * usage, finished)


class _EngineView:
    """Forwards one engine's ``record`` calls to an ``AggregatedLoggingStatLogger``."""

    def __init__(self, target: AggregatedLoggingStatLogger, engine_idx: int) -> None:
        self.target, self.engine_idx = target, engine_idx

    def record(self, scheduler_stats, iteration_stats) -> None:
        self.target.record(scheduler_stats, iteration_stats, self.engine_idx)


def attach_stat_loggers(factories: Iterable, per_engine_lists: list[list], vllm_config=None) -> list:
    """Build ``factories`` (see the module) and append them to each engine's stat-logger list.

    Args:
        factories: classes, callables or ready ``StatLogger`` objects.
        per_engine_lists: by rank, the list each engine's stats go to.
    Returns:
        The loggers built (once each), for ``do_log_stats``.
    Raises:
        ValueError: an entry that is neither a factory nor has ``record``.
    """
    built = []
    indexes = list(range(len(per_engine_lists)))
    for factory in factories:
        if hasattr(factory, "record") and not isinstance(factory, type):
            for lst in per_engine_lists:
                lst.append(factory)
            built.append(factory)
        elif getattr(factory, "aggregated", False):
            agg = factory(vllm_config, indexes)
            for i, lst in enumerate(per_engine_lists):
                lst.append(agg.for_engine(i))
            built.append(agg)
        elif callable(factory):
            for i, lst in enumerate(per_engine_lists):
                one = factory(vllm_config, i)
                lst.append(one)
                built.append(one)
        else:
            raise ValueError(f"stat_loggers entries must be StatLogger classes, factories or objects, got {factory!r}")
    return built
