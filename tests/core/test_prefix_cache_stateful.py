"""Property test (hypothesis, stateful) of the prefix cache: random admit (with lookup and hit) /
append / finish (free) / evict (allocation pressure) / reset sequences on a caching
``KVCacheManager``; after every operation the manager's own integrity check runs with the live
requests, plus a model of what must be cached."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedllm.core.kv_cache_manager import KVCacheManager, cdiv
from pagedllm.core.kv_cache_utils import hash_request_tokens
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams

BS = 4
NUM_BLOCKS = 12
# Few distinct tokens, so prompts share prefixes often.
tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=20)


class PrefixCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(block_size=BS, num_blocks=NUM_BLOCKS, enable_caching=True)
        self.reqs: dict[str, Request] = {}
        self.next_id = 0

    def _pick(self, data) -> Request:
        return self.reqs[data.draw(st.sampled_from(sorted(self.reqs)))]

    @rule(prompt=tokens_st)
    def admit(self, prompt):
        r = Request(f"r{self.next_id}", prompt, SamplingParams(), max_tokens=1)
        self.next_id += 1
        pool = self.kv.block_pool
        hit = self.kv.get_computed_blocks(r)
        # The hit is the longest run of registered blocks, capped below the last token.
        expected = []
        for h in hash_request_tokens(BS, prompt)[:(len(prompt) - 1) // BS]:
            if pool.get_cached_block(h) is None:
                break
            expected.append(pool.get_cached_block(h))
        assert hit.block_ids == expected and hit.num_computed_tokens == len(expected) * BS
        for b in hit.block_ids:
            assert pool.blocks[b].block_hash is not None
        num_new = len(prompt) - hit.num_computed_tokens
        free_before = self.kv.num_free_blocks
        queries = self.kv.prefix_cache_stats.queries
        new = self.kv.allocate_slots(r, num_new, hit)
        if new is None:
            assert self.kv.num_free_blocks == free_before and self.kv.get_block_table(r.request_id) == []
            assert self.kv.prefix_cache_stats.queries == queries
            return
        assert self.kv.get_block_table(r.request_id) == hit.block_ids + new
        assert self.kv.prefix_cache_stats.queries == queries + len(prompt)
        r.num_computed_tokens = len(prompt)
        self.reqs[r.request_id] = r

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def step_done(self, data):
        """The step that computed a request's tokens finished: register its full blocks."""
        r = self._pick(data)
        self.kv.cache_blocks(r)
        table = self.kv.get_block_table(r.request_id)
        for i in range(r.num_computed_tokens // BS):
            stored = self.kv.block_pool.blocks[table[i]].block_hash
            # Registered under the request's hash, unless another block already holds that hash.
            assert stored == r.block_hashes[i] or (
                stored is None and self.kv.block_pool.get_cached_block(r.block_hashes[i]) is not None)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), new_tokens=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def append(self, data, new_tokens):
        """Decode: the request's registered blocks first, then room for the new tokens."""
        r = self._pick(data)
        self.kv.cache_blocks(r)
        r.append_output_token_ids(new_tokens)
        if self.kv.allocate_slots(r, len(new_tokens)) is not None:
            r.num_computed_tokens += len(new_tokens)
        else:
            del r.output_token_ids[-len(new_tokens):]
            del r._all_token_ids[-len(new_tokens):]

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), register=st.booleans())
    def finish(self, data, register):
        r = self._pick(data)
        if register:
            self.kv.cache_blocks(r)
        table = self.kv.get_block_table(r.request_id)
        self.kv.free(r)
        del self.reqs[r.request_id]
        for b in table:
            blk = self.kv.block_pool.blocks[b]
            if blk.ref_cnt == 0:  # freed: still cached if it was registered
                assert self.kv.block_pool.is_free(b)

    @rule()
    def reset(self):
        in_use = self.kv.num_free_blocks != NUM_BLOCKS
        assert self.kv.reset_prefix_cache() is (not in_use)
        if not in_use:
            assert self.kv.block_pool.num_cached_blocks == 0

    @invariant()
    def consistent(self):
        self.kv.check_integrity(self.reqs)
        pool = self.kv.block_pool
        for rid, r in self.reqs.items():
            assert len(self.kv.get_block_table(rid)) == cdiv(r.num_computed_tokens, BS)
        # every free block has ref_cnt 0; every registered free block is findable by its hash
        for b in pool.free_block_ids():
            blk = pool.blocks[b]
            assert blk.ref_cnt == 0
            if blk.block_hash is not None:
                assert pool.get_cached_block(blk.block_hash) == b

    def teardown(self):
        for r in list(self.reqs.values()):
            self.kv.free(r)
        assert self.kv.num_free_blocks == NUM_BLOCKS
        self.kv.check_integrity()


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestPrefixCacheMachine = PrefixCacheMachine.TestCase
