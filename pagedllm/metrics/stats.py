"""Per-step statistics handed to stat loggers (Prometheus, periodic log line, benchmarks).

The engine fills one ``IterationStats`` per ``step()`` (and per ``abort_request`` call) only when
it has stat loggers: the scheduler part in :meth:`IterationStats.observe_step`, the per-request
part (first tokens, inter-token latencies, finished requests) in the output processor, which owns
each request's timestamps. All times are ``time.monotonic`` seconds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from pagedllm.core.sched_output import SchedulerOutput, SchedulerStats
from pagedllm.outputs import RequestMetrics


@dataclass
class FinishedRequestStats:
    """Latencies of a request that finished this step (seconds).

    Attributes:
        finish_reason: "stop", "length" or "abort".
        e2e_latency: arrival to finish.
        ttft: arrival to first token (None if none was generated).
        num_prompt_tokens / num_generation_tokens: token counts (generation summed over samples).
        mean_tpot: (last token - first token) / (generated - 1) for one sample's worth of tokens,
            None with fewer than 2 tokens.
    """

    finish_reason: str
    e2e_latency: float
    ttft: float | None
    num_prompt_tokens: int
    num_generation_tokens: int
    mean_tpot: float | None


@dataclass
class IterationStats:
    """What one ``LLMEngine.step`` (or one ``abort_request``) did.

    Attributes:
        step_time: wall time of the step (s); 0 for an abort-only record.
        num_prompt_tokens: prompt tokens of requests that produced their first token this step
            (counted once per request, as in ``usage.prompt_tokens``).
        num_generation_tokens: tokens sampled this step (all samples).
        num_scheduled_tokens: all tokens in the forward (prefill chunks + decodes); 0 when no
            forward ran.
        num_preempted: requests preempted this step.
        time_to_first_tokens: TTFT (s) of requests whose first token came this step.
        inter_token_latencies: per request that got a later token this step, the time since its
            previous token (s).
        finished: requests that finished (or were aborted) this step.
    """

    step_time: float = 0.0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_scheduled_tokens: int = 0
    num_preempted: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)

    def observe_step(self, sched_out: SchedulerOutput, step_time: float) -> None:
        """Record the scheduler's side of a step (tokens in the forward, preemptions)."""
        self.step_time = step_time
        self.num_scheduled_tokens = sched_out.total_num_scheduled_tokens
        self.num_preempted = len(sched_out.preempted_req_ids)

    def observe_new_tokens(self, metrics: RequestMetrics, prev_first_token_time: float | None,
                           prev_last_token_time: float | None, num_prompt_tokens: int, now: float) -> None:
        """A request got token(s) this step; ``prev_*`` are its timestamps before this step."""
        if prev_first_token_time is None:
            self.time_to_first_tokens.append(now - metrics.arrival_time)
            self.num_prompt_tokens += num_prompt_tokens
        elif prev_last_token_time is not None:
            self.inter_token_latencies.append(now - prev_last_token_time)

    def observe_finished(self, metrics: RequestMetrics, finish_reason: str, num_prompt_tokens: int,
                         num_generation_tokens: int, num_samples: int, now: float) -> None:
        """A request finished (all its samples) or was aborted at ``now``."""
        ttft = None if metrics.first_token_time is None else metrics.first_token_time - metrics.arrival_time
        per_sample = num_generation_tokens / max(num_samples, 1)
        tpot = None
        if metrics.first_token_time is not None and metrics.last_token_time is not None and per_sample > 1:
            tpot = (metrics.last_token_time - metrics.first_token_time) / (per_sample - 1)
        self.finished.append(FinishedRequestStats(finish_reason, now - metrics.arrival_time, ttft,
                                                  num_prompt_tokens, num_generation_tokens, tpot))


class StatLogger(Protocol):
    """Receives the scheduler's stats and the iteration's stats after each step (and after each
    abort, with ``iteration_stats.num_scheduled_tokens == 0``). Called from the engine's thread."""

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None: ...
