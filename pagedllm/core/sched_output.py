"""What the scheduler hands the executor each step, and what comes back.

Plain, picklable data (no torch, no callables), shaped as vLLM V1's ``SchedulerOutput``: a request
is sent in full once (``NewRequestData``), then as diffs (``CachedRequestData``); the worker keeps
its own copy of each request (``worker/request_states.py``). So an executor can ship the message
to worker processes while the scheduler and the block manager stay in the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.outputs import Logprob
from pagedllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request the worker has not seen, sent once, on the step that first schedules it.

    Attributes:
        req_id: the request's id.
        prompt_token_ids: the prompt (a copy).
        sampling_params: a copy of the request's params without ``logits_processors`` (Python
            callables never cross the boundary; an in-process executor hands them to the worker
            beside the message, ``Executor.add_logits_processors``).
        block_ids: the request's physical block ids, logical block ``i`` at index ``i``.
        num_computed_tokens: tokens already in the KV cache before this step (0, or a prefix
            cache hit; for a fork, the parent's computed tokens).
        output_token_ids: tokens generated before the worker first hears of the request (a
            beam forked from another beam); empty otherwise.
        forked_from: for a sample of an n > 1 / best_of request forked this step from the
            sample that ran the prompt: that sample's id. The fork computes nothing this step
            (it is not in ``num_scheduled_tokens``); its first token is drawn from the parent's
            logits row, with its own params and generator.
        lora_request: the request's ``LoRARequest`` (name, id, path: plain data), or None.
        prompt_embeds: the prompt's ``PromptEmbeds`` (a CPU tensor: picklable), or None.
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int] = field(default_factory=list)
    forked_from: str | None = None
    lora_request: Any = None
    prompt_embeds: Any = None


@dataclass
class CachedRequestData:
    """What changed for a request the worker already holds (vLLM V1's diff).

    Attributes:
        req_id: the request's id.
        resumed_from_preemption: the request was preempted (its blocks freed) and is scheduled
            again: ``new_block_ids`` is then its whole new block table, replacing the old one.
        new_token_ids: tokens appended to the request since the worker last heard of it (the
            tokens sampled in earlier steps), in order.
        new_block_ids: blocks appended to the block table since the last step (or the whole
            table when ``resumed_from_preemption``).
        num_computed_tokens: tokens in the KV cache before this step.
        replaced_block_ids: (logical index, new physical id) entries of the table the worker
            holds that changed since it last heard (copy-on-write of a shared last block),
            applied before ``new_block_ids`` are appended; empty when the table only grew.
        num_blocks_kept: [speculative decoding] when set, the worker first cuts its table to
            this many entries (the blocks that held only rejected draft tokens went back to the
            pool); applied before ``replaced_block_ids``.
    """

    req_id: str
    resumed_from_preemption: bool
    new_token_ids: list[int]
    new_block_ids: list[int]
    num_computed_tokens: int
    replaced_block_ids: list[tuple[int, int]] = field(default_factory=list)
    num_blocks_kept: int | None = None


@dataclass
class SchedulerOutput:
    """One step's plan: the message the engine sends to the executor (plain, picklable data).

    Attributes:
        scheduled_new_reqs: requests scheduled for the first time (sent in full, once).
        scheduled_cached_reqs: requests the worker holds (running, or resumed after a
            preemption), as diffs.
        num_scheduled_tokens: request id -> tokens to compute this step, in batch order (the
            tokens are laid out contiguously in this order in the flattened input).
        total_num_scheduled_tokens: sum of ``num_scheduled_tokens``, <= max_num_batched_tokens.
        finished_req_ids: requests that finished or were aborted since the last step; the
            worker drops their state.
        preempted_req_ids: requests preempted (recompute) this step; the worker forgets their
            block tables and keeps the rest of their state until they resume.
        blocks_to_copy: (src, dst) physical block pairs to copy before the forward
            (copy-on-write of a shared partial block; the worker does one batched copy).
        blocks_to_swap_out: (device block, host block) pairs to copy to the host pool before
            the forward (swap preemption).
        blocks_to_swap_in: (host block, device block) pairs to copy back before the forward.
        structured_output_request_ids: request id -> row of ``grammar_bitmask``, for the
            constrained requests that sample this step (vLLM V1's name).
        grammar_bitmask: [len(structured_output_request_ids), ceil(vocab_size / 32)] int32 numpy
            array filled by the engine after ``schedule()`` (xgrammar's and llguidance's layout: bit ``t % 32`` of
            word ``t // 32`` set = token ``t`` allowed), or None when no row is constrained or
            when it follows in a second message (``grammar_bitmask_follows``).
        grammar_bitmask_follows: [structured output] the bitmask is filled while the forward runs
            and sent after this message (``sample_tokens``, vLLM V1's split): the worker runs the
            forward and what needs no bitmask, keeps the step, and samples it on ``sample_tokens``.
            False (the whole step in one call) on steps without constrained rows.
        scheduled_spec_decode_tokens: [speculative decoding] request id -> the draft tokens it
            verifies this step (vLLM V1's name). Its ``num_scheduled_tokens`` entry counts them:
            its last known token followed by the drafts, whose K/V the step writes; the logits
            of all those positions are scored against the drafts.
        num_lookahead_tokens: [draft models] request id -> drafts the worker's draft model
            proposes for the request after this step (vLLM's lookahead slots): its table covers
            that many tokens past the step's, for the draft's K/V; trimmed after the step.

    The worker applies them in this order: swap-out, copy, swap-in, then the forward.
    """

    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    structured_output_request_ids: dict[str, int] = field(default_factory=dict)
    grammar_bitmask: Any = None
    grammar_bitmask_follows: bool = False
    scheduled_spec_decode_tokens: dict[str, list[int]] = field(default_factory=dict)
    num_lookahead_tokens: dict[str, int] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens

    @property
    def forked_req_ids(self) -> dict[str, str]:
        """Fork id -> parent id of the samples forked this step (they sample, not compute)."""
        return {n.req_id: n.forked_from for n in self.scheduled_new_reqs if n.forked_from is not None}


@dataclass
class ModelRunnerOutput:
    """What the model runner returns for one step.

    Attributes:
        req_ids: requests that sampled a token this step (their chunk reached their last known
            token), in batch order.
        sampled_token_ids: one token id per entry of ``req_ids``.
        sampled_logprobs: log-probability of each sampled token under the raw (unprocessed)
            distribution; summed into ``cumulative_logprob``.
        top_logprobs: per entry of ``req_ids``, ``None`` or {token_id: Logprob} for the top
            ``SamplingParams.logprobs`` tokens plus the sampled one.
        prompt_logprobs: request id -> list (one per prompt position computed this step, for
            positions >= 1) of {token_id: Logprob}; only for requests that asked for them.
        num_accepted_tokens: [speculative decoding] request id -> how many of its scheduled
            draft tokens were accepted (a prefix of them); its ``sampled_token_ids`` entry is then
            the token after them (the target's correction, or the bonus token after all drafts).
        accepted_logprobs: request id -> the accepted drafts' raw logprobs (NaN when not asked for).
        accepted_top_logprobs: request id -> per accepted draft, ``None`` or its top-logprobs dict.
        draft_token_ids: [draft models] request id -> the drafts the worker's draft model proposes
            for the request's next step.
    """

    req_ids: list[str] = field(default_factory=list)
    sampled_token_ids: list[int] = field(default_factory=list)
    sampled_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)
    prompt_logprobs: dict[str, list[dict[int, Logprob] | None]] = field(default_factory=dict)
    num_accepted_tokens: dict[str, int] = field(default_factory=dict)
    accepted_logprobs: dict[str, list[float]] = field(default_factory=dict)
    accepted_top_logprobs: dict[str, list[dict[int, Logprob] | None]] = field(default_factory=dict)
    draft_token_ids: dict[str, list[int]] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    """One request's news from one step, produced by ``Scheduler.update_from_output``.

    Attributes:
        request_id: the request.
        new_token_ids: tokens appended this step (0 or 1; more with speculative decoding).
        new_logprobs: sampled-token logprob per new token.
        new_top_logprobs: per new token, ``None`` or its top-logprobs dict.
        new_prompt_logprobs: prompt logprobs computed this step, if asked for.
        finish_reason: ``None`` while running, else "stop", "length" or "abort".
        stop_reason: the stop token id that ended the request, if any.
        num_cached_tokens: the request's ``num_cached_tokens`` (prefix-cache hit, tokens).
        first_scheduled_time: ``time.monotonic()`` seconds of the request's first schedule, on
            outputs with tokens (the time-in-queue latency), else None.
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[float] = field(default_factory=list)
    new_top_logprobs: list[dict[int, Logprob] | None] = field(default_factory=list)
    new_prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class SchedulerStats:
    """The scheduler's state after one ``schedule()`` call (for logging and Prometheus).

    Attributes:
        num_running: requests in the running queue.
        num_waiting: requests in the waiting queue (new and preempted).
        kv_cache_usage: fraction of KV blocks in use, in [0, 1].
        kv_cache_group_usage: [hybrid KV cache] per KV cache group, the fraction of the pool its
            tables hold (one entry, ``kv_cache_usage``, with a single table).
        num_free_blocks: KV blocks in the free queue.
        num_blocks: KV blocks in the pool.
        num_preemptions: requests preempted in this step.
        num_preemptions_total: requests preempted since the scheduler started.
        num_scheduled_requests: requests in this step's batch.
        num_scheduled_tokens: tokens in this step's batch (prefill chunks + decodes).
        num_prefill_tokens: tokens of prompt chunks and recomputation in this step.
        num_decode_tokens: tokens of single-token decodes in this step.
        num_stored_tokens: tokens whose K/V is in the cache, summed over the requests holding
            blocks (their ``num_computed_tokens``), for KV utilization.
        num_allocated_slots: slots of the blocks in use (used blocks x ``block_size``);
            ``num_stored_tokens / num_allocated_slots`` is the KV utilization (1 - internal
            fragmentation of the last blocks).
        prefix_cache_queries_total / prefix_cache_hits_total: tokens looked up in / found in the
            prefix cache since the scheduler started (running totals, as vLLM counts them).
        num_swapped: requests whose blocks are in the host pool (swap preemption).
        num_preemptions_by_mode: preemptions since the scheduler started, by mode
            ("recompute", "swap").
        num_used_blocks_scheduled: KV blocks in use right after ``schedule()`` (what the step
            ran with, before finished requests free theirs; benchmarks take its peak).
        spec_decoding_stats: [speculative decoding] the running ``SpecDecodingStats`` (a copy),
            or None without speculative decoding.
        running_lora_adapters / waiting_lora_adapters: [LoRA] adapter names of the running /
            waiting requests, sorted; max_lora: the slots (0: LoRA off).
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    kv_cache_group_usage: list[float] = field(default_factory=list)
    num_free_blocks: int = 0
    num_blocks: int = 0
    num_preemptions: int = 0
    num_preemptions_total: int = 0
    num_scheduled_requests: int = 0
    num_scheduled_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    # KV utilization (benchmarks): tokens stored vs. slots in allocated blocks.
    num_stored_tokens: int = 0
    num_allocated_slots: int = 0
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    num_swapped: int = 0
    num_preemptions_by_mode: dict[str, int] = field(default_factory=dict)
    num_used_blocks_scheduled: int = 0
    spec_decoding_stats: Any = None
    # [LoRA] the adapters (names) of the running and waiting requests, and the slots; max_lora 0: LoRA off.
    running_lora_adapters: list[str] = field(default_factory=list)
    waiting_lora_adapters: list[str] = field(default_factory=list)
    max_lora: int = 0
