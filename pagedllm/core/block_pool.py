"""The pool of physical KV blocks: per-block reference counts and an O(1) LRU free queue.

A block is a row of every layer's ``k_cache`` / ``v_cache`` ([num_blocks, block_size, ...]);
this module only tracks ids. The free queue is a doubly linked list threaded through the block
objects, as vLLM V1's ``FreeKVCacheBlockQueue`` (``vllm/v1/core/kv_cache_utils.py``): allocation
pops from the head (least recently freed), freeing appends to the tail, and ``remove`` takes a
block out of the middle in O(1). That last operation is what prefix caching needs to revive a
freed block whose contents are still valid, and evicting from the head is its LRU policy.
"""

from __future__ import annotations

from collections import Counter
from typing import Iterable, Iterator


class NoFreeBlocksError(ValueError):
    """Asked for more blocks than the pool has free."""


class KVCacheBlock:
    """Metadata of one physical block.

    Attributes:
        block_id: row index in the KV tensors, 0..num_blocks-1.
        ref_cnt: how many block tables hold this block; 0 means it is in the free queue.
        block_hash: hash of the full block's tokens (prefix caching; unused for now, ``None``).
        prev_free, next_free: links of the free queue; ``None`` while the block is in use.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks with sentinels; every operation is O(1) per block.

    Order: head = next to allocate (least recently freed), tail = most recently freed.
    """

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinel
        self._tail = KVCacheBlock(-1)  # sentinel
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block.

        Raises:
            NoFreeBlocksError: if the queue is empty.
        """
        block = self._head.next_free
        if block is self._tail or block is None:
            raise NoFreeBlocksError("no free blocks left")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from anywhere in the queue.

        Raises:
            RuntimeError: if the block is not in the queue.
        """
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise RuntimeError(f"block {block.block_id} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Link ``block`` at the tail.

        Raises:
            RuntimeError: if the block is already in the queue.
        """
        if block.prev_free is not None or block.next_free is not None:
            raise RuntimeError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Blocks from head to tail."""
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """Physical blocks ``0..num_blocks-1`` with reference counts and a free queue.

    Args:
        num_blocks: blocks in the pool (>= 1).
    Raises:
        ValueError: if ``num_blocks < 1``.
    """

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)

    def _check_ids(self, block_ids: Iterable[int]) -> list[int]:
        ids = list(block_ids)
        for block_id in ids:
            if not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
                raise ValueError(f"block id must be in [0, {self.num_blocks}), got {block_id!r}")
        return ids

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks from the head of the free queue, each with ref_cnt 1.

        Returns:
            The physical block ids, in allocation order.
        Raises:
            ValueError: if ``num_blocks < 0``.
            NoFreeBlocksError (a ValueError): if fewer than ``num_blocks`` blocks are free;
                nothing is allocated then.
            RuntimeError: if a block in the free queue has a nonzero ref_cnt.
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > len(self.free_block_queue):
            raise NoFreeBlocksError(
                f"asked for {num_blocks} blocks, only {len(self.free_block_queue)} of "
                f"{self.num_blocks} are free")
        out: list[int] = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            if block.ref_cnt != 0:
                raise RuntimeError(
                    f"block {block.block_id} was in the free queue with ref_cnt {block.ref_cnt}")
            block.ref_cnt = 1
            block.block_hash = None  # no prefix caching yet: its contents are about to change
            out.append(block.block_id)
        return out

    def free_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop one reference to each block; blocks reaching ref_cnt 0 go to the queue's tail.

        Pass a table in reverse (tail blocks first) so the blocks freed last, the prompt's
        first blocks, are the last to be reused (what prefix caching wants). A block may appear
        several times; each occurrence drops one reference.

        Raises:
            ValueError: for an id outside the pool.
            RuntimeError: if a ref_cnt would go negative; nothing is changed then.
        """
        ids = self._check_ids(block_ids)
        for block_id, count in Counter(ids).items():
            if self.blocks[block_id].ref_cnt < count:
                raise RuntimeError(
                    f"freeing block {block_id} {count} time(s) but its ref_cnt is "
                    f"{self.blocks[block_id].ref_cnt}")
        for block_id in ids:
            block = self.blocks[block_id]
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def incr_ref(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each (in-use) block, for sharing it with another table.

        Raises:
            ValueError: for an id outside the pool.
            RuntimeError: if a block is free (ref_cnt 0); nothing is changed then.
        """
        ids = self._check_ids(block_ids)
        for block_id in ids:
            if self.blocks[block_id].ref_cnt <= 0:
                raise RuntimeError(f"cannot share free block {block_id} (ref_cnt 0)")
        for block_id in ids:
            self.blocks[block_id].ref_cnt += 1

    def get_num_free_blocks(self) -> int:
        """Blocks in the free queue."""
        return len(self.free_block_queue)

    def ref_cnt(self, block_id: int) -> int:
        """How many tables hold ``block_id``."""
        return self.blocks[self._check_ids([block_id])[0]].ref_cnt

    def is_free(self, block_id: int) -> bool:
        """True when the block is in the free queue."""
        block = self.blocks[self._check_ids([block_id])[0]]
        return block.prev_free is not None

    def free_block_ids(self) -> list[int]:
        """Ids in the free queue, head (next to allocate) first. O(num_free)."""
        return [block.block_id for block in self.free_block_queue]

    def get_usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return 1.0 - len(self.free_block_queue) / self.num_blocks
