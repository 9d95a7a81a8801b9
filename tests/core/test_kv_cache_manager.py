"""KVCacheManager: lazy allocation, freeing, fork and copy-on-write, integrity checks."""

import pytest

from pagedllm.core.block_pool import NoFreeBlocksError
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams


def req(rid: str, n: int) -> Request:
    return Request(rid, list(range(100, 100 + n)), SamplingParams(), max_tokens=8)


def slot_mapping(table: list[int], start: int, stop: int, block_size: int) -> list[int]:
    return [table[p // block_size] * block_size + p % block_size for p in range(start, stop)]


def test_ten_tokens_take_three_blocks_and_known_slots():
    kv = KVCacheManager(block_size=4, num_blocks=16)
    filler = req("filler", 4)
    assert kv.allocate_slots(filler, 4) == [0]
    r = req("a", 10)
    assert kv.allocate_slots(r, 10) == [1, 2, 3]
    assert kv.get_block_table("a") == [1, 2, 3]
    assert slot_mapping([1, 2, 3], 0, 10, 4) == [4, 5, 6, 7, 8, 9, 10, 11, 12, 13]
    r.num_computed_tokens = 10
    kv.free(filler)  # block 0 goes to the tail of the free queue
    assert kv.allocate_slots(r, 1) == []  # position 10: block 3 still has room
    r.num_computed_tokens = 11
    assert kv.allocate_slots(r, 1) == []  # position 11
    r.num_computed_tokens = 12
    assert kv.allocate_slots(r, 1) == [4]  # position 12 (the 13th token) opens a 4th block
    assert kv.get_block_table("a") == [1, 2, 3, 4]
    assert slot_mapping(kv.get_block_table("a"), 12, 13, 4) == [16]
    assert kv.num_free_blocks == 12
    kv.check_integrity()
    kv.free(r)
    assert kv.num_free_blocks == 16 and kv.usage == 0.0
    assert kv.get_block_table("a") == []
    kv.check_integrity()


def test_allocate_returns_none_and_allocates_nothing():
    kv = KVCacheManager(block_size=4, num_blocks=4)
    a = req("a", 12)
    assert kv.allocate_slots(a, 12) == [0, 1, 2]
    b = req("b", 8)
    assert kv.allocate_slots(b, 8) is None
    assert kv.num_free_blocks == 1 and kv.get_block_table("b") == []
    assert kv.allocate_slots(b, 4) == [3]
    assert kv.usage == 1.0
    with pytest.raises(ValueError):
        kv.allocate_slots(b, -1)
    kv.check_integrity()


def test_get_block_table_is_a_copy_and_free_unknown_is_noop():
    kv = KVCacheManager(block_size=4, num_blocks=4)
    a = req("a", 4)
    kv.allocate_slots(a, 4)
    t = kv.get_block_table("a")
    t.append(99)
    assert kv.get_block_table("a") == [0]
    kv.free(req("nobody", 1))
    kv.check_integrity()


def test_fork_shares_blocks_and_cow_copies_partial_last_block():
    kv = KVCacheManager(block_size=4, num_blocks=8)
    parent = req("p", 6)
    kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = 6
    child = req("c", 6)
    child.num_computed_tokens = 6
    kv.fork(parent, child)
    assert kv.get_block_table("c") == kv.get_block_table("p") == [0, 1]
    assert kv.block_pool.ref_cnt(0) == 2 and kv.block_pool.ref_cnt(1) == 2
    kv.check_integrity()
    # The child writes position 6, inside shared block 1: copy it first.
    assert kv.cow_last_block_if_shared(child) == (1, 2)
    assert kv.get_block_table("c") == [0, 2]
    assert kv.get_block_table("p") == [0, 1]  # the other owner is unchanged
    assert kv.block_pool.ref_cnt(1) == 1 and kv.block_pool.ref_cnt(2) == 1
    # Now the parent owns block 1 alone: no copy.
    assert kv.cow_last_block_if_shared(parent) is None
    kv.check_integrity()
    kv.free(parent)
    kv.free(child)
    assert kv.num_free_blocks == 8
    kv.check_integrity()


def test_cow_not_needed_when_last_block_is_full():
    kv = KVCacheManager(block_size=4, num_blocks=8)
    parent = req("p", 8)
    kv.allocate_slots(parent, 8)
    parent.num_computed_tokens = 8
    child = req("c", 8)
    child.num_computed_tokens = 8
    kv.fork(parent, child)
    assert kv.cow_last_block_if_shared(child) is None  # position 8 goes to a new block
    assert kv.allocate_slots(child, 1) == [2]
    assert kv.get_block_table("p") == [0, 1]
    kv.check_integrity()


def test_cow_without_free_block_raises_and_changes_nothing():
    kv = KVCacheManager(block_size=4, num_blocks=1)
    parent = req("p", 2)
    kv.allocate_slots(parent, 2)
    parent.num_computed_tokens = 2
    child = req("c", 2)
    child.num_computed_tokens = 2
    kv.fork(parent, child)
    with pytest.raises(NoFreeBlocksError):
        kv.cow_last_block_if_shared(child)
    assert kv.get_block_table("c") == [0] and kv.block_pool.ref_cnt(0) == 2
    kv.check_integrity()


def test_fork_errors():
    kv = KVCacheManager(block_size=4, num_blocks=4)
    a, b = req("a", 4), req("b", 4)
    with pytest.raises(ValueError):
        kv.fork(a, b)  # parent has no blocks
    kv.allocate_slots(a, 4)
    kv.allocate_slots(b, 4)
    with pytest.raises(ValueError):
        kv.fork(a, b)  # child already has a table


def test_check_integrity_detects_corruption():
    kv = KVCacheManager(block_size=4, num_blocks=4)
    a = req("a", 8)
    kv.allocate_slots(a, 8)
    kv.block_pool.blocks[0].ref_cnt = 2  # a table entry missing for this reference
    with pytest.raises(RuntimeError, match="ref_cnt 2"):
        kv.check_integrity()
    kv.block_pool.blocks[0].ref_cnt = 1
    kv.check_integrity()
    kv.block_tables["a"].append(3)  # a table holding a free block
    with pytest.raises(RuntimeError):
        kv.check_integrity()


def test_bad_config():
    with pytest.raises(ValueError):
        KVCacheManager(block_size=0, num_blocks=4)
    with pytest.raises(ValueError):
        KVCacheManager(block_size=4, num_blocks=0)
