"""Property test (hypothesis, stateful) of the hybrid KV cache manager: random admit (prefix-cache
lookup and hit) / compute a chunk (allocation, out-of-window freeing) / decode / fork with
copy-on-write / swap-out / swap-in with the next chunk / recompute preemption / finish (also
while swapped) on a full group and a sliding group (window 6, block 4) over one device pool and
one host pool. After every operation: the manager's integrity check with the live requests
(swapped ones included), block conservation on the device and on the host (free + used + null
= total), and a model of the K/V memory (device and host pages; swap pairs copied as the worker
does): every request reads back, through each group's table, device or host, its own tokens at
every position its next query sees (all of them for the full group, the window for the sliding
group)."""

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
NUM_CPU_BLOCKS = 10   # the host null block + 9
G = 2
tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=24)


class HybridMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.kv = HybridKVCacheManager(BS, NUM_BLOCKS, make_kv_cache_groups([None, WINDOW]), enable_caching=True,
                                       num_cpu_blocks=NUM_CPU_BLOCKS)
        self.reqs: dict[str, Request] = {}   # live requests, swapped ones included
        self.swapped: set[str] = set()
        self.next_id = 0
        self.past: list[list[int]] = []
        # K/V memory: block id -> token per slot (None = never written); one copy per block id.
        self.mem = {b: [None] * BS for b in range(NUM_BLOCKS)}
        self.host = {c: [None] * BS for c in range(NUM_CPU_BLOCKS)}

    def _running(self) -> list[str]:
        return sorted(set(self.reqs) - self.swapped)

    def _pick(self, data) -> Request:
        return self.reqs[data.draw(st.sampled_from(self._running()))]

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
        self._forward(r, r.num_computed_tokens + (hit.num_computed_tokens if hit is not None else 0), num_new)
        return True

    def _forward(self, r: Request, start: int, num_new: int) -> None:
        """The step's forward: write the chunk, check its reads, cache the full blocks."""
        self._write(r, start, start + num_new)
        self._check_reads(r, start, start + num_new)
        r.num_computed_tokens = start + num_new
        self.kv.cache_blocks(r)

    def _check_reads(self, r: Request, start: int, end: int, table=None, mem=None) -> None:
        """Each query of the step (positions start..end-1) reads its own tokens in every group
        (through ``table`` in ``mem``: default the device table and memory)."""
        table = self.kv.get_block_table(r.request_id) if table is None else table
        mem = self.mem if mem is None else mem
        for g, first in ((0, 0), (1, max(start - WINDOW + 1, 0))):
            for pos in range(first, end):
                b = table[(pos // BS) * G + g]
                assert b != NULL_BLOCK_ID, f"{r.request_id} group {g} lost position {pos} inside a window"
                assert mem[b][pos % BS] == r.all_token_ids[pos], (r.request_id, g, pos)

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

    @precondition(lambda self: self._running())
    @rule(data=st.data(), n=st.integers(1, 8), token=st.integers(0, 2))
    def step(self, data, n, token):
        r = self._pick(data)
        if r.num_computed_tokens == r.num_tokens:
            r.append_output_token_ids([token])   # a decode: the sampled token is computed next
        try:
            self._compute(r, min(n, r.num_tokens - r.num_computed_tokens))
        except NoFreeBlocksError:
            pass

    @precondition(lambda self: self._running())
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

    @precondition(lambda self: self._running())
    @rule(data=st.data())
    def swap_out(self, data):
        r = self._pick(data)
        host_free = self.kv.cpu_block_pool.get_num_free_blocks()
        if not self.kv.can_swap_out(r):
            assert self.kv.cpu_block_pool.get_num_free_blocks() == host_free
            return
        pairs = self.kv.swap_out(r)
        for d, c in pairs:   # the worker's copy, before the next forward
            assert NULL_BLOCK_ID not in (d, c)
            self.host[c] = list(self.mem[d])
        # A new host block for each pair, none for null entries or pages already on the host.
        assert host_free - self.kv.cpu_block_pool.get_num_free_blocks() == len(pairs)
        self.swapped.add(r.request_id)

    @precondition(lambda self: self.swapped)
    @rule(data=st.data(), n=st.integers(1, 8), token=st.integers(0, 2))
    def swap_in(self, data, n, token):
        r = self.reqs[data.draw(st.sampled_from(sorted(self.swapped)))]
        if r.num_computed_tokens == r.num_tokens:
            r.append_output_token_ids([token])
        num_new = min(n, r.num_tokens - r.num_computed_tokens)
        host_table = list(self.kv.cpu_block_tables[r.request_id])
        free, host_free = self.kv.num_free_blocks, self.kv.cpu_block_pool.get_num_free_blocks()
        pairs = self.kv.swap_in(r, num_new)
        if pairs is None:
            assert self.kv.cpu_block_tables[r.request_id] == host_table
            assert (self.kv.num_free_blocks, self.kv.cpu_block_pool.get_num_free_blocks()) == (free, host_free)
            return
        for c, d in pairs:
            assert NULL_BLOCK_ID not in (c, d)
            self.mem[d] = list(self.host[c])
        # Null entries came back null, every real one as a block.
        table = self.kv.get_block_table(r.request_id)
        assert [b == NULL_BLOCK_ID for b in table[:len(host_table)]] == [c == NULL_BLOCK_ID for c in host_table]
        self.swapped.discard(r.request_id)
        self._forward(r, r.num_computed_tokens, num_new)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish_or_preempt(self, data):
        r = self.reqs[data.draw(st.sampled_from(sorted(self.reqs)))]   # swapped ones too (abort)
        self.kv.free(r)
        del self.reqs[r.request_id]
        self.swapped.discard(r.request_id)

    @invariant()
    def integrity(self):
        self.kv.check_integrity(self.reqs)
        assert set(self.kv.cpu_block_tables) == self.swapped
        pool = self.kv.block_pool
        held = {b for t in self.kv.block_tables.values() for b in t if b != NULL_BLOCK_ID}
        assert len(held) + pool.get_num_free_blocks() + 1 == NUM_BLOCKS   # conservation
        assert not pool.is_free(NULL_BLOCK_ID)
        cpu = self.kv.cpu_block_pool
        held = {c for t in self.kv.cpu_block_tables.values() for c in t if c != NULL_BLOCK_ID}
        assert len(held) + cpu.get_num_free_blocks() + 1 == NUM_CPU_BLOCKS   # host conservation
        assert not cpu.is_free(NULL_BLOCK_ID)

    @invariant()
    def each_request_reads_its_own_tokens(self):
        for rid, r in self.reqs.items():
            if rid in self.swapped:
                self._check_reads(r, r.num_computed_tokens, r.num_computed_tokens,
                                  self.kv.cpu_block_tables[rid], self.host)
            else:
                self._check_reads(r, r.num_computed_tokens, r.num_computed_tokens)


TestHybridKVCache = HybridMachine.TestCase
TestHybridKVCache.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                      suppress_health_check=[HealthCheck.too_slow])
