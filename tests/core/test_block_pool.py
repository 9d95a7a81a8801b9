"""BlockPool and its O(1) free queue."""

import pytest

import random

from pagedllm.core.block_pool import (BlockList, BlockPool, FreeKVCacheBlockQueue, KVCacheBlock,
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


def test_lazy_queue_keeps_the_order_of_eagerly_linked_blocks():
    """A pool's queue starts unlinked (``BlockList``); 3000 random pops, removals from the middle
    (fresh blocks included) and appends give, after every step, the queue of a plain list that
    starts as every id in order (pop from the front, remove anywhere, append at the back: what
    linking every block up front gave), and only the blocks ever taken exist as objects."""
    rng = random.Random(0)
    n = 64
    eager = list(range(n))   # the reference queue, head first
    lazy_blocks = BlockList(n)
    lazy = FreeKVCacheBlockQueue(lazy_blocks)
    assert len(lazy) == n and sum(b is not None for b in lazy_blocks._blocks) == 0
    out: set[int] = set()
    touched = set()
    for _ in range(3000):
        op = rng.random()
        free = list(eager)
        if op < 0.4 and free:
            a, b = eager.pop(0), lazy.popleft().block_id
            assert a == b
            out.add(a)
            touched.add(a)
        elif op < 0.6 and free:
            i = rng.choice(free)   # may be a never-allocated block
            eager.remove(i)
            lazy.remove(lazy_blocks[i])
            out.add(i)
            touched.add(i)
        elif out:
            i = rng.choice(sorted(out))
            out.discard(i)
            eager.append(i)
            lazy.append(lazy_blocks[i])
        free = list(eager)
        if free:
            with pytest.raises(RuntimeError):   # a block in the queue cannot go in again
                lazy.append(lazy_blocks[rng.choice(free)])
        assert [b.block_id for b in lazy] == list(eager)
        assert len(lazy) == len(eager) == n - len(out)
        assert all((lazy_blocks[i] in lazy) == (i not in out) for i in range(0, n, 7))
    made = {i for i, b in enumerate(lazy_blocks._blocks) if b is not None}
    assert made <= touched | set(range(0, n, 7)) | set(eager)
    with pytest.raises(IndexError):
        lazy_blocks[-1]


def test_pool_of_a_million_blocks_makes_only_what_it_hands_out():
    pool = BlockPool(1_000_000)
    assert pool.get_new_blocks(3) == [0, 1, 2] and pool.is_free(999_999) and not pool.is_free(1)
    pool.free_blocks([2, 1, 0])
    assert sum(b is not None for b in pool.blocks._blocks) == 4   # 0, 1, 2 and 999_999 (looked at)
    assert pool.get_new_blocks(2) == [3, 4] and pool.get_num_free_blocks() == 999_998
    free = pool.free_block_ids()   # makes every block
    assert free[:2] == [5, 6] and free[-3:] == [2, 1, 0] and len(free) == 999_998
