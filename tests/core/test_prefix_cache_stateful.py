"""Property test (hypothesis, stateful) of the prefix cache: random admit (with lookup and hit) /
append / finish (free) / evict (allocation pressure) / reset sequences on a caching
``KVCacheManager``, plus fork / copy-on-write / swap-out / swap-in; after every operation the
manager's own integrity check runs with the live requests, plus a model of what must be cached
and a model of the K/V memory: every request reads back exactly its own tokens through its table
(device or host), with the copy pairs applied as the worker applies them."""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedllm.core.block_pool import NoFreeBlocksError
from pagedllm.core.kv_cache_manager import KVCacheManager, cdiv
from pagedllm.core.kv_cache_utils import hash_request_tokens
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams

BS = 4
NUM_BLOCKS = 12
NUM_CPU_BLOCKS = 8
# Few distinct tokens, so prompts share prefixes often.
tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=20)


class PrefixCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(block_size=BS, num_blocks=NUM_BLOCKS, enable_caching=True,
                                 num_cpu_blocks=NUM_CPU_BLOCKS)
        self.reqs: dict[str, Request] = {}
        self.next_id = 0
        # The K/V memory as the worker holds it: block id -> token per slot (None = never written).
        self.dev = {b: [None] * BS for b in range(NUM_BLOCKS)}
        self.host = {b: [None] * BS for b in range(NUM_CPU_BLOCKS)}

    def _pick(self, data, on_device: bool | None = True) -> Request:
        ids = sorted(rid for rid, r in self.reqs.items()
                     if on_device is None or self.kv.is_swapped(r) != on_device)
        return self.reqs[data.draw(st.sampled_from(ids))]

    def _has(self, on_device: bool) -> bool:
        return any(self.kv.is_swapped(r) != on_device for r in self.reqs.values())

    def _write(self, r: Request, start: int, end: int) -> None:
        """The forward wrote tokens [start, end) of ``r`` through its table."""
        table = self.kv.get_block_table(r.request_id)
        for pos in range(start, end):
            self.dev[table[pos // BS]][pos % BS] = r.all_token_ids[pos]

    @staticmethod
    def _copy(pairs, src_mem, dst_mem) -> None:
        """One batched copy: every source is read before any destination is written."""
        data = [list(src_mem[s]) for s, _ in pairs]
        for (_, d), row in zip(pairs, data):
            dst_mem[d] = row

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
        self._write(r, hit.num_computed_tokens, len(prompt))
        self.reqs[r.request_id] = r

    @precondition(lambda self: self._has(True))
    @rule(data=st.data())
    def step_done(self, data):
        """The step that computed a request's tokens finished: register its full blocks."""
        r = self._pick(data)
        start = self.kv.num_cached_block.get(r.request_id, 0)
        self.kv.cache_blocks(r)
        table = self.kv.get_block_table(r.request_id)
        for i in range(start, r.num_computed_tokens // BS):
            stored = self.kv.block_pool.blocks[table[i]].block_hash
            # Registered now under the request's hash, unless another block already holds that
            # hash. (Blocks registered earlier may have lost to a twin that was evicted since:
            # they stay unregistered, a later cache miss, never wrong data.)
            assert stored == r.block_hashes[i] or (
                stored is None and self.kv.block_pool.get_cached_block(r.block_hashes[i]) is not None)

    @precondition(lambda self: self._has(True))
    @rule(data=st.data(), new_tokens=st.lists(st.integers(0, 2), min_size=1, max_size=6))
    def append(self, data, new_tokens):
        """Decode: the request's registered blocks first, then copy-on-write of a shared last
        block, then room for the new tokens."""
        r = self._pick(data)
        self.kv.cache_blocks(r)
        try:
            pair = self.kv.cow_last_block_if_shared(r)
        except NoFreeBlocksError:
            return
        if pair is not None:
            self._copy([pair], self.dev, self.dev)
        r.append_output_token_ids(new_tokens)
        start = r.num_computed_tokens
        if self.kv.allocate_slots(r, len(new_tokens)) is not None:
            r.num_computed_tokens += len(new_tokens)
            self._write(r, start, r.num_computed_tokens)
        else:
            del r.output_token_ids[-len(new_tokens):]
            del r._all_token_ids[-len(new_tokens):]
            del r.block_hashes[r.num_tokens // BS:]

    @precondition(lambda self: self._has(True))
    @rule(data=st.data())
    def fork(self, data):
        """n > 1 / beams: a child shares every block of its parent, the partial one included."""
        parent = self._pick(data)
        child = Request(f"r{self.next_id}", parent.prompt_token_ids, SamplingParams(), max_tokens=1)
        self.next_id += 1
        child.append_output_token_ids(list(parent.output_token_ids))
        holders = {b: self.kv.block_pool.ref_cnt(b) for b in self.kv.get_block_table(parent.request_id)}
        self.kv.fork(parent, child)
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_hashes = list(parent.block_hashes)
        assert self.kv.get_block_table(child.request_id) == self.kv.get_block_table(parent.request_id)
        for b, n in holders.items():
            assert self.kv.block_pool.ref_cnt(b) == n + 1
        self.reqs[child.request_id] = child

    @precondition(lambda self: self._has(True))
    @rule(data=st.data())
    def cow(self, data):
        """Copy-on-write leaves the other owners' tables unchanged."""
        r = self._pick(data)
        others = {rid: self.kv.get_block_table(rid) for rid in self.reqs if rid != r.request_id}
        table = self.kv.get_block_table(r.request_id)
        try:
            pair = self.kv.cow_last_block_if_shared(r)
        except NoFreeBlocksError:
            return
        if pair is not None:
            assert pair[0] == table[-1] and self.kv.get_block_table(r.request_id) == table[:-1] + [pair[1]]
            assert self.kv.block_pool.ref_cnt(pair[1]) == 1
            self._copy([pair], self.dev, self.dev)
        assert others == {rid: self.kv.get_block_table(rid) for rid in others}

    @precondition(lambda self: self._has(True))
    @rule(data=st.data())
    def swap_out(self, data):
        r = self._pick(data)
        if not self.kv.can_swap_out(r):
            return
        table = self.kv.get_block_table(r.request_id)
        pairs = self.kv.swap_out(r)
        assert len({d for d, _ in pairs}) == len(pairs) and {d for d, _ in pairs} <= set(table)
        self._copy(pairs, self.dev, self.host)
        assert self.kv.get_block_table(r.request_id) == [] and self.kv.is_swapped(r)

    @precondition(lambda self: self._has(False))
    @rule(data=st.data())
    def swap_in(self, data):
        r = self._pick(data, on_device=False)
        host_table = list(self.kv.cpu_block_tables[r.request_id])
        pairs = self.kv.swap_in(r, 0)
        if pairs is None:
            assert self.kv.is_swapped(r)
            return
        assert {c for c, _ in pairs} <= set(host_table)
        self._copy(pairs, self.host, self.dev)
        assert len(self.kv.get_block_table(r.request_id)) == len(host_table)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), register=st.booleans())
    def finish(self, data, register):
        r = self._pick(data, on_device=None)
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
            # Each request reads back its own tokens, from the device or the host pool.
            if self.kv.is_swapped(r):
                table, mem = self.kv.cpu_block_tables[rid], self.host
            else:
                table, mem = self.kv.get_block_table(rid), self.dev
            assert len(table) == cdiv(r.num_computed_tokens, BS)
            read = [mem[table[p // BS]][p % BS] for p in range(r.num_computed_tokens)]
            assert read == r.all_token_ids[:r.num_computed_tokens], rid
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
        assert self.kv.cpu_block_pool.get_num_free_blocks() == NUM_CPU_BLOCKS
        self.kv.check_integrity()


PrefixCacheMachine.TestCase.settings = settings(
    max_examples=300, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestPrefixCacheMachine = PrefixCacheMachine.TestCase
