"""The pool of physical KV blocks: per-block reference counts and an O(1) LRU free queue.

A block is a row of every layer's ``k_cache`` / ``v_cache`` ([num_blocks, block_size, ...]);
this module only tracks ids. The free queue is a doubly linked list threaded through the block
objects, as vLLM V1's ``FreeKVCacheBlockQueue`` (``vllm/v1/core/kv_cache_utils.py``): allocation
pops from the head (least recently freed), freeing appends to the tail, and ``remove`` takes a
block out of the middle in O(1). That last operation is what prefix caching needs to revive a
freed block whose contents are still valid, and evicting from the head is its LRU policy.

Prefix caching (vLLM V1's ``BlockPool``): a full block whose K/V is written can be registered
under its chained content hash (``cache_full_block``). It keeps hash and contents when freed
(ref_cnt 0, still in ``cached_block_hash_to_block``), so a later request can take it back out of
the free queue (``touch``); it loses them only when ``get_new_blocks`` evicts it from the head.

KV-cache events (vLLM's ``BlockPool`` with ``enable_kv_cache_events``; structs in
``distributed/kv_events.py``): with events on, registering blocks (``cache_full_blocks``) records a
``BlockStored``, evicting a registered block a ``BlockRemoved``, a reset ``AllBlocksCleared``;
``take_events`` hands them over (the engine publishes them once per step). With events off
nothing is recorded.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterable, Iterator, Sequence

from pagedllm.core.kv_cache_utils import BlockHash, to_external_block_hash
from pagedllm.distributed.kv_events import (MEDIUM_GPU, AllBlocksCleared, BlockRemoved, BlockStored,
                                            KVCacheEvent)


class NoFreeBlocksError(ValueError):
    """Asked for more blocks than the pool has free."""


class KVCacheBlock:
    """Metadata of one physical block.

    Attributes:
        block_id: row index in the KV tensors, 0..num_blocks-1.
        ref_cnt: how many block tables hold this block; 0 means it is in the free queue.
        block_hash: chained hash of the full block's tokens while it is registered in the
            prefix cache (``BlockPool.cache_full_block``), else ``None``. Kept while the block
            sits in the free queue, dropped when it is evicted (reallocated).
        prev_free, next_free: links of the free queue; ``None`` while the block is in use.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else f", hash={self.block_hash[:4].hex()}"
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}{cached})"


class BlockList(Sequence[KVCacheBlock]):
    """The blocks ``0..num_blocks-1`` of a pool, each ``KVCacheBlock`` made on first access.

    A pool of a few GiB holds 10^5-10^6 blocks; making their objects up front cost ~0.3 s per
    100k blocks at every engine start, most of them never touched by a short run.
    ``blocks[i].block_id == i``; iterating makes every block.
    """

    __slots__ = ("_blocks",)

    def __init__(self, num_blocks: int) -> None:
        self._blocks: list[KVCacheBlock | None] = [None] * num_blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def __getitem__(self, block_id: int) -> KVCacheBlock:  # type: ignore[override]
        """The block ``block_id`` (an int in ``[0, len)``).

        Raises:
            IndexError: for an id outside the pool (negative ids too: they name no block).
        """
        if block_id < 0:
            raise IndexError(f"block id {block_id} < 0")
        block = self._blocks[block_id]
        if block is None:
            block = self._blocks[block_id] = KVCacheBlock(block_id)
        return block

    def __iter__(self) -> Iterator[KVCacheBlock]:
        return (self[i] for i in range(len(self._blocks)))


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks with sentinels; every operation is O(1) per block.

    Order: head = next to allocate (least recently freed), tail = most recently freed.

    ``blocks`` (a ``BlockList``, or any sequence with ``blocks[i].block_id == i``) all start in
    the queue in id order, without being linked: the never-allocated ("fresh") ids
    ``next_fresh..len(blocks)-1`` are the head of the queue, before every linked block. That is
    the order linking them all would give, since nothing is ever put back ahead of a block that
    was never taken; ``remove`` of a fresh block only marks its id as taken.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)  # sentinel
        self._tail = KVCacheBlock(-1)  # sentinel
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = len(blocks)
        self._fresh = blocks
        self._next_fresh = 0
        self._fresh_taken: set[int] = set()   # fresh ids ``remove`` took out of the queue

    def __len__(self) -> int:
        return self.num_free_blocks

    def _is_fresh(self, block: KVCacheBlock) -> bool:
        """True while ``block`` is a never-allocated block still in the queue."""
        return (self._next_fresh <= block.block_id < len(self._fresh) and block.prev_free is None
                and block.block_id not in self._fresh_taken)

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.prev_free is not None or self._is_fresh(block)

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head block.

        Raises:
            NoFreeBlocksError: if the queue is empty.
        """
        while self._next_fresh < len(self._fresh):
            block_id = self._next_fresh
            self._next_fresh += 1
            if block_id in self._fresh_taken:
                self._fresh_taken.discard(block_id)
                continue
            self.num_free_blocks -= 1
            return self._fresh[block_id]
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
            if not self._is_fresh(block):
                raise RuntimeError(f"block {block.block_id} is not in the free queue")
            self._fresh_taken.add(block.block_id)
            self.num_free_blocks -= 1
            return
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        """Link ``block`` at the tail.

        Raises:
            RuntimeError: if the block is already in the queue.
        """
        if block.prev_free is not None or block.next_free is not None or self._is_fresh(block):
            raise RuntimeError(f"block {block.block_id} is already in the free queue")
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        """Blocks from head to tail."""
        for block_id in range(self._next_fresh, len(self._fresh)):
            if block_id not in self._fresh_taken:
                yield self._fresh[block_id]
        block = self._head.next_free
        while block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """Physical blocks ``0..num_blocks-1`` with reference counts, a free queue and the prefix
    cache's hash -> block map.

    Attributes:
        cached_block_hash_to_block: hash -> the one block registered under it (in use or free).
        enable_kv_cache_events: whether prefix-cache changes are recorded as KV-cache events.
        kv_event_queue: the events recorded since the last ``take_events``, oldest first.

    Args:
        num_blocks: blocks in the pool (>= 1).
        enable_kv_cache_events: record KV-cache events (``KVEventsConfig.enable_kv_cache_events``).
    Raises:
        ValueError: if ``num_blocks < 1``.
    """

    def __init__(self, num_blocks: int, enable_kv_cache_events: bool = False) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an int >= 1, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self.blocks = BlockList(num_blocks)
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, KVCacheBlock] = {}
        self.enable_kv_cache_events = bool(enable_kv_cache_events)
        self.kv_event_queue: list[KVCacheEvent] = []

    def _check_ids(self, block_ids: Iterable[int]) -> list[int]:
        ids = list(block_ids)
        for block_id in ids:
            if not isinstance(block_id, int) or not 0 <= block_id < self.num_blocks:
                raise ValueError(f"block id must be in [0, {self.num_blocks}), got {block_id!r}")
        return ids

    def get_new_blocks(self, num_blocks: int) -> list[int]:
        """Take ``num_blocks`` blocks from the head (LRU end) of the free queue, each with
        ref_cnt 1. A block still registered in the prefix cache is evicted: its hash leaves
        ``cached_block_hash_to_block`` and the block's ``block_hash`` is cleared.

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
            self._evict(block)  # its contents are about to change
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

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_block_hash_to_block.get(block.block_hash) is block:
                del self.cached_block_hash_to_block[block.block_hash]
                if self.enable_kv_cache_events:
                    block_hash, group_idx = to_external_block_hash(block.block_hash)
                    self.kv_event_queue.append(BlockRemoved([block_hash], MEDIUM_GPU, group_idx))
            block.block_hash = None

    # -- prefix cache ----------------------------------------------------------------------

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        """The id of the block registered under ``block_hash`` (in use or free), or ``None``."""
        block = self.cached_block_hash_to_block.get(block_hash)
        return None if block is None else block.block_id

    def touch(self, block_ids: Iterable[int]) -> None:
        """Add one reference to each block, taking free (ref_cnt 0) ones out of the free queue.

        This is how a prefix-cache hit revives a freed block whose contents are still valid.

        Raises:
            ValueError: for an id outside the pool.
        """
        for block_id in self._check_ids(block_ids):
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def cache_full_block(self, block_id: int, block_hash: BlockHash) -> bool:
        """Register a full, written block under its chained hash.

        Call only once every slot of the block holds K/V that no request will write again.
        If another block is already registered under ``block_hash`` (the same content computed
        twice, e.g. a recomputed last prompt block), this one stays unregistered: each hash maps
        to exactly one block.

        Returns:
            True if the block was registered now or already was under this hash.
        Raises:
            ValueError: for an id outside the pool.
            RuntimeError: if the block is free, or already registered under another hash.
        """
        block = self.blocks[self._check_ids([block_id])[0]]
        if block.ref_cnt <= 0:
            raise RuntimeError(f"cannot register free block {block_id} in the prefix cache")
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise RuntimeError(f"block {block_id} is already registered under another hash")
            return True
        if block_hash in self.cached_block_hash_to_block:
            return False
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block
        return True

    def cache_full_blocks(self, block_ids: Sequence[int], block_hashes: Sequence[BlockHash],
                          parent_block_hash: BlockHash | None, token_ids: Sequence[int], block_size: int,
                          lora_request: Any = None, extra_keys: tuple | None = None) -> None:
        """Register consecutive full blocks of one request (``cache_full_block`` each) and, with
        events on, record a ``BlockStored`` for each run of blocks registered now (one event
        when all are new; a block already registered, or whose hash another block holds, splits
        the run, so every event's hashes chain from its ``parent_block_hash``).

        Args:
            block_ids: the physical blocks, logical order.
            block_hashes: their keys (``BlockHash``, or ``group_block_hash`` in a hybrid cache).
            parent_block_hash: the key of the block before the first, or None at the prompt start.
            token_ids: their tokens, ``len(block_ids) * block_size`` of them.
            block_size: tokens per block.
            lora_request: the request's ``LoRARequest`` (``lora_int_id``, ``lora_name``), or None.
            extra_keys: what the hashes cover besides the tokens (``Request.block_hash_extra_keys``).
        Raises:
            ValueError, RuntimeError: as ``cache_full_block``; blocks before the bad one stay
                registered.
        """
        new = []
        for block_id, block_hash in zip(block_ids, block_hashes):
            before = self.blocks[self._check_ids([block_id])[0]].block_hash
            new.append(self.cache_full_block(block_id, block_hash) and before is None)
        if not self.enable_kv_cache_events:
            return
        i = 0
        while i < len(new):
            if not new[i]:
                i += 1
                continue
            j = i
            while j < len(new) and new[j]:
                j += 1
            parent = block_hashes[i - 1] if i else parent_block_hash
            self.kv_event_queue.append(self._block_stored(
                block_hashes[i:j], parent, token_ids[i * block_size:j * block_size], block_size,
                lora_request, extra_keys))
            i = j

    @staticmethod
    def _block_stored(keys: Sequence[BlockHash], parent: BlockHash | None, token_ids: Sequence[int],
                      block_size: int, lora_request: Any, extra_keys: tuple | None) -> BlockStored:
        """The ``BlockStored`` of registered keys (hashes sent without the group suffix)."""
        hashes = [to_external_block_hash(key)[0] for key in keys]
        group_idx = to_external_block_hash(keys[0])[1]
        return BlockStored(
            block_hashes=hashes,
            parent_block_hash=None if parent is None else to_external_block_hash(parent)[0],
            token_ids=list(token_ids), block_size=block_size,
            lora_id=None if lora_request is None else lora_request.lora_int_id,
            medium=MEDIUM_GPU,
            lora_name=None if lora_request is None else lora_request.lora_name,
            extra_keys=None if extra_keys is None else [tuple(extra_keys)] * len(hashes),
            group_idx=group_idx)

    def take_events(self) -> list[KVCacheEvent]:
        """The KV-cache events recorded since the last call, oldest first (and forget them);
        always ``[]`` with events off."""
        events, self.kv_event_queue = self.kv_event_queue, []
        return events

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered in the prefix cache (in use or free)."""
        return len(self.cached_block_hash_to_block)

    def reset_prefix_cache(self) -> bool:
        """Forget every registered hash (vLLM's semantics: only when no block is in use).

        Returns:
            True if the cache was cleared; False (nothing changed) while any block has
            ref_cnt > 0, since running requests may still read or register blocks.
        """
        if len(self.free_block_queue) != self.num_blocks:
            return False
        self.clear_cached_blocks()
        return True

    def clear_cached_blocks(self) -> None:
        """Forget every registered hash now (the caller checked that no block is in use) and, with
        events on, record ``AllBlocksCleared``."""
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())

    # -- sizes -----------------------------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Blocks in the free queue."""
        return len(self.free_block_queue)

    def ref_cnt(self, block_id: int) -> int:
        """How many tables hold ``block_id``."""
        return self.blocks[self._check_ids([block_id])[0]].ref_cnt

    def is_free(self, block_id: int) -> bool:
        """True when the block is in the free queue."""
        return self.blocks[self._check_ids([block_id])[0]] in self.free_block_queue

    def free_block_ids(self) -> list[int]:
        """Ids in the free queue, head (next to allocate) first. O(num_free)."""
        return [block.block_id for block in self.free_block_queue]

    def get_usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return 1.0 - len(self.free_block_queue) / self.num_blocks
