"""Offline throughput: the whole workload submitted at once to ``LLM.generate`` (vLLM's
``benchmark_throughput``), greedy with ``ignore_eos`` so each request makes exactly its
``max_tokens``. With ``n > 1`` (vLLM's ``--n``) each prompt asks for ``n`` samples (seeded
sampling at temperature 1, so they differ): one request whose samples fork the prompt's blocks,
or, with ``separate``, ``n`` requests of one sample each (seeds ``s .. s + n - 1``: the same
outputs), the baseline the forks are measured against (peak blocks, throughput).

TTFT / TPOT come from each ``RequestOutput.metrics`` (``time.monotonic`` seconds; every request
arrives when ``generate`` queues it, so TTFT includes the wait for a place in the batch). KV usage,
KV utilization and preemptions come from :class:`BenchStatLogger`, registered in
``llm.llm_engine.stat_loggers`` for the timed run only.
"""

from __future__ import annotations

import logging
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

from pagedllm.benchmarks.breakdown import StepBreakdown, read_rank_times
from pagedllm.benchmarks.datasets import BenchRequest
from pagedllm.benchmarks.metrics import spec_decode_summary, RequestRecord, mean, summarize

logger = logging.getLogger(__name__)

WARMUP_PROMPT_TOKENS = 16
WARMUP_MAX_TOKENS = 4


@dataclass
class StepSample:
    """One engine step as the stat logger saw it (after the step).

    Attributes:
        step_time: wall time of the step (s).
        num_scheduled_requests: requests in the step's batch.
        num_prefill_tokens / num_decode_tokens: tokens of prompt chunks / single-token decodes.
        kv_cache_usage: fraction of blocks in use after the step.
        num_stored_tokens / num_allocated_slots: see ``SchedulerStats``.
        num_used_blocks: KV blocks in use while the step ran (right after its ``schedule()``).
    """

    step_time: float
    num_scheduled_requests: int
    num_prefill_tokens: int
    num_decode_tokens: int
    kv_cache_usage: float
    num_stored_tokens: int
    num_allocated_slots: int
    num_used_blocks: int = 0


@dataclass
class BenchStatLogger:
    """A ``StatLogger`` keeping one :class:`StepSample` per engine step.

    Records without a forward (``iteration_stats.num_scheduled_tokens == 0``, e.g. an abort) are
    skipped. ``num_preemptions_total`` is the scheduler's running total at the last step.
    """

    steps: list[StepSample] = field(default_factory=list)
    num_preemptions_total: int = 0

    def record(self, scheduler_stats, iteration_stats) -> None:
        if getattr(iteration_stats, "num_scheduled_tokens", 0) == 0:
            return
        s = scheduler_stats
        self.num_preemptions_total = s.num_preemptions_total
        self.steps.append(StepSample(
            step_time=iteration_stats.step_time, num_scheduled_requests=s.num_scheduled_requests,
            num_prefill_tokens=s.num_prefill_tokens, num_decode_tokens=s.num_decode_tokens,
            kv_cache_usage=s.kv_cache_usage, num_stored_tokens=getattr(s, "num_stored_tokens", 0),
            num_allocated_slots=getattr(s, "num_allocated_slots", 0),
            num_used_blocks=getattr(s, "num_used_blocks_scheduled", 0)))

    @property
    def peak_blocks_used(self) -> int:
        """Most KV blocks in use during any step (a block shared by forks counts once)."""
        return max((s.num_used_blocks for s in self.steps), default=0)

    @property
    def peak_kv_usage(self) -> float:
        """Largest fraction of blocks in use after any step."""
        return max((s.kv_cache_usage for s in self.steps), default=0.0)

    @property
    def kv_utilization(self) -> float | None:
        """Stored tokens / allocated slots, averaged over the steps that held any block."""
        return mean([s.num_stored_tokens / s.num_allocated_slots for s in self.steps if s.num_allocated_slots])


def to_engine_prompt(req: BenchRequest):
    """A dataset prompt as ``LLM.generate`` takes it (token ids go as ``prompt_token_ids``)."""
    return {"prompt_token_ids": list(req.prompt)} if isinstance(req.prompt, list) else req.prompt


def run_throughput(llm, requests: list[BenchRequest], warmup: bool = True,
                   breakdown: bool = False, progress: bool = False, n: int = 1,
                   separate: bool = False,
                   structured_outputs: list | None = None,
                   lora_requests: list | None = None) -> tuple[dict, list[list[int]]]:
    """Run the workload through ``llm`` (a ``pagedllm.LLM``) with everything submitted at once.

    Args:
        llm: the engine.
        requests: the workload.
        warmup: first run one short request (untimed) so one-off start-up costs stay out.
        breakdown: time the engine's components too (``StepBreakdown``, in-process worker only;
            result key ``breakdown``: seconds per component; slightly slows the run) and each
            rank's step and collectives (result key ``rank_breakdown``: ``read_rank_times``).
        progress: show ``LLM.generate``'s progress bar (tqdm, on stderr) during the timed run.
        n: samples per prompt (> 1: seeded sampling at temperature 1, seed ``1000 * i`` for
            prompt ``i``).
        separate: run the ``n`` samples as ``n`` requests of one sample (seeds ``1000 * i + j``)
            instead of one request whose samples fork.
        structured_outputs: a ``StructuredOutputsParams`` per request (``--structured-output``),
            or None. Constrained requests do not ignore EOS: they end where their grammar does.
        lora_requests: [LoRA] a ``LoRARequest`` (or None) per request, or None: the base model.
    Returns:
        (result, prompt_token_ids): the flat result dict (``metrics.summarize``'s keys plus
        ``n``, ``peak_blocks_used``, ``peak_kv_usage``, ``kv_utilization``, ``num_preemptions``, ``prefix_cache_hit_rate``
        (cached / looked-up prompt tokens over the timed run; None with caching off),
        ``prefill_tokens_saved`` (prompt tokens found cached, not computed), ``num_steps``,
        ``output_lens``: output tokens of each request, in workload order), and
        each request's prompt as the engine
        tokenized it (for baselines that must see the same tokens).
    Raises:
        ValueError: a prompt the engine rejects (too long for ``max_model_len``, ...), or ``n < 1``.
    """
    from pagedllm.sampling_params import SamplingParams

    engine = llm.llm_engine
    if warmup:
        warm_ids = list(range(100, 100 + WARMUP_PROMPT_TOKENS))
        llm.generate({"prompt_token_ids": warm_ids},
                     SamplingParams(temperature=0.0, max_tokens=WARMUP_MAX_TOKENS, ignore_eos=True), use_tqdm=False)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if lora_requests is not None and (n != 1 or len(lora_requests) != len(requests)):
        raise ValueError("--lora-modules runs one sample per prompt, one adapter (or none) per request")
    if structured_outputs is not None and n != 1:
        raise ValueError("--structured-output runs one sample per prompt: it cannot be combined with --n > 1")
    if structured_outputs is not None:
        params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, structured_outputs=so)
                  for r, so in zip(requests, structured_outputs)]
        prompts = [to_engine_prompt(r) for r in requests]
    elif n == 1:
        params = [SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True) for r in requests]
        prompts = [to_engine_prompt(r) for r in requests]
    elif separate:
        params = [SamplingParams(temperature=1.0, seed=1000 * i + j, max_tokens=r.max_tokens, ignore_eos=True)
                  for i, r in enumerate(requests) for j in range(n)]
        prompts = [to_engine_prompt(r) for r in requests for _ in range(n)]
    else:
        params = [SamplingParams(n=n, temperature=1.0, seed=1000 * i, max_tokens=r.max_tokens, ignore_eos=True)
                  for i, r in enumerate(requests)]
        prompts = [to_engine_prompt(r) for r in requests]
    stat_logger = BenchStatLogger()
    preempt_before = engine.scheduler.num_preemptions_total
    spec_before = None if engine.spec_decoder is None else engine.spec_decoder.stats.copy()
    kv = engine.kv_cache_manager
    queries_before, hits_before = kv.prefix_cache_stats.queries, kv.prefix_cache_stats.hits
    engine.stat_loggers.append(stat_logger)
    # In-process worker: every engine component; worker processes: per rank, step and collectives.
    timer = StepBreakdown(engine) if breakdown and engine.executor.uses_in_process_worker else None
    if breakdown:
        read_rank_times(engine.executor, reset=True)
    try:
        with timer if timer is not None else nullcontext():
            t0 = time.monotonic()
            outputs = llm.generate(prompts, params, use_tqdm=progress, lora_request=lora_requests)
            duration = time.monotonic() - t0
    finally:
        engine.stat_loggers.remove(stat_logger)
    records = []
    for ro in outputs:
        m = ro.metrics
        n_out = sum(len(o.token_ids) for o in ro.outputs)
        last = m.last_token_time if m.last_token_time is not None else m.finished_time
        records.append(RequestRecord(prompt_len=len(ro.prompt_token_ids), output_len=n_out, start=m.arrival_time,
                                     first_token_time=m.first_token_time, last_token_time=last))
    expected = n * sum(r.max_tokens for r in requests)
    got = sum(r.output_len for r in records)
    if got != expected and structured_outputs is None:
        logger.warning("made %d output tokens, expected %d (max_tokens sum): requests capped by max_model_len?",
                       got, expected)
    result = summarize(records, duration)
    result.update(
        n=n,
        peak_blocks_used=stat_logger.peak_blocks_used,
        peak_kv_usage=stat_logger.peak_kv_usage,
        kv_utilization=stat_logger.kv_utilization,
        num_preemptions=engine.scheduler.num_preemptions_total - preempt_before,
        prefix_cache_hit_rate=((kv.prefix_cache_stats.hits - hits_before)
                               / max(kv.prefix_cache_stats.queries - queries_before, 1)) if kv.enable_caching else None,
        prefill_tokens_saved=kv.prefix_cache_stats.hits - hits_before,
        num_steps=len(stat_logger.steps),
        output_lens=[r.output_len for r in records],
    )
    result.update(spec_decode_summary(spec_before, None if engine.spec_decoder is None else engine.spec_decoder.stats,
                                      got, sum(1 for st in stat_logger.steps if st.num_decode_tokens)))
    if timer is not None:
        timer.wall_s = duration
        result["breakdown"] = timer.as_dict()
    if breakdown:
        result["rank_breakdown"] = read_rank_times(engine.executor)
    return result, [list(ro.prompt_token_ids) for ro in outputs]
