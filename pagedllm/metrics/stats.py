"""Per-step statistics handed to stat loggers (Prometheus, periodic log line, benchmarks)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from pagedllm.core.sched_output import EngineCoreOutput, SchedulerOutput
from pagedllm.outputs import RequestOutput


@dataclass
class FinishedRequestStats:
    """Latencies of a request that finished this step (seconds).

    Attributes:
        finish_reason: "stop", "length" or "abort".
        e2e_latency: arrival to finish.
        ttft: arrival to first token (None if none was generated).
        num_prompt_tokens / num_generation_tokens: token counts.
        mean_tpot: (finish - first token) / (generated - 1), None with fewer than 2 tokens.
    """

    finish_reason: str
    e2e_latency: float
    ttft: float | None
    num_prompt_tokens: int
    num_generation_tokens: int
    mean_tpot: float | None


@dataclass
class IterationStats:
    """What one ``LLMEngine.step`` did.

    Attributes:
        step_time: wall time of the step (s).
        num_prompt_tokens: prefill tokens computed this step.
        num_generation_tokens: tokens sampled this step.
        num_scheduled_tokens: all tokens in the forward.
        num_preempted: requests preempted this step.
        time_to_first_tokens: TTFT (s) of requests whose first token came this step.
        finished: requests that finished this step.
    """

    step_time: float = 0.0
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    num_scheduled_tokens: int = 0
    num_preempted: int = 0
    time_to_first_tokens: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)

    @classmethod
    def from_step(cls, sched_out: SchedulerOutput, core_outputs: list[EngineCoreOutput],
                  request_outputs: list[RequestOutput], step_time: float) -> "IterationStats":
        stats = cls(step_time=step_time, num_scheduled_tokens=sched_out.total_num_scheduled_tokens,
                    num_preempted=len(sched_out.preempted_req_ids))
        for r in sched_out.scheduled:
            computed_end = r.num_computed_tokens + r.num_scheduled_tokens
            stats.num_prompt_tokens += max(0, min(computed_end, len(r.prompt_token_ids)) - r.num_computed_tokens)
        stats.num_generation_tokens = sum(len(o.new_token_ids) for o in core_outputs)
        now = time.monotonic()
        for ro in request_outputs:
            m = ro.metrics
            if m is None:
                continue
            if m.first_token_time is not None and m.first_token_time >= now - step_time - 1e-6 \
                    and sum(len(o.token_ids) for o in ro.outputs) <= len(ro.outputs):
                stats.time_to_first_tokens.append(m.first_token_time - m.arrival_time)
            if ro.finished:
                n_gen = sum(len(o.token_ids) for o in ro.outputs)
                reason = ro.outputs[0].finish_reason if ro.outputs else "abort"
                tpot = None
                if m.first_token_time is not None and n_gen > 1 and m.finished_time is not None:
                    tpot = (m.finished_time - m.first_token_time) / (n_gen - 1)
                stats.finished.append(FinishedRequestStats(
                    reason or "abort", (m.finished_time or now) - m.arrival_time,
                    None if m.first_token_time is None else m.first_token_time - m.arrival_time,
                    len(ro.prompt_token_ids), n_gen, tpot))
        return stats


class StatLogger(Protocol):
    """Receives the scheduler's stats and the iteration's stats after each step."""

    def record(self, scheduler_stats, iteration_stats: IterationStats) -> None: ...
