"""BlockPool and its O(1) free queue."""

import pytest

from pagedllm.core.block_pool import (BlockPool, FreeKVCacheBlockQueue, KVCacheBlock,
                                      NoFreeBlocksError)


def test_allocate_in_order_and_usage():
    pool = BlockPool(16)
    assert pool.num_blocks == 16 and pool.get_num_free_blocks() == 16 and pool.get_usage() == 0.0
    assert pool.get_new_blocks(3) == [0, 1, 2]
    assert pool.get_new_blocks(0) == []
    assert [pool.ref_cnt(i) for i in range(4)] == [1, 1, 1, 0]
    assert pool.get_num_free_blocks() == 13
    assert pool.get_usage() == pytest.approx(3 / 16)


def test_not_enough_blocks_allocates_nothing():
    pool = BlockPool(4)
    pool.get_new_blocks(3)
    with pytest.raises(NoFreeBlocksError):
        pool.get_new_blocks(2)
    with pytest.raises(ValueError):  # NoFreeBlocksError is a ValueError
        pool.get_new_blocks(2)
    assert pool.get_num_free_blocks() == 1
    with pytest.raises(ValueError):
        pool.get_new_blocks(-1)


def test_freed_blocks_go_to_the_tail():
    pool = BlockPool(6)
    a = pool.get_new_blocks(2)  # 0, 1
    pool.get_new_blocks(2)  # 2, 3
    pool.free_blocks(reversed(a))  # tail gets 1 then 0
    assert pool.free_block_ids() == [4, 5, 1, 0]
    assert pool.get_new_blocks(3) == [4, 5, 1]
    assert pool.is_free(0) and not pool.is_free(1)


def test_ref_counting():
    pool = BlockPool(4)
    (b,) = pool.get_new_blocks(1)
    pool.incr_ref([b])
    assert pool.ref_cnt(b) == 2
    pool.free_blocks([b])
    assert pool.ref_cnt(b) == 1 and not pool.is_free(b)
    pool.free_blocks([b])
    assert pool.ref_cnt(b) == 0 and pool.is_free(b)
    assert pool.get_num_free_blocks() == 4


def test_double_free_raises_and_changes_nothing():
    pool = BlockPool(4)
    ids = pool.get_new_blocks(2)
    with pytest.raises(RuntimeError, match="ref_cnt"):
        pool.free_blocks([ids[0], ids[1], ids[1]])
    assert [pool.ref_cnt(i) for i in ids] == [1, 1]
    assert pool.get_num_free_blocks() == 2
    pool.free_blocks(ids)
    with pytest.raises(RuntimeError):
        pool.free_blocks([ids[0]])


def test_incr_ref_on_free_block_raises():
    pool = BlockPool(4)
    with pytest.raises(RuntimeError):
        pool.incr_ref([0])


def test_bad_ids_and_sizes():
    with pytest.raises(ValueError):
        BlockPool(0)
    pool = BlockPool(4)
    with pytest.raises(ValueError):
        pool.free_blocks([4])
    with pytest.raises(ValueError):
        pool.ref_cnt(-1)


def test_free_queue_remove_from_middle():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4] and len(q) == 4
    with pytest.raises(RuntimeError):
        q.remove(blocks[2])
    with pytest.raises(RuntimeError):
        q.append(blocks[0])
    q.append(blocks[2])
    assert [b.block_id for b in q] == [0, 1, 3, 4, 2]
    assert [q.popleft().block_id for _ in range(5)] == [0, 1, 3, 4, 2]
    with pytest.raises(NoFreeBlocksError):
        q.popleft()
