"""What the worker holds of each request, so that the per-step message carries only what it lacks.

vLLM V1's split (``vllm/v1/core/sched/output.py``): a request the worker has not seen goes out in
full once (``NewRequestData``), then as diffs (``CachedRequestData``: tokens sampled since, new
block ids, copy-on-write replacements, a resumed table after preemption). ``WorkerDiffTracker``
remembers, per request id, what the last message gave the worker; the scheduler asks it for each
scheduled request's entry and tells it about preemptions, trimmed tables and finished requests.
"""

from __future__ import annotations

from pagedllm.core.request import Request
from pagedllm.core.sched_output import CachedRequestData, NewRequestData


class WorkerDiffTracker:
    """The worker's view of each request it has seen, by request id.

    Args:
        num_kv_cache_groups: block-table entries per logical block (the hybrid manager's groups,
            stored interleaved; 1 otherwise).

    Attributes:
        num_tokens: tokens the worker holds (prompt and outputs).
        num_blocks: block-table entries the worker holds (0 after a preemption).
        last_blocks: the last entry per KV cache group of the table the worker holds (to spot
            a copy-on-write replacement).
        preempted: requests preempted since they were last scheduled (their next diff resends
            the whole table).
        blocks_kept: [speculative decoding] the table length the worker must first cut its copy
            to (blocks given back after rejected drafts).
    """

    def __init__(self, num_kv_cache_groups: int = 1) -> None:
        self.num_kv_cache_groups = num_kv_cache_groups
        self.num_tokens: dict[str, int] = {}
        self.num_blocks: dict[str, int] = {}
        self.last_blocks: dict[str, tuple[int, ...]] = {}
        self.preempted: set[str] = set()
        self.blocks_kept: dict[str, int] = {}

    def __contains__(self, request_id: str) -> bool:
        """True once the worker has been sent the request (until it finishes)."""
        return request_id in self.num_tokens

    def _sent(self, request: Request, block_table: list[int]) -> None:
        """Record that the worker now holds the request's tokens and ``block_table``."""
        req_id = request.request_id
        self.num_tokens[req_id] = request.num_tokens
        self.num_blocks[req_id] = len(block_table)
        if block_table:
            self.last_blocks[req_id] = tuple(block_table[-self.num_kv_cache_groups:])

    def new_request_data(self, request: Request, block_table: list[int],
                         forked_from: str | None = None) -> NewRequestData:
        """The request in full, for a worker that has not seen it (recorded as sent).

        Args:
            block_table: the request's whole table (the scheduler's copy).
            forked_from: an n > 1 / best_of sample forked this step: the parent's id.
        """
        params = request.sampling_params.clone()
        params.logits_processors = None  # callables stay in this process (Executor docs)
        data = NewRequestData(
            req_id=request.request_id, prompt_token_ids=list(request.prompt_token_ids), sampling_params=params,
            block_ids=block_table, num_computed_tokens=request.num_computed_tokens,
            output_token_ids=list(request.output_token_ids),  # a beam forked between steps
            forked_from=forked_from, lora_request=request.lora_request, prompt_embeds=request.prompt_embeds)
        self._sent(request, block_table)
        return data

    def cached_request_data(self, request: Request, block_table: list[int]) -> CachedRequestData:
        """What changed for a request the worker holds, since it last heard (recorded as sent).

        A request preempted since then gets its whole table (``resumed_from_preemption``);
        otherwise the new entries, the replaced last ones (copy-on-write) and, after a trim,
        the length to cut to first.
        """
        req_id = request.request_id
        resumed = req_id in self.preempted
        self.preempted.discard(req_id)
        kept = self.blocks_kept.pop(req_id, None)
        known_tokens = self.num_tokens[req_id]
        known_blocks = 0 if resumed else self.num_blocks[req_id]
        replaced = []
        if known_blocks:
            # Copy-on-write swapped the last block the worker holds (only ever that one, per
            # KV cache group: the table's last ``num_kv_cache_groups`` entries).
            last = self.last_blocks[req_id]
            first = known_blocks - len(last)
            replaced = [(first + j, block_table[first + j]) for j, b in enumerate(last)
                        if block_table[first + j] != b]
        data = CachedRequestData(
            req_id=req_id, resumed_from_preemption=resumed,
            new_token_ids=request.all_token_ids[known_tokens:],
            new_block_ids=block_table[known_blocks:], num_computed_tokens=request.num_computed_tokens,
            replaced_block_ids=replaced, num_blocks_kept=None if resumed else kept)
        self._sent(request, block_table)
        return data

    def preempt(self, request_id: str) -> None:
        """The request lost its device blocks: its next diff resends its whole table."""
        if request_id in self.num_tokens:
            self.preempted.add(request_id)

    def trim(self, request_id: str, block_table: list[int]) -> None:
        """[speculative decoding] The scheduler's table was cut to ``block_table``: when shorter
        than the worker's, the next diff tells the worker to cut its copy."""
        num_blocks = len(block_table)
        if request_id in self.num_blocks and num_blocks < self.num_blocks[request_id]:
            self.num_blocks[request_id] = num_blocks
            self.blocks_kept[request_id] = min(num_blocks, self.blocks_kept.get(request_id, num_blocks))
            if num_blocks:
                self.last_blocks[request_id] = tuple(block_table[-self.num_kv_cache_groups:])

    def forget(self, request_id: str) -> None:
        """The request finished: the worker drops it (``finished_req_ids``)."""
        self.num_tokens.pop(request_id, None)
        self.num_blocks.pop(request_id, None)
        self.last_blocks.pop(request_id, None)
        self.preempted.discard(request_id)
        self.blocks_kept.pop(request_id, None)
