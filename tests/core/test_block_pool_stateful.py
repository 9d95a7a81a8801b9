"""Property test (hypothesis, stateful): random allocate/append/fork/CoW/free sequences on the
KV cache manager, with the pool invariants checked after every step."""

from collections import Counter

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedllm.core.block_pool import NoFreeBlocksError
from pagedllm.core.kv_cache_manager import KVCacheManager, cdiv
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams

BLOCK_SIZE = 4
NUM_BLOCKS = 16


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = KVCacheManager(block_size=BLOCK_SIZE, num_blocks=NUM_BLOCKS)
        self.reqs: dict[str, Request] = {}
        self.snapshot: dict[str, list[int]] = {}
        self.cow_slot: tuple[str, int] | None = None  # (request, index) replaced by CoW this step
        self.next_id = 0

    def _new_request(self, num_tokens: int) -> Request:
        rid = f"r{self.next_id}"
        self.next_id += 1
        return Request(rid, [1] * max(num_tokens, 1), SamplingParams(), max_tokens=1)

    def _tables_except(self, rid: str) -> dict[str, list[int]]:
        return {k: self.kv.get_block_table(k) for k in self.reqs if k != rid}

    def _pick(self, data) -> Request:
        return self.reqs[data.draw(st.sampled_from(sorted(self.reqs)))]

    @rule(num_tokens=st.integers(1, 40))
    def add(self, num_tokens):
        r = self._new_request(num_tokens)
        free_before = self.kv.num_free_blocks
        new = self.kv.allocate_slots(r, num_tokens)
        if new is None:
            assert cdiv(num_tokens, BLOCK_SIZE) > free_before
            assert self.kv.num_free_blocks == free_before
            assert self.kv.get_block_table(r.request_id) == []
            return
        assert len(new) == cdiv(num_tokens, BLOCK_SIZE)
        r.num_computed_tokens = num_tokens
        self.reqs[r.request_id] = r

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), num_tokens=st.integers(0, 9))
    def append(self, data, num_tokens):
        r = self._pick(data)
        others = self._tables_except(r.request_id)
        before = self.kv.get_block_table(r.request_id)
        try:
            pair = self.kv.cow_last_block_if_shared(r)
        except NoFreeBlocksError:
            assert self.kv.num_free_blocks == 0
            assert self.kv.get_block_table(r.request_id) == before
            return
        table = self.kv.get_block_table(r.request_id)
        if pair is not None:
            src, dst = pair
            assert before[-1] == src and table[-1] == dst and table[:-1] == before[:-1]
            assert self.kv.block_pool.ref_cnt(dst) == 1 and self.kv.block_pool.ref_cnt(src) >= 1
            self.cow_slot = (r.request_id, len(table) - 1)
        # Before a write, the block receiving the next token is owned by this request alone.
        if r.num_computed_tokens < len(table) * BLOCK_SIZE:
            assert self.kv.block_pool.ref_cnt(table[-1]) == 1
        free_before = self.kv.num_free_blocks
        new = self.kv.allocate_slots(r, num_tokens)
        if new is None:
            assert self.kv.num_free_blocks == free_before
            assert self.kv.get_block_table(r.request_id) == table
        else:
            need = cdiv(r.num_computed_tokens + num_tokens, BLOCK_SIZE) - len(table)
            assert len(new) == max(need, 0)
            r.num_computed_tokens += num_tokens
        assert self._tables_except(r.request_id) == others  # CoW/append leave others unchanged

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def fork(self, data):
        parent = self._pick(data)
        child = self._new_request(parent.num_computed_tokens)
        child.num_computed_tokens = parent.num_computed_tokens
        others = self._tables_except("")
        self.kv.fork(parent, child)
        child_table = self.kv.get_block_table(child.request_id)
        assert child_table == self.kv.get_block_table(parent.request_id)
        assert self._tables_except(child.request_id) == others
        self.reqs[child.request_id] = child

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def free(self, data):
        r = self._pick(data)
        others = self._tables_except(r.request_id)
        self.kv.free(r)
        del self.reqs[r.request_id]
        self.snapshot.pop(r.request_id, None)
        assert self._tables_except("") == others

    @invariant()
    def pool_is_consistent(self):
        kv, pool = self.kv, self.kv.block_pool
        kv.check_integrity()
        tables = {rid: kv.get_block_table(rid) for rid in self.reqs}
        holders = Counter(b for t in tables.values() for b in t)
        free_ids = pool.free_block_ids()
        used = [b for b in range(NUM_BLOCKS) if pool.ref_cnt(b) > 0]
        # free + used = total
        assert len(free_ids) + len(used) == NUM_BLOCKS == kv.num_blocks
        assert kv.num_free_blocks == len(free_ids)
        # ref_cnt equals the number of tables holding the block
        for b in range(NUM_BLOCKS):
            assert pool.ref_cnt(b) == holders[b]
        # no referenced block in the free queue
        assert not set(free_ids) & set(holders)
        # lazy allocation: each table covers exactly the computed tokens
        for rid, t in tables.items():
            assert len(t) == cdiv(self.reqs[rid].num_computed_tokens, BLOCK_SIZE)
        # tables only grow (CoW may replace the copied slot of the request that wrote)
        for rid, t in tables.items():
            old = self.snapshot.get(rid, [])
            assert len(t) >= len(old)
            for i, b in enumerate(old):
                if t[i] != b:
                    assert self.cow_slot == (rid, i)
        self.snapshot = tables
        self.cow_slot = None
        assert abs(kv.usage - len(used) / NUM_BLOCKS) < 1e-9

    def teardown(self):
        for r in list(self.reqs.values()):
            self.kv.free(r)
        assert self.kv.num_free_blocks == NUM_BLOCKS
        self.kv.check_integrity()


KVCacheMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None,
    suppress_health_check=[HealthCheck.too_slow])
TestKVCacheMachine = KVCacheMachine.TestCase
