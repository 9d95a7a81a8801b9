"""vLLM's stat-logger factories (``pagedllm.v1.metrics.loggers``) without an engine: a class is
built once per engine with (vllm_config, engine_index), an aggregating class once with the
indexes, an object is used as it is; ``AggregatedLoggingStatLogger`` sums over engines and logs
on ``log()`` (``do_log_stats``); ``LoggingStatLogger.log`` logs before its interval."""

from __future__ import annotations

import logging

import pytest

from pagedllm.core.sched_output import SchedulerStats
from pagedllm.metrics.loggers import LoggingStatLogger as IntervalLogger
from pagedllm.metrics.stats import IterationStats
from pagedllm.v1.metrics.loggers import AggregatedLoggingStatLogger, LoggingStatLogger, attach_stat_loggers


class _Recorder:
    def __init__(self, vllm_config=None, engine_index: int = 0) -> None:
        self.engine_index = engine_index
        self.calls = 0

    def record(self, scheduler_stats, iteration_stats) -> None:
        self.calls += 1


def _step(prompt: int, generated: int, finished: int, running: int) -> tuple[SchedulerStats, IterationStats]:
    it = IterationStats(num_prompt_tokens=prompt, num_generation_tokens=generated)
    it.finished.extend([object()] * finished)
    return SchedulerStats(num_running=running, kv_cache_usage=0.5), it


def test_factories_per_engine_aggregated_and_objects(caplog):
    lists: list[list] = [[], []]
    ready = _Recorder()
    built = attach_stat_loggers([_Recorder, AggregatedLoggingStatLogger, ready], lists, vllm_config="cfg")
    per_engine = [b for b in built if isinstance(b, _Recorder) and b is not ready]
    assert [r.engine_index for r in per_engine] == [0, 1]
    agg = next(b for b in built if isinstance(b, AggregatedLoggingStatLogger))
    assert agg.engine_indexes == [0, 1] and len(built) == 4
    for i, lst in enumerate(lists):
        for stat_logger in lst:
            stat_logger.record(*_step(prompt=10 * (i + 1), generated=3, finished=i + 1, running=1))
    assert [r.calls for r in per_engine] == [1, 1] and ready.calls == 2
    assert agg.num_finished == {0: 1, 1: 2}
    with caplog.at_level(logging.INFO, logger="pagedllm.v1.metrics.loggers"):
        agg.log()
    assert "2 engine(s) [0, 1]" in caplog.text and "Running: 2 reqs" in caplog.text
    assert "KV cache usage: 50.0%" in caplog.text and "Finished per engine: {0: 1, 1: 2}" in caplog.text
    with pytest.raises(ValueError, match="stat_loggers entries"):
        attach_stat_loggers([3], lists)


def test_log_now_ignores_the_interval(caplog):
    stat_logger = LoggingStatLogger(None, engine_index=1)
    assert isinstance(stat_logger, IntervalLogger) and stat_logger.engine_index == 1
    stat_logger.record(*_step(prompt=5, generated=2, finished=0, running=1))
    with caplog.at_level(logging.INFO, logger="pagedllm.metrics.loggers"):
        assert stat_logger.maybe_log() is False   # 10 s have not passed
        assert stat_logger.log() is True
    assert "Running: 1 reqs" in caplog.text
