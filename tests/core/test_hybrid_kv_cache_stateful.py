"""Property test (hypothesis, stateful) of the hybrid KV cache manager: random admit (prefix-cache
lookup and hit) / compute a chunk (allocation, out-of-window freeing) / decode / fork with
copy-on-write / recompute preemption / finish on a full group and a sliding group (window 6,
block 4) over one pool. After every operation: the manager's integrity check with the live
requests, block conservation (free + used + null = total), and a model of the K/V memory: every
request reads back, through each group's table, its own tokens at every position its next query
sees (all of them for the full group, the window for the sliding group)."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedllm.core.block_pool import NoFreeBlocksError
from pagedllm.core.hybrid_kv_cache_manager import HybridKVCacheManager
from pagedllm.core.kv_cache_spec import NULL_BLOCK_ID, make_kv_cache_groups
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams

BS = 4
WINDOW = 6
NUM_BLOCKS = 14
G = 2
tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=24)


class HybridMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = HybridKVCacheManager(BS, NUM_BLOCKS, make_kv_cache_groups([None, WINDOW]), enable_caching=True)
        self.reqs: dict[str, Request] = {}
        self.next_id = 0
        self.past: list[list[int]] = []
        # K/V memory: block id -> token per slot (None = never written); one copy per block id.
        self.mem = {b: [None] * BS for b in range(NUM_BLOCKS)}

    def _pick(self, data) -> Request:
        return self.reqs[data.draw(st.sampled_from(sorted(self.reqs)))]

    def _write(self, r: Request, start: int, end: int) -> None:
        table = self.kv.get_block_table(r.request_id)
        for pos in range(start, end):
            for g in range(G):
                b = table[(pos // BS) * G + g]
                assert b != NULL_BLOCK_ID, "a computed token has no block"
                self.mem[b][pos % BS] = r.all_token_ids[pos]

    def _compute(self, r: Request, num_new: int, hit=None) -> bool:
        """allocate_slots, then the forward writes the chunk and the step's full blocks are cached."""
        cow = self.kv.cow_last_blocks_if_shared(r) if hit is None else []
        for src, dst in cow:
            self.mem[dst] = list(self.mem[src])
        if self.kv.allocate_slots(r, num_new, hit) is None:
            return False
        start = r.num_computed_tokens + (hit.num_computed_tokens if hit is not None else 0)
        self._write(r, start, start + num_new)
        self._check_reads(r, start, start + num_new)
        r.num_computed_tokens = start + num_new
        self.kv.cache_blocks(r)
        return True

    def _check_reads(self, r: Request, start: int, end: int) -> None:
        """Each query of the step (positions start..end-1) reads its own tokens in every group."""
        table = self.kv.get_block_table(r.request_id)
        for g, first in ((0, 0), (1, max(start - WINDOW + 1, 0))):
            for pos in range(first, end):
                b = table[(pos // BS) * G + g]
                assert b != NULL_BLOCK_ID, f"{r.request_id} group {g} lost position {pos} inside a window"
                assert self.mem[b][pos % BS] == r.all_token_ids[pos], (r.request_id, g, pos)

    @rule(prompt=tokens_st, chunk=st.integers(1, 24), data=st.data())
    def admit(self, prompt, chunk, data):
        if self.past and data.draw(st.booleans()):   # share a past prompt's prefix: prefix-cache hits
            past = data.draw(st.sampled_from(self.past))
            prompt = past[:data.draw(st.integers(1, len(past)))] + prompt[:data.draw(st.integers(0, 3))]
        self.past.append(prompt)
        r = Request(f"r{self.next_id}", prompt, SamplingParams(), max_tokens=1)
        self.next_id += 1
        hit = self.kv.get_computed_blocks(r)
        assert hit.num_computed_tokens % BS == 0 and hit.num_computed_tokens < len(prompt)
        num_new = min(chunk, len(prompt) - hit.num_computed_tokens)
        free_before = self.kv.num_free_blocks
        if self._compute(r, num_new, hit):
            self.reqs[r.request_id] = r
        else:
            assert self.kv.num_free_blocks == free_before and self.kv.get_block_table(r.request_id) == []

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), n=st.integers(1, 8), token=st.integers(0, 2))
    def step(self, data, n, token):
        r = self._pick(data)
        if r.num_computed_tokens == r.num_tokens:
            r.append_output_token_ids([token])   # a decode: the sampled token is computed next
        try:
            self._compute(r, min(n, r.num_tokens - r.num_computed_tokens))
        except NoFreeBlocksError:
            pass

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def fork(self, data):
        parent = self._pick(data)
        child = Request(f"r{self.next_id}", list(parent.prompt_token_ids), SamplingParams(), max_tokens=1)
        self.next_id += 1
        child.append_output_token_ids(list(parent.output_token_ids))
        child.block_hashes = list(parent.block_hashes)
        self.kv.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        self.reqs[child.request_id] = child

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish_or_preempt(self, data):
        r = self._pick(data)
        self.kv.free(r)
        del self.reqs[r.request_id]

    @invariant()
    def integrity(self):
        self.kv.check_integrity(self.reqs)
        pool = self.kv.block_pool
        held = {b for t in self.kv.block_tables.values() for b in t if b != NULL_BLOCK_ID}
        assert len(held) + pool.get_num_free_blocks() + 1 == NUM_BLOCKS   # conservation
        assert not pool.is_free(NULL_BLOCK_ID)

    @invariant()
    def each_request_reads_its_own_tokens(self):
        for r in self.reqs.values():
            self._check_reads(r, r.num_computed_tokens, r.num_computed_tokens)


TestHybridKVCache = HybridMachine.TestCase
TestHybridKVCache.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])
