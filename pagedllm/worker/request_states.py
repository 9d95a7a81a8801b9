"""The worker's copy of each request, kept up to date from the per-step ``SchedulerOutput`` diffs.

vLLM V1's ``CachedRequestState`` / input batch, in plain Python (no torch): a request arrives in
full once (``NewRequestData``), then each step adds the tokens and blocks the worker lacks
(``CachedRequestData``); finished ids drop it, preempted ids clear its block table (its tokens,
params and seeded generator stay: a resumed request continues its random stream where it was).
``RequestStates.update`` turns one message into the step's ``ScheduledRequest`` views, in batch
order, which is all the model runner reads.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedllm.core.sched_output import SchedulerOutput
from pagedllm.sampling_params import SamplingParams


@dataclass
class CachedRequestState:
    """One request as the worker knows it.

    Attributes:
        req_id: the request's id.
        prompt_token_ids: the prompt.
        sampling_params: the request's params (without callables).
        token_ids: prompt + the generated tokens the worker has been told about.
        output_token_ids: the generated tokens the worker has been told about.
        block_ids: physical block ids (empty while preempted).
        num_computed_tokens: tokens in the KV cache before the current step.
        generator: the request's seeded ``torch.Generator`` once the runner made one, else None.
        draft_num_computed: [draft models] tokens of ``token_ids`` (from 0) whose K/V the draft
            model holds in its pool; 0 after a preemption.
        draft_kv_tokens: [draft models] the drafts whose draft K/V follows those positions (the
            first ``k - 1`` drafts of the last drafting); they count as computed as far as they
            match the real tokens (``draft_valid_prefix``).
        lora_request: [LoRA] the request's adapter (``LoRARequest``), or None.
        prompt_embeds: the prompt's ``core.request.PromptEmbeds`` (kept across preemptions: a
            recompute embeds the same rows), or None.
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    token_ids: list[int]
    output_token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    generator: Any = None
    draft_num_computed: int = 0
    draft_kv_tokens: list[int] = field(default_factory=list)
    lora_request: Any = None
    prompt_embeds: Any = None

    def draft_valid_prefix(self, token_ids: list[int]) -> int:
        """[draft models] Positions of ``token_ids`` (the request's real tokens) whose draft K/V
        is valid: ``draft_num_computed`` plus the leading drafts of ``draft_kv_tokens`` that the
        verification accepted (they equal the real tokens there)."""
        n, j, kv = self.draft_num_computed, 0, self.draft_kv_tokens
        while j < len(kv) and n + j < len(token_ids) and token_ids[n + j] == kv[j]:
            j += 1
        return n + j

    def cut_draft_kv(self, num_tokens: int) -> None:
        """[draft models] The draft K/V past ``num_tokens`` positions is gone (its blocks were
        freed, or the table cleared)."""
        if self.draft_num_computed >= num_tokens:
            self.draft_num_computed, self.draft_kv_tokens = num_tokens, []
        else:
            del self.draft_kv_tokens[num_tokens - self.draft_num_computed:]


@dataclass
class ScheduledRequest:
    """One request's share of a step, as the model runner reads it.

    Attributes:
        request_id: the request's id.
        token_ids: the tokens whose K/V this step computes (a prefill chunk, or the one decode
            token); ``len(token_ids)`` is this request's number of scheduled tokens.
        num_computed_tokens: tokens already in the KV cache before this step, i.e. the position
            of ``token_ids[0]``.
        block_table: the request's physical block ids (a copy), logical block ``i`` at index
            ``i``; covers at least ``num_computed_tokens + len(token_ids)`` tokens.
        sample: True when the chunk reaches the request's last known token, so a new token is
            sampled from the last position's logits. False for non-final prefill chunks.
        resumed: True when the step computes from position 0 (new, or resumed after a
            recompute preemption).
        state: the worker's state of the request (params, prompt, outputs, generator).
        spec_token_ids: [speculative decoding] the draft tokens at the end of ``token_ids``
            (after the request's last known token); the last ``len(spec_token_ids) + 1``
            positions are all scored. Empty without drafts.
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_table: list[int]
    sample: bool
    resumed: bool
    state: CachedRequestState = field(repr=False)
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def num_scheduled_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def sampling_params(self) -> SamplingParams:
        return self.state.sampling_params


class RequestStates:
    """The worker's requests by id, updated from each step's message.

    Args:
        block_size: tokens per block (for the draft K/V a cut table keeps; 0: unknown, a cut
            drops all of it).
        num_kv_cache_groups: [hybrid KV cache] table entries per logical block (a cut keeps
            ``num_blocks_kept // num_kv_cache_groups`` logical blocks).
    Attributes:
        requests: request id -> ``CachedRequestState``.
    """

    def __init__(self, block_size: int = 0, num_kv_cache_groups: int = 1) -> None:
        self.block_size = block_size
        self.num_kv_cache_groups = num_kv_cache_groups
        self.requests: dict[str, CachedRequestState] = {}
        # The last update's forks: (parent id, fork's state); they sample from the parent's row.
        self.forks: list[tuple[str, CachedRequestState]] = []

    def update(self, sched: SchedulerOutput) -> list[ScheduledRequest]:
        """Apply one step's message and return the step's requests in batch order.

        Order of application: finished ids are dropped, preempted ids lose their block tables,
        new requests are added, cached ones get their new tokens and blocks (replaced entries
        first, for a copy-on-write). Forks (``NewRequestData.forked_from``) are listed in
        ``self.forks`` for this step.

        Raises:
            RuntimeError: if the message names a request the worker does not hold, sends a known
                request as new, or schedules tokens the worker does not have (a broken sync).
        """
        for req_id in sched.finished_req_ids:
            self.requests.pop(req_id, None)
        for req_id in sched.preempted_req_ids:
            state = self.requests.get(req_id)
            if state is not None:
                state.block_ids = []
                state.cut_draft_kv(0)
        self.forks = []
        for new in sched.scheduled_new_reqs:
            if new.req_id in self.requests:
                raise RuntimeError(f"request {new.req_id!r} was sent as new but the worker already holds it")
            state = self.requests[new.req_id] = CachedRequestState(
                req_id=new.req_id, prompt_token_ids=list(new.prompt_token_ids),
                sampling_params=new.sampling_params,
                token_ids=list(new.prompt_token_ids) + list(new.output_token_ids),
                output_token_ids=list(new.output_token_ids), block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens, lora_request=new.lora_request,
                prompt_embeds=new.prompt_embeds)
            if new.forked_from is not None:
                self.forks.append((new.forked_from, state))
        for cached in sched.scheduled_cached_reqs:
            state = self.requests.get(cached.req_id)
            if state is None:
                raise RuntimeError(f"request {cached.req_id!r} was sent as a diff but the worker does not hold it")
            state.token_ids.extend(cached.new_token_ids)
            state.output_token_ids.extend(cached.new_token_ids)
            if cached.resumed_from_preemption:
                state.block_ids = list(cached.new_block_ids)
                state.cut_draft_kv(0)
            else:
                if cached.num_blocks_kept is not None:   # blocks of rejected drafts went back
                    del state.block_ids[cached.num_blocks_kept:]
                    state.cut_draft_kv(cached.num_blocks_kept // self.num_kv_cache_groups * self.block_size)
                for index, block_id in cached.replaced_block_ids:
                    if not 0 <= index < len(state.block_ids):
                        raise RuntimeError(f"request {cached.req_id!r}: replaced block index {index} outside "
                                           f"its table of {len(state.block_ids)}")
                    state.block_ids[index] = block_id
                state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

        scheduled = []
        for req_id, num_new in sched.num_scheduled_tokens.items():
            state = self.requests.get(req_id)
            if state is None:
                raise RuntimeError(f"request {req_id!r} is scheduled but the worker does not hold it")
            start = state.num_computed_tokens
            end = start + num_new
            drafts = sched.scheduled_spec_decode_tokens.get(req_id, [])
            if end - len(drafts) > len(state.token_ids) or (drafts and end - len(drafts) != len(state.token_ids)):
                raise RuntimeError(
                    f"request {req_id!r}: {num_new} tokens ({len(drafts)} drafts) scheduled from position {start}, "
                    f"but the worker holds {len(state.token_ids)} tokens")
            token_ids = state.token_ids[start:end] + list(drafts) if drafts else state.token_ids[start:end]
            scheduled.append(ScheduledRequest(
                request_id=req_id, token_ids=token_ids, num_computed_tokens=start,
                block_table=list(state.block_ids), sample=end - len(drafts) == len(state.token_ids),
                resumed=start == 0, state=state, spec_token_ids=list(drafts)))
            state.num_computed_tokens = end
        return scheduled
