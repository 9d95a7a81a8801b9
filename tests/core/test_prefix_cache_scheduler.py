"""Prefix caching without a model: chained hashes, hand-computed block tables, hit counts, LRU
eviction and the integrity checks (block_size=4, num_blocks=16 unless a test says otherwise)."""

from __future__ import annotations

import hashlib
import struct

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.block_pool import BlockPool
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_cache_utils import ROOT_HASH, hash_block_tokens, hash_request_tokens
from pagedllm.core.request import Request
from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams
from scheduler_mirror import MirroredScheduler


def make(num_blocks=16, budget=64, enable=True):
    kv = KVCacheManager(block_size=4, num_blocks=num_blocks, enable_caching=enable)
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=64,
                          enable_chunked_prefill=True)
    return MirroredScheduler(cfg, kv), kv


def req(rid, prompt, max_tokens=2, **params):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **params), max_tokens=max_tokens)


def step(sched, token=7):
    out = sched.schedule()
    ids = [s.request_id for s in out.scheduled if s.sample]
    sched.update_from_output(out, ModelRunnerOutput(req_ids=ids, sampled_token_ids=[token] * len(ids),
                                                    sampled_logprobs=[0.0] * len(ids)))
    sched.kv_cache_manager.check_integrity(sched.requests)
    return {s.request_id: s for s in out.scheduled}


def test_hash_is_chained_stable_and_not_pythons_hash():
    h0 = hash_block_tokens(None, [1, 2, 3, 4])
    expected = hashlib.sha256(ROOT_HASH + struct.pack("<4q", 1, 2, 3, 4)).digest()
    assert h0 == expected and len(h0) == 32
    h1 = hash_block_tokens(h0, [5, 6, 7, 8])
    assert hash_request_tokens(4, [1, 2, 3, 4, 5, 6, 7, 8, 9]) == [h0, h1]
    assert hash_block_tokens(None, [5, 6, 7, 8]) != h1  # the parent matters
    assert hash_block_tokens(None, [1, 2, 3, 4], extra_keys=("lora", 3)) != h0


def test_hand_worked_hit_and_tables():
    sched, kv = make()
    a = req("a", range(100, 110))  # 10 tokens: blocks 0, 1 full, block 2 partial
    sched.add_request(a)
    s = step(sched)["a"]
    assert s.block_table == [0, 1, 2] and s.num_computed_tokens == 0
    pool = kv.block_pool
    assert pool.num_cached_blocks == 2  # the partial block is never registered
    assert [pool.blocks[i].block_hash for i in (0, 1)] == a.block_hashes[:2]
    assert pool.blocks[2].block_hash is None

    b = req("b", list(range(100, 108)) + [500, 501, 502])  # shares 2 full blocks
    sched.add_request(b)
    out = step(sched)
    assert out["a"].num_scheduled_tokens == 1  # a's decode
    sb = out["b"]
    assert sb.num_computed_tokens == 8 and sb.token_ids == [500, 501, 502]
    assert sb.block_table == [0, 1, 3]
    assert b.num_cached_tokens == 8
    # a finished (max_tokens=2): 0 and 1 are still held by b, 2 went to the free queue.
    assert pool.ref_cnt(0) == pool.ref_cnt(1) == 1 and pool.is_free(2)
    assert kv.prefix_cache_stats.queries == 10 + 11 and kv.prefix_cache_stats.hits == 8


def test_fully_cached_prompt_recomputes_its_last_block():
    sched, kv = make()
    sched.add_request(req("a", range(100, 108), max_tokens=1))  # exactly 2 blocks
    step(sched)
    assert kv.block_pool.num_cached_blocks == 2 and kv.num_free_blocks == 16
    c = req("c", range(100, 108), max_tokens=1)
    sched.add_request(c)
    s = step(sched)["c"]
    # (8 - 1) // 4 = 1 block hit; tokens 4..7 rerun into a fresh block (not the cached one).
    assert s.num_computed_tokens == 4 and s.token_ids == [104, 105, 106, 107]
    assert s.block_table[0] == 0 and s.block_table[1] != 1
    assert c.num_cached_tokens == 4
    # The recomputed block duplicates block 1's hash, so it stays unregistered: one block per hash.
    assert kv.block_pool.num_cached_blocks == 2


def test_free_order_and_lru_eviction():
    sched, kv = make(num_blocks=6)
    pool = kv.block_pool
    sched.add_request(req("a", range(100, 108), max_tokens=1))
    step(sched)
    # a's table [0, 1] was freed tail first: the free queue ends ..., 1, 0.
    assert pool.free_block_ids() == [2, 3, 4, 5, 1, 0]
    sched.add_request(req("d", range(200, 216), max_tokens=1))  # 4 blocks: 2, 3, 4, 5
    step(sched)
    assert pool.num_cached_blocks == 6
    sched.add_request(req("e", range(300, 303), max_tokens=1))  # needs 1 block: takes the LRU head
    s = step(sched)["e"]
    # d's blocks were freed after a's, so a's tail block (1) is the LRU one and is evicted.
    assert s.block_table == [1]
    assert pool.get_cached_block(sched_hash(range(100, 108), 1)) is None
    assert pool.get_cached_block(sched_hash(range(100, 108), 0)) == 0
    f = req("f", range(100, 110), max_tokens=1)
    sched.add_request(f)
    sf = step(sched)["f"]
    assert sf.num_computed_tokens == 4 and sf.block_table[0] == 0  # block 0 touched back


def sched_hash(tokens, index):
    return hash_request_tokens(4, list(tokens))[index]


def test_hits_need_free_room_for_the_rest():
    """Free hit blocks leave the free queue when touched: they do not count as room."""
    kv = KVCacheManager(block_size=4, num_blocks=4, enable_caching=True)
    a = req("a", range(100, 112))
    assert kv.allocate_slots(a, 12, kv.get_computed_blocks(a)) == [0, 1, 2]
    a.num_computed_tokens = 12
    kv.cache_blocks(a)
    kv.free(a)
    b = req("b", list(range(100, 112)) + list(range(5)))  # 17 tokens: 3 hits + 2 new blocks
    hit = kv.get_computed_blocks(b)
    assert hit.block_ids == [0, 1, 2] and hit.num_computed_tokens == 12
    assert kv.allocate_slots(b, 5, hit) is None  # 4 free blocks, 3 of them the hits: 1 < 2
    assert kv.num_free_blocks == 4 and kv.get_block_table("b") == []
    kv.check_integrity()
    c = req("c", list(range(100, 112)) + [9])
    hit = kv.get_computed_blocks(c)
    assert kv.allocate_slots(c, 1, hit) == [3]
    assert kv.get_block_table("c") == [0, 1, 2, 3] and kv.num_free_blocks == 0


def test_prompt_logprobs_and_caching_off_skip_the_lookup():
    kv = KVCacheManager(block_size=4, num_blocks=8, enable_caching=True)
    a = req("a", range(100, 112))
    kv.allocate_slots(a, 12, kv.get_computed_blocks(a))
    a.num_computed_tokens = 12
    kv.cache_blocks(a)
    hit = kv.get_computed_blocks(req("p", range(100, 112), prompt_logprobs=1))
    assert hit.block_ids == [] and hit.num_query_tokens == 0
    off = KVCacheManager(block_size=4, num_blocks=8)
    r = req("r", range(100, 112))
    off.allocate_slots(r, 12, off.get_computed_blocks(r))
    r.num_computed_tokens = 12
    off.cache_blocks(r)
    assert off.block_pool.num_cached_blocks == 0


def test_preempted_request_reuses_its_blocks():
    sched, kv = make(num_blocks=5, budget=64)
    a, b = req("a", range(100, 108), max_tokens=8), req("b", range(200, 208), max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # both prefilled: 2 blocks each, 1 free
    for _ in range(4):
        step(sched)
        if sched.num_preemptions_total:
            break
    assert sched.num_preemptions_total == 1 and b.num_computed_tokens == 0
    assert b.num_cached_tokens == 0  # kept from the first admission
    # b's registered blocks (its 2 full prompt blocks) are in the free queue, still hashed.
    for _ in range(20):
        if b.status.name == "RUNNING":
            break
        out = step(sched)
    assert out["b"].num_computed_tokens > 0 and out["b"].num_computed_tokens % 4 == 0


def test_reset_prefix_cache_refuses_while_blocks_are_used():
    pool = BlockPool(4)
    (block,) = pool.get_new_blocks(1)
    assert pool.cache_full_block(block, b"x" * 32)
    assert pool.reset_prefix_cache() is False and pool.num_cached_blocks == 1
    pool.free_blocks([block])
    assert pool.get_cached_block(b"x" * 32) == block  # freed, still cached
    assert pool.reset_prefix_cache() is True
    assert pool.num_cached_blocks == 0 and pool.blocks[block].block_hash is None


def test_integrity_catches_a_block_registered_while_writable():
    kv = KVCacheManager(block_size=4, num_blocks=4, enable_caching=True)
    a = req("a", range(100, 106))
    kv.allocate_slots(a, 6)
    a.num_computed_tokens = 6
    kv.check_integrity({"a": a})
    kv.block_pool.cache_full_block(kv.get_block_table("a")[1], b"y" * 32)  # the partial block
    with pytest.raises(RuntimeError, match="may still write"):
        kv.check_integrity({"a": a})


def test_integrity_catches_a_hash_mapped_to_the_wrong_block():
    kv = KVCacheManager(block_size=4, num_blocks=4, enable_caching=True)
    pool = kv.block_pool
    (b0,) = pool.get_new_blocks(1)
    pool.cache_full_block(b0, b"z" * 32)
    pool.free_blocks([b0])
    pool.blocks[b0].block_hash = b"w" * 32
    with pytest.raises(RuntimeError, match="another hash"):
        kv.check_integrity()


def test_stored_tokens_count_shared_blocks_once():
    sched, kv = make()
    sched.add_request(req("a", range(100, 110), max_tokens=4))
    step(sched)
    sched.add_request(req("b", list(range(100, 108)) + [1, 2, 3], max_tokens=4))
    step(sched)
    # a: 11 computed (blocks 0, 1 full + 3 tokens in block 2); b: hit 0, 1 + 3 tokens in block 3.
    assert kv.get_block_table("a") == [0, 1, 2] and kv.get_block_table("b") == [0, 1, 3]
    stats = sched.make_stats()
    assert stats.num_stored_tokens == 8 + 3 + 3
    assert stats.num_allocated_slots == 4 * 4
    assert stats.prefix_cache_queries_total == 10 + 11 and stats.prefix_cache_hits_total == 8
