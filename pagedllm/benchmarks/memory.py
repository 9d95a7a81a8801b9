"""How many requests share a KV budget: paged blocks vs. reserving ``max_model_len`` per request.

The budget is ``static_concurrency x max_model_len`` tokens of KV (by default 8 x 2048), i.e.
what a static allocator that reserves ``max_model_len`` per request fills with
``static_concurrency`` requests. The real ``Scheduler`` and ``KVCacheManager`` run that budget as
``budget // block_size`` blocks WITHOUT a model: the "runner" returns a fixed token id for every
request that samples (memory does not depend on which tokens come out), and every request makes
exactly ``max_tokens`` tokens (``ignore_eos``). Chunked prefill, lazy block allocation and
recompute preemption are the engine's own.

Per step it records the batch size (requests holding KV in the forward) and, after the update,
stored tokens / slots in allocated blocks (KV utilization). The same simulation with several
block sizes at one budget is the block-size sweep. No torch here.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass

from pagedllm.config import DEFAULT_MAX_NUM_BATCHED_TOKENS, SchedulerConfig
from pagedllm.core.hybrid_kv_cache_manager import HybridKVCacheManager
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_cache_spec import make_kv_cache_groups
from pagedllm.core.request import Request
from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

FAKE_TOKEN_ID = 7
FAKE_PROMPT_TOKEN_ID = 11


@dataclass(frozen=True)
class MemorySimResult:
    """One simulated run (counts of requests, tokens and blocks).

    Attributes:
        block_size: tokens per block.
        num_blocks: blocks in the pool (budget // block_size).
        kv_budget_tokens: the KV budget in tokens.
        max_model_len: tokens a static allocator reserves per request.
        static_concurrency: budget // max_model_len, what such an allocator runs at once.
        num_requests: requests in the workload.
        peak_concurrency: most requests in one step's batch.
        mean_concurrency: mean batch size over the steps with requests waiting (the pool or
            ``max_num_seqs`` is what limits then); 0 when nothing ever waited.
        mean_concurrency_all_steps: mean batch size over all steps (the draining tail included).
        peak_ratio, mean_ratio: peak / mean concurrency divided by ``static_concurrency``.
        kv_utilization: stored tokens / slots in allocated blocks, averaged over steps holding blocks.
        peak_kv_usage: largest fraction of blocks in use.
        num_preemptions: recompute preemptions.
        num_steps: scheduler steps to finish the workload.
    """

    block_size: int
    num_blocks: int
    kv_budget_tokens: int
    max_model_len: int
    static_concurrency: int
    num_requests: int
    peak_concurrency: int
    mean_concurrency: float
    mean_concurrency_all_steps: float
    peak_ratio: float
    mean_ratio: float
    kv_utilization: float
    peak_kv_usage: float
    num_preemptions: int
    num_steps: int

    def to_dict(self) -> dict:
        return asdict(self)


def simulate_kv_concurrency(lengths: list[tuple[int, int]], block_size: int = 16, max_model_len: int = 2048,
                            static_concurrency: int = 8, max_num_seqs: int = 256,
                            max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS, max_steps: int | None = None,
                            layer_windows: list[int | None] | None = None) -> MemorySimResult:
    """Run ``lengths`` = [(prompt_len, max_tokens), ...] through the scheduler, all arriving at once.

    Args:
        lengths: per request, prompt tokens and output tokens (prompt + output <= max_model_len).
        block_size: tokens per block.
        max_model_len: tokens reserved per request by the static allocator (and the engine's limit).
        static_concurrency: requests the static allocator fits; the budget is this x max_model_len.
        max_num_seqs: most requests per step (keep it high so blocks are the limit).
        max_num_batched_tokens: token budget per step (default: the engine's).
        max_steps: give up after this many steps (None: 100 x the total token count).
        layer_windows: [hybrid KV cache] per layer, its sliding window (``None`` = full); with a
            window the same budget (bytes) becomes ``num_layers / group_size`` times as many
            pages of ``group_size`` layers, run by ``HybridKVCacheManager`` (``num_blocks`` then
            counts pages, the null page included). None: one table per request.
    Raises:
        ValueError: for bad sizes, an empty workload, a request longer than ``max_model_len``, or
            a budget that is not a whole number of blocks.
        RuntimeError: if the scheduler stalls (an empty step with requests left) or runs past
            ``max_steps``.
    """
    if not lengths:
        raise ValueError("the workload is empty")
    for name, v in (("block_size", block_size), ("max_model_len", max_model_len),
                    ("static_concurrency", static_concurrency)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    budget = static_concurrency * max_model_len
    if budget % block_size:
        raise ValueError(f"the KV budget ({budget} tokens) is not a multiple of block_size={block_size}")
    for i, (p, n) in enumerate(lengths):
        if p < 1 or n < 1 or p + n > max_model_len:
            raise ValueError(f"request {i}: prompt_len={p}, max_tokens={n} must be >= 1 and sum to "
                             f"<= max_model_len={max_model_len}")
    num_blocks = budget // block_size
    groups = make_kv_cache_groups(layer_windows) if layer_windows else None
    if groups is not None and groups.is_hybrid:
        num_blocks = num_blocks * groups.num_layers // groups.group_size
        kv = HybridKVCacheManager(block_size, num_blocks, groups)
    else:
        kv = KVCacheManager(block_size, num_blocks)
    sched = Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len), kv)
    for i, (p, n) in enumerate(lengths):
        sched.add_request(Request(f"mem-{i}", [FAKE_PROMPT_TOKEN_ID] * p,
                                  SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True), max_tokens=n))
    limit = max_steps if max_steps is not None else 100 * sum(p + n for p, n in lengths)
    batch_sizes: list[int] = []
    saturated: list[int] = []
    utils: list[float] = []
    peak_usage = 0.0
    while sched.has_unfinished_requests():
        if len(batch_sizes) >= limit:
            raise RuntimeError(f"simulation ran past {limit} steps with {sched.get_num_unfinished_requests()} "
                               "requests left")
        out = sched.schedule()
        if out.is_empty:
            raise RuntimeError(f"scheduler stalled: empty step with {sched.num_running} running and "
                               f"{sched.num_waiting} waiting requests, {kv.num_free_blocks}/{num_blocks} blocks free")
        batch = len(out.num_scheduled_tokens)
        batch_sizes.append(batch)
        if sched.num_waiting:
            saturated.append(batch)
        peak_usage = max(peak_usage, kv.usage)
        # The requests whose chunk reached their last token sample (what a model runner would do).
        ids = [rid for rid in out.num_scheduled_tokens
               if sched.requests[rid].num_computed_tokens == sched.requests[rid].num_tokens]
        sched.update_from_output(out, ModelRunnerOutput(req_ids=ids, sampled_token_ids=[FAKE_TOKEN_ID] * len(ids)))
        stats = sched.make_stats()
        if stats.num_allocated_slots:
            utils.append(stats.num_stored_tokens / stats.num_allocated_slots)
    peak = max(batch_sizes)
    mean_sat = sum(saturated) / len(saturated) if saturated else 0.0
    return MemorySimResult(
        block_size=block_size, num_blocks=num_blocks, kv_budget_tokens=budget, max_model_len=max_model_len,
        static_concurrency=static_concurrency, num_requests=len(lengths), peak_concurrency=peak,
        mean_concurrency=mean_sat, mean_concurrency_all_steps=sum(batch_sizes) / len(batch_sizes),
        peak_ratio=peak / static_concurrency, mean_ratio=mean_sat / static_concurrency,
        kv_utilization=sum(utils) / len(utils) if utils else 0.0, peak_kv_usage=peak_usage,
        num_preemptions=sched.num_preemptions_total, num_steps=len(batch_sizes))


def format_memory_table(results: list[MemorySimResult]) -> str:
    """One row per block size."""
    head = (f"{'block_size':>10}{'blocks':>8}{'static':>8}{'peak':>7}{'mean':>8}{'peak/static':>13}"
            f"{'mean/static':>13}{'kv_util':>9}{'peak_usage':>12}{'preempt':>9}{'steps':>7}")
    lines = [head]
    for r in results:
        lines.append(f"{r.block_size:>10}{r.num_blocks:>8}{r.static_concurrency:>8}{r.peak_concurrency:>7}"
                     f"{r.mean_concurrency:>8.1f}{r.peak_ratio:>12.1f}x{r.mean_ratio:>12.1f}x"
                     f"{r.kv_utilization:>9.3f}{r.peak_kv_usage:>12.3f}{r.num_preemptions:>9}{r.num_steps:>7}")
    return "\n".join(lines)
