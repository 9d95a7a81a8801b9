"""Continuous-batching scheduler: one token-budget loop per step, no prefill/decode phases.

Follows vLLM V1's ``Scheduler.schedule`` (``vllm/v1/core/sched/scheduler.py``): each request
just has ``num_computed_tokens`` catching up with ``num_tokens``. A step spends
``max_num_batched_tokens`` on the RUNNING requests first (decodes and unfinished prompt chunks,
in admission order), preempting the most recently admitted request by recomputation when the
KV pool runs dry, and then, if nobody was preempted, admits WAITING requests first come first
served, chunking the prompt that does not fit the remaining budget (chunked prefill,
Sarathi-Serve). Because running requests go first, decodes are never starved by new prompts.

With pipeline parallelism the engine keeps up to ``pipeline_parallel_size`` batches in flight
(vLLM V1's batch queue): ``schedule()`` may run again before an earlier batch's output is back.
A request in a batch still in flight is skipped (not scheduled again, not chosen for
preemption) until ``update_from_output`` receives that batch, so each request is in at most one
batch at a time and its tokens come out as with one batch at a time. A batch then takes at most
``ceil((running + waiting) / P)`` requests, so requests admitted together are spread over P
batches instead of moving through the stages as one.

A request's largest size (prompt + max_tokens, at most ``max_model_len``) must fit in the whole
KV pool; the engine checks ``num_blocks * block_size >= max_model_len`` at startup, otherwise a
request alone in the batch could preempt itself forever.
"""

from __future__ import annotations

import logging
import math
import time
from collections import deque
from typing import TYPE_CHECKING, Iterable

from pagedllm.config import SchedulerConfig
from pagedllm.core.block_pool import NoFreeBlocksError
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput, SchedulerStats
from pagedllm.core.worker_diffs import WorkerDiffTracker

if TYPE_CHECKING:
    from pagedllm.spec_decode.controller import SpecDecodeController

logger = logging.getLogger(__name__)

__all__ = ["Scheduler", "SchedulerStats"]


class Scheduler:
    """Decides, every step, which requests run and how many tokens each computes.

    Args:
        scheduler_config: budgets (``max_num_seqs``, ``max_num_batched_tokens``,
            ``max_model_len``, ``enable_chunked_prefill``).
        kv_cache_manager: the block tables; the scheduler is its only writer.
        max_concurrent_batches: batches the engine keeps in flight (``pipeline_parallel_size``
            with the multi-process executor, else 1).
        spec_decoder: [speculative decoding] sizes and proposes each decoding request's drafts
            (``spec_decode/controller.py``), or None: no speculation.

    Attributes:
        waiting: WAITING and PREEMPTED requests, FCFS (preempted ones re-enter at the front).
        running: RUNNING requests in admission order (the last one is preempted first).
        num_preemptions_total: preemptions since construction.
    """

    def __init__(self, scheduler_config: SchedulerConfig, kv_cache_manager: KVCacheManager,
                 max_concurrent_batches: int = 1, spec_decoder: "SpecDecodeController | None" = None,
                 max_loras: int = 0) -> None:
        self.scheduler_config = scheduler_config
        # Batches the engine keeps in flight (pipeline stages); above 1 a batch takes at most
        # ceil(unfinished requests / max_concurrent_batches) requests, so each stage gets work.
        self.max_concurrent_batches = max_concurrent_batches
        self.kv_cache_manager = kv_cache_manager
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.max_num_batched_tokens = scheduler_config.max_num_batched_tokens
        self.max_model_len = scheduler_config.max_model_len
        self.enable_chunked_prefill = scheduler_config.enable_chunked_prefill

        self.requests: dict[str, Request] = {}  # every unfinished request, by id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # Finished or aborted since the last schedule(); reported in the next SchedulerOutput.
        self.finished_req_ids: set[str] = set()
        self.num_preemptions_total = 0
        self.preemption_mode = scheduler_config.preemption_mode
        # Preemptions since construction by how they were done ("recompute" / "swap").
        self.num_preemptions_by_mode: dict[str, int] = {"recompute": 0, "swap": 0}
        self._logged_swap_fallback = False
        self._step_stats = SchedulerStats()
        # What the worker holds of each request it has seen: the per-step message sends only what
        # it lacks (new requests in full once, then diffs).
        self.worker_diffs = WorkerDiffTracker(kv_cache_manager.num_kv_cache_groups)
        # [structured output] requests finished inside schedule() (their grammar failed to
        # compile): their outputs go out with the next update_from_output.
        self._finished_in_schedule: list[EngineCoreOutput] = []
        # n > 1 / best_of: parent id -> the samples waiting to fork its blocks once its prompt
        # is computed (they are in ``requests`` but in neither queue).
        self._pending_forks: dict[str, list[Request]] = {}
        # Pipeline parallelism (batch queue): requests in a batch the workers are still running
        # (scheduled, output not back). They are neither scheduled again nor preempted until
        # ``update_from_output`` gets that batch. Empty between steps when one batch runs at a time.
        self._in_flight: set[str] = set()
        # [speculative decoding] the drafts' sizing and proposer.
        self.spec_decoder = spec_decoder
        # [LoRA] most distinct adapters among the running requests (the worker's slots); 0: no LoRA.
        self.max_loras = max_loras

    # -- queues ----------------------------------------------------------------------------

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def get_num_unfinished_requests(self) -> int:
        return len(self.running) + len(self.waiting) + self.num_pending_forks

    @property
    def num_pending_forks(self) -> int:
        """Samples waiting for their parent's prompt before they fork (each will take a seq)."""
        return sum(len(forks) for forks in self._pending_forks.values())

    def has_unfinished_requests(self) -> bool:
        return self.get_num_unfinished_requests() > 0

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or ``None`` (unknown or already finished)."""
        return self.requests.get(request_id)

    def add_request(self, request: Request, forks: Iterable[Request] = ()) -> None:
        """Queue a new request (status WAITING) at the back of the waiting queue.

        ``forks``: the other samples of an n > 1 / best_of request (same prompt). Only
        ``request`` computes the prompt; the step that computes its last prompt token forks its
        block table to each of them (``KVCacheManager.fork``: the partial last block included),
        and they draw their first token from the same logits row with their own params and
        generator. The group is admitted together: ``request`` enters only when
        ``max_num_seqs`` has room for all of them. After the fork each sample is an ordinary
        request (preempted, recomputed or swapped on its own, from its own tokens).

        Raises:
            ValueError: if an id is already in use (or still in a batch in flight), a request is not fresh, its prompt is longer
                than ``max_model_len`` (the engine rejects those earlier), the forks' prompts
                differ, or the group is larger than ``max_num_seqs``.
        """
        forks = list(forks)
        for r in [request] + forks:
            if r.request_id in self.requests:
                raise ValueError(f"request id {r.request_id!r} is already scheduled")
            if r.request_id in self._in_flight:   # finished meanwhile; its late output is on its way
                raise ValueError(f"request id {r.request_id!r} is still in a batch in flight; use another id")
            if r.status not in (RequestStatus.WAITING, RequestStatus.WAITING_FOR_FSM) or r.num_computed_tokens != 0 or r.num_output_tokens:
                raise ValueError(
                    f"request {r.request_id!r} must be new (WAITING, 0 computed tokens), got "
                    f"{r.status.name} with {r.num_computed_tokens} computed tokens")
        if request.num_tokens > self.max_model_len:
            raise ValueError(
                f"request {request.request_id!r} has {request.num_tokens} tokens, more than "
                f"max_model_len ({self.max_model_len})")
        if any(f.prompt_token_ids != request.prompt_token_ids for f in forks):
            raise ValueError("forks must have the same prompt as their parent request")
        if 1 + len(forks) > self.max_num_seqs:
            raise ValueError(f"n (or best_of) = {1 + len(forks)} samples exceed max_num_seqs "
                             f"({self.max_num_seqs}); they run as one group")
        self.requests[request.request_id] = request
        for f in forks:
            self.requests[f.request_id] = f
        if forks:
            self._pending_forks[request.request_id] = forks
        self.waiting.append(request)

    # -- schedule --------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """Plan one step within the token and sequence budgets.

        Side effects: allocates blocks, advances each scheduled request's
        ``num_computed_tokens`` by its scheduled count, moves admitted requests to RUNNING and
        preempted ones (blocks freed, ``num_computed_tokens`` reset to 0) to the front of the
        waiting queue.

        Returns:
            The step's ``SchedulerOutput`` (empty ``num_scheduled_tokens`` when nothing can run).
        """
        budget = self.max_num_batched_tokens
        output = SchedulerOutput()
        preempted_ids: set[str] = set()
        num_prefill_tokens = num_decode_tokens = 0
        now = time.monotonic()

        # With P batches in flight, one batch takes at most 1/P of the requests (rounded up):
        # otherwise a burst admitted together would move as one batch, one stage at a time.
        max_batch_reqs = self.max_num_seqs if self.max_concurrent_batches == 1 else \
            -(-(len(self.running) + len(self.waiting)) // self.max_concurrent_batches)

        if self.spec_decoder is not None:
            self.spec_decoder.begin_step(len(self.running))
        # 1) RUNNING requests, in admission order.
        req_index = 0
        while req_index < len(self.running) and budget > 0 and len(output.num_scheduled_tokens) < max_batch_reqs:
            request = self.running[req_index]
            num_new = 0 if request.request_id in self._in_flight else self._num_new_tokens(request, budget)
            if num_new <= 0:
                # Nothing to compute (its sampled token has not come back, or a batch still
                # running holds it); skip it.
                req_index += 1
                continue
            is_decode = num_new == 1 and request.num_output_tokens > 0 \
                and request.num_computed_tokens + 1 == request.num_tokens
            # [speculative decoding] a decode verifies its drafts in the same forward.
            drafts = self._propose_drafts(request, budget) if is_decode and self.spec_decoder is not None else []
            # [draft models] slots for the draft model's K/V past the step's tokens.
            lookahead = self._num_lookahead(request, num_new)
            num_new += len(drafts)
            cow_pairs: list[tuple[int, int]] = []
            while True:
                new_blocks = None
                try:
                    # Its next token goes into a block another table shares (a fork): copy first.
                    cow_pairs = self.kv_cache_manager.cow_last_blocks_if_shared(request) or cow_pairs
                    new_blocks = self.kv_cache_manager.allocate_slots(request, num_new + lookahead)
                except NoFreeBlocksError:
                    pass
                if new_blocks is not None:
                    break
                if lookahead:   # no blocks for the draft's lookahead: try without it first
                    lookahead = 0
                    continue
                if drafts:   # no blocks for the drafts: decode without them before preempting anyone
                    num_new -= len(drafts)
                    drafts = []
                    continue
                # Out of blocks: preempt the most recently admitted request that no batch in
                # flight holds (``request`` itself at the latest).
                victim = self._pop_preemption_victim()
                self._preempt(victim, output)
                preempted_ids.add(victim.request_id)
                if victim is request:
                    break
            if new_blocks is None:
                break  # the request preempted itself; the pool cannot fit anything more
            output.blocks_to_copy.extend(cow_pairs)
            if drafts:
                output.scheduled_spec_decode_tokens[request.request_id] = drafts
            if lookahead:
                output.num_lookahead_tokens[request.request_id] = lookahead
            self._schedule_request(request, num_new, output)
            if is_decode:
                num_decode_tokens += num_new
            else:
                num_prefill_tokens += num_new
            budget -= num_new
            req_index += 1

        # 2) WAITING requests, FCFS, only if nobody had to be preempted this step.
        if not preempted_ids:
            seats, groups = self._seats_in_use()
            # Skipped, keeping their place: paused requests (preempted beams whose round is still
            # open: their siblings behind them must run to close the round) and [structured
            # output] requests whose grammar is still compiling.
            skipped: list[Request] = []
            loras = self.running_lora_ids()
            while self.waiting and budget > 0 and len(output.num_scheduled_tokens) < max_batch_reqs:
                request = self.waiting[0]
                if request.paused or not self._lora_fits(request, loras):
                    # [LoRA] its adapter would need a slot while all hold running adapters: it
                    # waits, keeping its place, and requests for resident adapters go ahead.
                    skipped.append(self.waiting.popleft())
                    continue
                if request.status == RequestStatus.WAITING_FOR_FSM and not self._grammar_ready(request):
                    self.waiting.popleft()
                    if not request.is_finished():
                        skipped.append(request)
                    continue
                need = self._seats_needed(request, groups)
                if seats + need > self.max_num_seqs:
                    break  # a group (its samples or beams will fork) enters only with room for all
                swapped = self.kv_cache_manager.is_swapped(request)
                num_new = self._allocate_admitted(request, budget, output)
                if num_new is None:
                    if self._preempt_paused(output, preempted_ids):
                        continue  # blocks held by an idle beam were freed: try again
                    break  # FCFS: do not let later requests skip ahead
                if num_new == 0:
                    break  # it does not fit the budget (FCFS)
                seats += self._take_seats(request, need, groups)
                self.waiting.popleft()
                self.running.append(request)
                if request.lora_request is not None:
                    loras.add(request.lora_request.lora_int_id)
                request.status = RequestStatus.RUNNING
                if request.first_scheduled_time is None:
                    request.first_scheduled_time = now
                # A swapped-in request resumes its computation; any other starts it (again).
                self._schedule_request(request, num_new, output, admitted=not swapped)
                num_prefill_tokens += num_new
                budget -= num_new
            self.waiting.extendleft(reversed(skipped))

        self._fork_pending(output, now)
        self._in_flight.update(output.num_scheduled_tokens)
        self._in_flight.update(output.forked_req_ids)
        total = self.max_num_batched_tokens - budget
        output.total_num_scheduled_tokens = total
        output.finished_req_ids = self.finished_req_ids
        output.preempted_req_ids = preempted_ids
        self.finished_req_ids = set()
        self._step_stats = SchedulerStats(
            num_preemptions=len(preempted_ids),
            num_scheduled_requests=len(output.num_scheduled_tokens),
            num_scheduled_tokens=total,
            num_prefill_tokens=num_prefill_tokens,
            num_decode_tokens=num_decode_tokens,
            num_used_blocks_scheduled=self.kv_cache_manager.num_blocks - self.kv_cache_manager.num_free_blocks,
        )
        logger.debug(
            "step: %d reqs, %d tokens (%d prefill, %d decode), %d preempted, %d running, "
            "%d waiting, %d/%d blocks free", len(output.num_scheduled_tokens), total, num_prefill_tokens,
            num_decode_tokens, len(preempted_ids), len(self.running), len(self.waiting),
            self.kv_cache_manager.num_free_blocks, self.kv_cache_manager.num_blocks)
        return output

    def _allocate_admitted(self, request: Request, budget: int, output: SchedulerOutput) -> int | None:
        """Blocks for the step of a waiting request about to be admitted.

        A swapped-out request goes back into device blocks (``swap_in``; its pairs join
        ``output.blocks_to_swap_in``), nothing recomputed. Any other takes its prefix-cache hit
        (``get_computed_blocks``: whole blocks from the prompt start) and ``allocate_slots`` for
        the rest, [draft models] with lookahead slots when they fit; its ``num_computed_tokens``
        becomes the hit.

        Returns:
            The tokens it computes this step; 0 when it does not fit ``budget`` (tokens), or
            ``None`` when the pool lacks blocks (nothing changed in either case).
        """
        kv = self.kv_cache_manager
        if kv.is_swapped(request):
            num_new = self._num_new_tokens(request, budget)
            if num_new <= 0:
                return 0
            pairs = kv.swap_in(request, num_new)
            if pairs is None:
                return None
            output.blocks_to_swap_in.extend(pairs)
            return num_new
        # [prefix caching] hit blocks from the prompt start (a waiting request has none).
        computed = kv.get_computed_blocks(request)
        request.num_computed_tokens = computed.num_computed_tokens  # for the budget math
        num_new = self._num_new_tokens(request, budget)
        fits = num_new > 0 and (self.enable_chunked_prefill
                                or request.num_tokens - computed.num_computed_tokens <= budget)
        # [draft models] slots for the draft model's K/V past the prompt, when they fit.
        lookahead = self._num_lookahead(request, num_new) if fits else 0
        request.num_computed_tokens = 0  # allocate_slots adds the hit itself
        if not fits:
            return 0
        if self.running and not kv.can_admit(request, computed, self.max_num_batched_tokens):
            return None   # its whole prompt does not fit beside the running requests (alone, it may start)
        if lookahead and kv.allocate_slots(request, num_new + lookahead, computed) is not None:
            output.num_lookahead_tokens[request.request_id] = lookahead
        elif kv.allocate_slots(request, num_new, computed) is None:
            return None
        request.num_computed_tokens = computed.num_computed_tokens
        if request.num_preemptions == 0:
            request.num_cached_tokens = computed.num_computed_tokens
        return num_new

    def running_lora_ids(self) -> set[int]:
        """[LoRA] The adapters (``lora_int_id``) of the running requests."""
        return {r.lora_request.lora_int_id for r in self.running if r.lora_request is not None}

    def waiting_lora_ids(self) -> set[int]:
        """[LoRA] The adapters of the waiting requests."""
        return {r.lora_request.lora_int_id for r in self.waiting if r.lora_request is not None}

    def _lora_fits(self, request: Request, loras: set[int]) -> bool:
        """[LoRA] Whether admitting ``request`` keeps the running adapters within ``max_loras``."""
        lora = request.lora_request
        return lora is None or not self.max_loras or lora.lora_int_id in loras or len(loras) < self.max_loras

    def _propose_drafts(self, request: Request, budget: int) -> list[int]:
        """[speculative decoding] Draft tokens for a decoding request to verify this step: as many
        as the controller allows for it, within the token budget (its own token included) and
        short enough that the request cannot pass ``max_tokens`` or ``max_model_len`` even with
        all of them accepted. None for requests whose step must see one token at a time:
        grammar-constrained ones (the matcher has no rollback here), beams (a group ranks
        candidates every step), requests with per-request logits processors and prompts given as
        embeddings (their placeholder ids are no text to draft from)."""
        spec = self.spec_decoder
        if request.structured_output_request is not None or request.group_id is not None \
                or request.sampling_params.logits_processors or request.prompt_embeds is not None:
            return []
        room = min(budget - 1, request.max_tokens - request.num_output_tokens - 1,
                   self.max_model_len - request.num_tokens - 1)
        k = min(spec.num_drafts(request.request_id), room)
        drafts = spec.propose(request.request_id, request.all_token_ids, k) if k > 0 else []
        if not drafts:
            spec.skipped(request.request_id)
        return drafts

    def _num_lookahead(self, request: Request, num_new: int) -> int:
        """[draft models] Lookahead slots (tokens) for a request whose ``num_new`` tokens this step
        reach its last known token: the drafts the worker's draft model proposes after the step
        (the controller's size for it now), which write K/V up to ``k - 1`` positions past the
        step's new token. 0 without a draft model, for a non-final prefill chunk, for requests
        that never draft (``_propose_drafts``'s exclusions) and for a parent whose samples fork
        this step (they take its whole table)."""
        spec = self.spec_decoder
        if spec is None or not spec.config.uses_draft_model \
                or request.num_computed_tokens + num_new != request.num_tokens \
                or request.structured_output_request is not None or request.group_id is not None \
                or request.sampling_params.logits_processors or request.prompt_embeds is not None \
                or request.request_id in self._pending_forks:
            return 0
        room = min(request.max_tokens - request.num_output_tokens - 1, self.max_model_len - request.num_tokens - 1)
        return max(0, min(spec.num_drafts(request.request_id), room))

    def _pop_preemption_victim(self) -> Request:
        """Remove and return the most recently admitted running request that is not in a batch
        still in flight (its blocks are being written; the running loop's own request never is).

        Raises:
            RuntimeError: if every running request is in flight (the caller's request is always
                a candidate, so this is a scheduler bug).
        """
        for i in range(len(self.running) - 1, -1, -1):
            if self.running[i].request_id not in self._in_flight:
                return self.running.pop(i)
        raise RuntimeError(f"all {len(self.running)} running requests are in flight; none can be preempted")

    @property
    def last_step_stats(self) -> SchedulerStats:
        """The last ``schedule()`` call's counts (requests, tokens, prefill / decode tokens)."""
        return self._step_stats

    @property
    def num_in_flight(self) -> int:
        """Requests in batches scheduled but not yet updated from their output."""
        return len(self._in_flight)

    def _preempt_paused(self, output: SchedulerOutput, preempted_ids: set[str]) -> bool:
        """Preempt the most recently admitted paused running request (a beam that reported its
        round and waits for its siblings: it holds blocks but computes nothing), so that a waiting
        request can have its blocks. Without this, paused beams holding the whole pool while their
        preempted siblings wait for blocks would wait forever.

        Its report is kept (the beam search manager has it): it stays paused in the waiting queue
        until its round closes, then recomputes (or swaps in) its tokens with the kept last token.

        Returns:
            False when no running request is paused.
        """
        for index in range(len(self.running) - 1, -1, -1):
            victim = self.running[index]
            if victim.paused and victim.request_id not in self._in_flight:
                del self.running[index]
                self._preempt(victim, output)
                preempted_ids.add(victim.request_id)
                return True
        return False

    def _seats_in_use(self) -> tuple[int, set[str]]:
        """Seats of ``max_num_seqs`` taken now, and the beam groups holding theirs.

        A running request takes one seat, except that a beam group takes its ``group_width`` once
        (from its first running beam on: its beams fork up to that many between steps, without
        asking); the samples that will fork from a running parent (n > 1 / best_of) take one each.
        """
        groups: set[str] = set()
        seats = 0
        for request in self.running:
            if request.group_id is None:
                seats += 1
            elif request.group_id not in groups:
                groups.add(request.group_id)
                seats += request.group_width
        for parent_id, forks in self._pending_forks.items():
            if self.requests[parent_id].status == RequestStatus.RUNNING:
                seats += len(forks)
        return seats, groups

    def _seats_needed(self, request: Request, groups: set[str]) -> int:
        """Seats a waiting request takes when admitted: its group's width (none if the group holds
        its seats already), or itself plus the samples that will fork from it."""
        if request.group_id is not None:
            return 0 if request.group_id in groups else request.group_width
        return 1 + len(self._pending_forks.get(request.request_id, ()))

    @staticmethod
    def _take_seats(request: Request, need: int, groups: set[str]) -> int:
        if request.group_id is not None:
            groups.add(request.group_id)
        return need

    def _fork_pending(self, output: SchedulerOutput, now: float) -> None:
        """Fork the waiting samples of every parent whose last prompt token is computed this step.

        Each sample takes the parent's block table (one more reference per block, the partial
        last one included), the parent's computed tokens and a RUNNING status, and goes to the
        worker as a ``NewRequestData`` with ``forked_from``: it computes nothing this step and
        draws its first token from the parent's logits row.
        """
        for parent_id in [pid for pid in self._pending_forks
                          if pid in output.num_scheduled_tokens]:
            parent = self.requests[parent_id]
            if parent.num_computed_tokens != parent.num_tokens or parent.status != RequestStatus.RUNNING:
                continue  # a non-final prompt chunk
            for child in self._pending_forks.pop(parent_id):
                child.num_cached_tokens = parent.num_cached_tokens
                child.block_hashes = list(parent.block_hashes)
                self._fork(parent, child, now)
                output.scheduled_new_reqs.append(self.worker_diffs.new_request_data(
                    child, self.kv_cache_manager.get_block_table(child.request_id), forked_from=parent_id))
                if child.structured_output_request is not None:
                    # [structured output] its own matcher (the parent's grammar is compiled, so the
                    # shared compile is done) and its own bitmask row for the parent's logits row.
                    self._start_forked_matcher(child)
                    rows = output.structured_output_request_ids
                    rows[child.request_id] = len(rows)

    def _start_forked_matcher(self, child: Request) -> None:
        """[structured output] Build a forked sample's matcher at its initial state (it samples
        its first token now, from its parent's row).

        Raises:
            RuntimeError: if its grammar is not compiled though its parent's is (they share one
                compile), or failed.
        """
        handle = child.structured_output_request
        if not handle.is_ready() or handle.error is not None:
            raise RuntimeError(f"request {child.request_id!r} forks from a parent whose grammar is compiled, "
                               f"but its own is not ready (error: {handle.error})")

    def fork_request(self, parent_id: str, child: Request, last_token_id: int) -> None:
        """Fork a running request between steps into ``child`` whose last token differs (beam
        search: a surviving beam extends its parent with another candidate token).

        The parent has just sampled a token (its K/V not computed yet: ``num_computed_tokens ==
        num_tokens - 1``). The child gets the parent's prompt, its outputs with the last one
        replaced by ``last_token_id``, and the parent's blocks (shared; copy-on-write before
        the first write into the shared partial block), so nothing of the prefix is recomputed.
        A parent preempted meanwhile has no blocks to share: the child then waits and computes
        its tokens.

        Raises:
            ValueError: if the parent has not just sampled a token, the child's id is in use,
                or the child is not fresh.
        """
        parent = self.requests.get(parent_id)
        if parent is None or parent.num_output_tokens == 0 or parent.num_computed_tokens > parent.num_tokens - 1:
            raise ValueError(f"request {parent_id!r} is not an unfinished request that has just sampled a token")
        if child.request_id in self.requests:
            raise ValueError(f"request id {child.request_id!r} is already scheduled")
        if child.num_output_tokens or child.prompt_token_ids != parent.prompt_token_ids:
            raise ValueError("the child must be a fresh request with the parent's prompt")
        if parent.structured_output_request is not None or child.structured_output_request is not None:
            raise ValueError("beam search forks do not support structured outputs (vLLM neither)")
        child.append_output_token_ids(parent.output_token_ids[:-1] + [last_token_id])
        bs = self.kv_cache_manager.block_size
        child.block_hashes = parent.block_hashes[:(child.num_tokens - 1) // bs]
        child.num_cached_tokens = parent.num_cached_tokens
        self.requests[child.request_id] = child
        if parent.status != RequestStatus.RUNNING or not self.kv_cache_manager.get_block_table(parent_id):
            # The parent was preempted meanwhile (no device blocks): the child computes its tokens.
            self.waiting.append(child)
            return
        self._fork(parent, child, time.monotonic())

    def _fork(self, parent: Request, child: Request, now: float) -> None:
        """Run ``child`` on the parent's blocks: ``KVCacheManager.fork`` (one more reference per
        block, the partial last one included; copy-on-write before the first write into it), the
        parent's computed tokens, RUNNING at the back of ``running``. Both fork paths end here:
        n > 1 / best_of samples (``_fork_pending``) and beams (``fork_request``)."""
        self.kv_cache_manager.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = RequestStatus.RUNNING
        child.first_scheduled_time = now
        self.running.append(child)

    def replace_last_token(self, request_id: str, token_id: int) -> None:
        """Replace the token a running request sampled in the last step (not computed yet, not
        sent to the worker yet) by ``token_id`` (beam search keeps another candidate).

        Raises:
            ValueError: if the request is not running between steps with a sampled token.
        """
        request = self.requests.get(request_id)
        if request is None or request.num_output_tokens == 0 or request.num_computed_tokens > request.num_tokens - 1:
            raise ValueError(f"request {request_id!r} is not an unfinished request that has just sampled a token")
        request.output_token_ids[-1] = token_id
        request.all_token_ids[-1] = token_id
        del request.block_hashes[(request.num_tokens - 1) // self.kv_cache_manager.block_size:]

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        """Tokens to compute for ``request`` this step: the rest of its known tokens, capped by
        the token budget (chunked prefill) and by ``max_model_len``; 0 while it is paused."""
        if request.paused:
            return 0
        num_new = request.num_tokens - request.num_computed_tokens
        num_new = min(num_new, budget, self.max_model_len - request.num_computed_tokens)
        return num_new

    def _schedule_request(self, request: Request, num_new: int, output: SchedulerOutput,
                          admitted: bool = False) -> None:
        """Add the request's share of the step to ``output`` (in full the first time the worker
        sees it, else as a diff) and advance its ``num_computed_tokens``.

        ``admitted``: the request comes from the waiting queue this step (new or preempted; its
        ``num_computed_tokens`` is its prefix-cache hit, possibly 0)."""
        req_id = request.request_id
        if admitted:
            # A fresh (re)computation: the runner will produce prompt logprobs from the start.
            request.num_prompt_logprobs_seen = 0
        block_table = self.kv_cache_manager.get_block_table(req_id)
        if req_id not in self.worker_diffs:
            output.scheduled_new_reqs.append(self.worker_diffs.new_request_data(request, block_table))
        else:
            output.scheduled_cached_reqs.append(self.worker_diffs.cached_request_data(request, block_table))
        output.num_scheduled_tokens[req_id] = num_new
        request.num_computed_tokens += num_new
        if request.structured_output_request is not None and request.num_computed_tokens == request.num_tokens:
            # [structured output] it samples this step: the engine fills its bitmask row.
            output.structured_output_request_ids[req_id] = len(output.structured_output_request_ids)

    def _grammar_ready(self, request: Request) -> bool:
        """[structured output] Whether a WAITING_FOR_FSM request can be admitted: True once its
        grammar is compiled (the status becomes WAITING). A grammar that failed to compile
        finishes the request (aborted, its error logged; the caller takes it off the queue) and
        returns False."""
        handle = request.structured_output_request
        if not handle.is_ready():
            return False
        if handle.error is not None:
            logger.error("request %s: its grammar failed to compile: %s", request.request_id, handle.error)
            request.status = RequestStatus.FINISHED_ABORTED
            self._free_request(request)
            self._finished_in_schedule.append(EngineCoreOutput(
                request_id=request.request_id, finish_reason=request.get_finished_reason()))
            return False
        request.status = RequestStatus.WAITING
        return True

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached block (vLLM's ``Scheduler.reset_prefix_cache``).

        Args:
            reset_running_requests: first preempt every running request by recomputation (last
                admitted first, so they resume in their order); their tokens are kept and their
                KV is computed again when they are scheduled next.
        Returns:
            True when the cache was cleared; False (nothing changed) while requests hold blocks.
        Raises:
            RuntimeError: with ``reset_running_requests``, when blocks are still held after the
                preemption (requests in a batch still in flight: pipeline parallelism).
        """
        if reset_running_requests:
            for index in range(len(self.running) - 1, -1, -1):
                request = self.running[index]
                if request.request_id not in self._in_flight:
                    del self.running[index]
                    self._preempt(request)   # no SchedulerOutput: recompute, never swap
        cleared = self.kv_cache_manager.reset_prefix_cache()
        if reset_running_requests and not cleared:
            raise RuntimeError(f"the prefix cache could not be reset after preempting the running requests: "
                               f"{len(self._in_flight)} request(s) are in a batch in flight, "
                               f"{self.kv_cache_manager.num_blocks - self.kv_cache_manager.num_free_blocks} "
                               f"block(s) in use")
        return cleared

    def _preempt(self, request: Request, output: SchedulerOutput | None = None) -> None:
        """Preempt a running request and requeue it at the front.

        "recompute": free the blocks and forget the progress. "swap": copy its blocks to the
        host pool (``output.blocks_to_swap_out``) and keep ``num_computed_tokens``; when the host
        pool cannot take it, recompute instead (logged once).
        """
        kv = self.kv_cache_manager
        mode = "recompute"
        if self.preemption_mode == "swap" and output is not None:
            if kv.can_swap_out(request):
                output.blocks_to_swap_out.extend(kv.swap_out(request))
                mode = "swap"
            elif not self._logged_swap_fallback:
                self._logged_swap_fallback = True
                logger.warning("the swap space (%d host blocks, %d free) cannot take request %s: it is "
                               "preempted by recomputation (logged once)", kv.num_cpu_blocks,
                               0 if kv.cpu_block_pool is None else kv.cpu_block_pool.get_num_free_blocks(),
                               request.request_id)
        if mode == "recompute":
            kv.free(request)
            request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        self.worker_diffs.preempt(request.request_id)
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.num_preemptions_by_mode[mode] += 1
        self.waiting.appendleft(request)
        logger.debug("preempted request %s (%d tokens, preemption #%d)", request.request_id,
                     request.num_tokens, request.num_preemptions)

    # -- results ---------------------------------------------------------------------------

    def update_from_output(self, scheduler_output: SchedulerOutput,
                           runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append the sampled tokens, check stops, free finished requests.

        ``scheduler_output`` is the batch this output belongs to (the oldest in flight); its
        requests may be scheduled again from now on. Requests finished through
        ``finish_requests`` since the step was scheduled are skipped.
        Stop check, per new token: a token in ``sampling_params.all_stop_token_ids`` once
        ``num_output_tokens >= min_tokens`` finishes the request as STOPPED (``stop_reason`` =
        the token id); otherwise reaching ``max_tokens`` outputs or ``max_model_len`` tokens
        finishes it as LENGTH_CAPPED. Finished requests lose their blocks at once and are listed
        in the next ``SchedulerOutput.finished_req_ids``.

        Returns:
            One ``EngineCoreOutput`` per request that got a token, prompt logprobs, or finished;
            sampled requests first in batch order, then prompt-logprob-only ones.
        Raises:
            RuntimeError: if the runner sampled for a running request that was not scheduled to
                sample, or returned lists of mismatched lengths.
        """
        req_ids = runner_output.req_ids
        if len(runner_output.sampled_token_ids) != len(req_ids):
            raise RuntimeError(
                f"runner returned {len(runner_output.sampled_token_ids)} sampled tokens for "
                f"{len(req_ids)} requests")
        scheduled = scheduler_output.num_scheduled_tokens
        forked = scheduler_output.forked_req_ids
        spec_tokens = scheduler_output.scheduled_spec_decode_tokens
        self._in_flight.difference_update(scheduled)
        self._in_flight.difference_update(forked)
        outputs: dict[str, EngineCoreOutput] = {}

        # Prompt logprobs first, while every request of the step is still known.
        prompt_lps: dict[str, list] = {}
        for req_id, lps in runner_output.prompt_logprobs.items():
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING or lps is None:
                continue
            skip = max(0, request.num_prompt_logprobs_delivered - request.num_prompt_logprobs_seen)
            request.num_prompt_logprobs_seen += len(lps)
            request.num_prompt_logprobs_delivered = max(
                request.num_prompt_logprobs_delivered, request.num_prompt_logprobs_seen)
            new = list(lps[skip:])
            if new:
                prompt_lps[req_id] = new

        finished: set[str] = set()
        trimmed: list[Request] = []
        for i, req_id in enumerate(req_ids):
            request = self.requests.get(req_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished or aborted meanwhile: a late output
            # [speculative decoding] the rejected drafts' K/V is not part of the request.
            drafts = spec_tokens.get(req_id, ())
            num_accepted = runner_output.num_accepted_tokens.get(req_id, 0) if drafts else 0
            if drafts:
                request.num_computed_tokens -= len(drafts) - num_accepted
                self.spec_decoder.record(req_id, len(drafts), num_accepted)
                trimmed.append(request)
            if (req_id not in scheduled and req_id not in forked) \
                    or request.num_computed_tokens != request.num_tokens + num_accepted:
                raise RuntimeError(
                    f"runner sampled for request {req_id!r}, which was not scheduled to sample")
            token_ids = [*drafts[:num_accepted], runner_output.sampled_token_ids[i]]
            logprob = runner_output.sampled_logprobs[i] if i < len(runner_output.sampled_logprobs) else math.nan
            logprobs = [*runner_output.accepted_logprobs.get(req_id, [math.nan] * num_accepted), logprob]
            top = runner_output.top_logprobs[i] if i < len(runner_output.top_logprobs) else None
            tops = [*runner_output.accepted_top_logprobs.get(req_id, [None] * num_accepted), top]
            out = EngineCoreOutput(request_id=req_id, num_cached_tokens=request.num_cached_tokens,
                                   first_scheduled_time=request.first_scheduled_time)
            for token_id, token_lp, token_top in zip(token_ids, logprobs, tops):
                request.append_output_token_ids(token_id)
                if request.structured_output_request is not None \
                        and not request.structured_output_request.accept_tokens([token_id]):
                    logger.error("request %s: the grammar rejected sampled token %d", req_id, token_id)
                out.new_token_ids.append(token_id)
                if not math.isnan(token_lp):  # NaN: the request did not ask for it
                    out.new_logprobs.append(token_lp)
                    request.cumulative_logprob += token_lp
                if i < len(runner_output.top_logprobs):
                    out.new_top_logprobs.append(token_top)
                if self._check_stop(request):
                    finished.add(req_id)
                    out.finish_reason = request.get_finished_reason()
                    out.stop_reason = request.stop_reason
                    break
            if req_id in prompt_lps:
                out.new_prompt_logprobs = prompt_lps.pop(req_id)
            outputs[req_id] = out
        # [draft models] the drafts for each request's next step; the lookahead blocks go back.
        # (Every request that sampled gets its entry, empty without drafts: older drafts follow
        # fewer tokens.)
        if self.spec_decoder is not None and self.spec_decoder.config.uses_draft_model:
            running = [req_id for req_id in req_ids if req_id not in finished and req_id in self.requests
                       and self.requests[req_id].status == RequestStatus.RUNNING]
            self.spec_decoder.set_worker_drafts({req_id: runner_output.draft_token_ids.get(req_id, [])
                                                 for req_id in running})
            lookahead = scheduler_output.num_lookahead_tokens
            trimmed += [self.requests[req_id] for req_id in running if req_id in lookahead and req_id not in spec_tokens]
        # [speculative decoding] blocks that held only rejected drafts go back to the pool.
        for request in trimmed:
            if request.request_id not in finished:
                self._trim_blocks(request)
        # [prefix caching] the step's K/V is written: register the blocks it filled (after the
        # accepted drafts joined the tokens, before finished requests free theirs).
        for request in self.running:
            self.kv_cache_manager.cache_blocks(request)

        for req_id, lps in prompt_lps.items():
            outputs[req_id] = EngineCoreOutput(request_id=req_id, new_prompt_logprobs=lps)
        for out in self._finished_in_schedule:
            outputs[out.request_id] = out
        self._finished_in_schedule = []

        if finished:
            self.running = [r for r in self.running if r.request_id not in finished]
            for req_id in finished:
                self._free_request(self.requests[req_id])
        return list(outputs.values())

    def _trim_blocks(self, request: Request) -> None:
        """[speculative decoding] Free the blocks past the request's computed tokens, and have the
        worker cut its copy of the table on the request's next diff."""
        self.kv_cache_manager.trim(request)
        self.worker_diffs.trim(request.request_id, self.kv_cache_manager.get_block_table(request.request_id))

    def _check_stop(self, request: Request) -> bool:
        """Set a FINISHED_* status if the last token ends the request; True when it does."""
        params = request.sampling_params
        last = request.output_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens and last in params.all_stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            # vLLM's rule (v1/core/sched/utils.py check_stop): the tokenizer's EOS ends the
            # request with stop_reason None; any other stop id (stop_token_ids, and the
            # generation config's extra EOS ids, which vLLM adds to stop_token_ids) is the reason.
            eos = params.eos_token_ids
            request.stop_reason = None if (not params.ignore_eos and eos and last == eos[0]) else last
            return True
        if request.structured_output_request is not None and request.structured_output_request.is_terminated():
            request.status = RequestStatus.FINISHED_STOPPED  # the grammar allows nothing more
            return True
        if (request.num_output_tokens >= request.max_tokens
                or request.num_tokens >= self.max_model_len):
            request.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        return False

    def _free_request(self, request: Request) -> None:
        """Return the blocks and forget a finished request (its id goes to the next step)."""
        self.kv_cache_manager.free(request)
        self.finished_req_ids.add(request.request_id)
        del self.requests[request.request_id]
        self.worker_diffs.forget(request.request_id)
        if self.spec_decoder is not None:
            self.spec_decoder.finish_request(request.request_id, request.all_token_ids, request.num_prompt_tokens)
        # A parent finished before its prompt was computed (abort): its waiting samples no
        # longer have blocks to fork; they compute the prompt themselves.
        for child in self._pending_forks.pop(request.request_id, ()):
            if not child.is_finished():
                self.waiting.append(child)

    def finish_requests(self, request_ids: str | Iterable[str],
                        finished_status: RequestStatus) -> None:
        """Finish requests from outside the step (abort, disconnect, stop string).

        Their blocks are freed at once, they leave the queues, later runner outputs for them
        are ignored, and their ids go out in the next ``SchedulerOutput.finished_req_ids``.
        Unknown or already finished ids are ignored.

        Raises:
            ValueError: if ``finished_status`` is not a FINISHED_* status.
        """
        if not RequestStatus.is_finished(finished_status):
            raise ValueError(
                f"finished_status must be a FINISHED_* status, got {finished_status!r}")
        if isinstance(request_ids, str):
            request_ids = (request_ids,)
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request in self.waiting:
                self.waiting.remove(request)
            else:  # a sample still waiting to fork
                for parent_id, forks in list(self._pending_forks.items()):
                    if request in forks:
                        forks.remove(request)
                        if not forks:
                            del self._pending_forks[parent_id]
            request.status = finished_status
            self._free_request(request)

    # -- stats -----------------------------------------------------------------------------

    def make_stats(self) -> SchedulerStats:
        """Queue sizes and KV usage now, with the counts of the last ``schedule()`` call."""
        s = self._step_stats
        kv = self.kv_cache_manager
        # KV utilization: tokens cached by the requests holding blocks vs. slots in used blocks
        # (a block shared by several requests, e.g. a prefix-cache hit, counts once).
        num_stored_tokens = kv.num_stored_tokens(self.requests)
        num_allocated_slots = (kv.num_blocks - kv.num_free_blocks) * kv.block_size
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv_cache_manager.usage,
            kv_cache_group_usage=self.kv_cache_manager.group_usage(),
            num_free_blocks=self.kv_cache_manager.num_free_blocks,
            num_blocks=self.kv_cache_manager.num_blocks,
            num_preemptions=s.num_preemptions,
            num_preemptions_total=self.num_preemptions_total,
            num_scheduled_requests=s.num_scheduled_requests,
            num_scheduled_tokens=s.num_scheduled_tokens,
            num_prefill_tokens=s.num_prefill_tokens,
            num_decode_tokens=s.num_decode_tokens,
            num_stored_tokens=num_stored_tokens,
            num_allocated_slots=num_allocated_slots,
            num_swapped=len(kv.cpu_block_tables),
            num_preemptions_by_mode=dict(self.num_preemptions_by_mode),
            num_used_blocks_scheduled=s.num_used_blocks_scheduled,
            prefix_cache_queries_total=kv.prefix_cache_stats.queries,  # [prefix caching]
            prefix_cache_hits_total=kv.prefix_cache_stats.hits,
            spec_decoding_stats=None if self.spec_decoder is None else self.spec_decoder.stats.copy(),
            running_lora_adapters=sorted({r.lora_request.lora_name for r in self.running if r.lora_request}),
            waiting_lora_adapters=sorted({r.lora_request.lora_name for r in self.waiting if r.lora_request}),
            max_lora=self.max_loras,
        )
