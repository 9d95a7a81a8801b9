"""KV-cache events recorded by the block pool (vLLM's ``BlockPool`` with
``enable_kv_cache_events``), without a model: what ``cache_full_blocks``, eviction and a reset
record, with events on and off, for plain and hybrid (grouped) keys."""

from __future__ import annotations

from types import SimpleNamespace

from pagedllm.core.block_pool import BlockPool
from pagedllm.core.hybrid_kv_cache_manager import HybridKVCacheManager
from pagedllm.core.kv_cache_spec import make_kv_cache_groups, split_group_block_ids
from pagedllm.core.kv_cache_utils import group_block_hash, hash_request_tokens
from pagedllm.core.request import Request
from pagedllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from pagedllm.sampling_params import SamplingParams

BS = 4
TOKENS = list(range(10, 22))              # 3 full blocks
H = hash_request_tokens(BS, TOKENS)       # their chained hashes
LORA = SimpleNamespace(lora_int_id=3, lora_name="sql-lora")


def _stored(hashes, parent, tokens, lora=None, extra=None, group=0) -> BlockStored:
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=list(tokens), block_size=BS,
                       lora_id=None if lora is None else lora.lora_int_id, medium="GPU",
                       lora_name=None if lora is None else lora.lora_name,
                       extra_keys=None if extra is None else [extra] * len(hashes), group_idx=group)


def test_events_off_records_nothing():
    pool = BlockPool(4)
    ids = pool.get_new_blocks(3)
    pool.cache_full_blocks(ids, H, None, TOKENS, BS)
    pool.free_blocks(ids)
    pool.get_new_blocks(4)            # evicts all three
    assert pool.reset_prefix_cache() is False
    pool.free_blocks(range(4))
    assert pool.reset_prefix_cache() is True
    assert pool.kv_event_queue == [] and pool.take_events() == []


def test_stored_then_evicted_then_cleared():
    pool = BlockPool(4, enable_kv_cache_events=True)
    ids = pool.get_new_blocks(3)
    extra = ("lora", 3, "/adapters/sql")
    pool.cache_full_blocks(ids, H, None, TOKENS, BS, LORA, extra)
    assert pool.take_events() == [_stored(H, None, TOKENS, LORA, extra)]
    assert pool.take_events() == []   # taken once
    pool.cache_full_blocks(ids[:2], H[:2], None, TOKENS[:8], BS)   # already registered: nothing new
    assert pool.take_events() == []
    pool.free_blocks(reversed(ids))   # tail first: block 2 is the least recently used
    pool.get_new_blocks(2)            # the never-registered block 3, then block 2 (H[2])
    assert pool.take_events() == [BlockRemoved([H[2]], "GPU", 0)]
    pool.free_blocks([3, 2])
    assert pool.reset_prefix_cache() is True
    assert pool.take_events() == [AllBlocksCleared()]


def test_a_hash_held_by_another_block_splits_the_event():
    pool = BlockPool(5, enable_kv_cache_events=True)
    other = pool.get_new_blocks(1)
    pool.cache_full_blocks(other, [H[1]], H[0], TOKENS[4:8], BS)   # the same block computed elsewhere
    pool.take_events()
    ids = pool.get_new_blocks(3)
    pool.cache_full_blocks(ids, H, None, TOKENS, BS)
    # Block 1's hash stays with the other block: two runs, each chained from its parent.
    assert pool.take_events() == [_stored(H[:1], None, TOKENS[:4]), _stored(H[2:], H[1], TOKENS[8:])]
    assert pool.get_cached_block(H[1]) == other[0]


def test_group_keys_are_sent_as_hash_and_group_idx():
    pool = BlockPool(4, enable_kv_cache_events=True)
    ids = pool.get_new_blocks(2)
    keys = [group_block_hash(h, 1) for h in H[1:]]
    pool.cache_full_blocks(ids, keys, group_block_hash(H[0], 1), TOKENS[4:], BS)
    assert pool.take_events() == [_stored(H[1:], H[0], TOKENS[4:], group=1)]
    pool.free_blocks(ids)
    pool.get_new_blocks(4)
    removed = pool.take_events()
    assert sorted(e.block_hashes[0] for e in removed) == sorted(H[1:])
    assert {(e.medium, e.group_idx) for e in removed} == {("GPU", 1)}


def test_hybrid_manager_sends_one_event_per_group():
    groups = make_kv_cache_groups([None, 8])   # group 0 full attention, group 1 a window of 8
    kv = HybridKVCacheManager(BS, 64, groups, enable_caching=True, enable_kv_cache_events=True)
    a = Request("a", list(range(100, 120)), SamplingParams(), max_tokens=8)
    kv.allocate_slots(a, 20)
    a.num_computed_tokens = 20
    kv.cache_blocks(a)
    hashes = hash_request_tokens(BS, a.all_token_ids)
    assert len(hashes) == 5
    assert kv.take_events() == [_stored(hashes, None, a.all_token_ids, group=0),
                                _stored(hashes, None, a.all_token_ids, group=1)]
    table = split_group_block_ids(kv.get_block_table("a"), 2)
    kv.free(a)
    kv.block_pool._evict(kv.block_pool.blocks[table[1][3]])
    assert kv.take_events() == [BlockRemoved([hashes[3]], "GPU", 1)]
