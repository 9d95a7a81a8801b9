"""Block tables: which physical KV blocks hold each request's tokens (PagedAttention).

Logical block ``i`` of a request holds its tokens ``[i * block_size, (i + 1) * block_size)``;
its block table maps ``i`` to a physical block id of the ``BlockPool``. Blocks are allocated
lazily, only when the tokens of the coming step need them, and shared blocks (``fork``) are
reference counted and copied before a write (copy-on-write).
"""

from __future__ import annotations

import logging
from collections import Counter

from pagedllm.core.block_pool import BlockPool
from pagedllm.core.request import Request

logger = logging.getLogger(__name__)


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints."""
    return -(-a // b)


class KVCacheManager:
    """Allocates, shares and frees the blocks of each request.

    Args:
        block_size: tokens per block (>= 1).
        num_blocks: physical blocks in the pool (>= 1).
    Raises:
        ValueError: for a non-positive ``block_size`` or ``num_blocks``.
    """

    def __init__(self, block_size: int, num_blocks: int) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        # request id -> physical block ids, logical order.
        self.block_tables: dict[str, list[int]] = {}

    # -- sizes -----------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Blocks in the pool."""
        return self.block_pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks in the free queue."""
        return self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        """Fraction of blocks in use, in [0, 1]."""
        return self.block_pool.get_usage()

    def num_blocks_for_tokens(self, num_tokens: int) -> int:
        """Blocks needed to hold ``num_tokens`` tokens."""
        return cdiv(num_tokens, self.block_size)

    # -- allocation ------------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Make the request's table cover the tokens it computes in the coming step.

        Token ranges (vLLM V1's ``allocate_slots`` picture, without prefix caching)::

            | <------------- num_computed_tokens -------------> | <- num_new_tokens -> |
            | computed (K/V cached)                             | scheduled this step  |
            |<--- already in the table --->|<- newly allocated blocks (if needed) ->|

        Only ``cdiv(num_computed_tokens + num_new_tokens, block_size) - len(table)`` blocks are
        taken (0 when the last block still has room). Call it before ``num_computed_tokens``
        advances for the step.

        Args:
            request: the request; ``request.num_computed_tokens`` tokens are already cached.
            num_new_tokens: tokens to be computed this step (>= 0).
        Returns:
            The newly allocated physical block ids (possibly empty), or ``None`` when the pool
            lacks free blocks; nothing is allocated then (the caller preempts or waits).
        Raises:
            ValueError: if ``num_new_tokens < 0``.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        table = self.block_tables.get(request.request_id)
        have = 0 if table is None else len(table)
        need = cdiv(request.num_computed_tokens + num_new_tokens, self.block_size) - have
        if need <= 0:
            return []
        if need > self.block_pool.get_num_free_blocks():
            return None
        new_ids = self.block_pool.get_new_blocks(need)
        if table is None:
            self.block_tables[request.request_id] = new_ids.copy()
        else:
            table.extend(new_ids)
        return new_ids

    def free(self, request: Request) -> None:
        """Drop the request's table and one reference to each of its blocks.

        Blocks go back in reverse logical order (see ``BlockPool.free_blocks``). A request
        without a table is a no-op.
        """
        table = self.block_tables.pop(request.request_id, None)
        if table:
            self.block_pool.free_blocks(reversed(table))

    def get_block_table(self, request_id: str) -> list[int]:
        """A copy of the request's physical block ids in logical order ([] if it has none)."""
        return list(self.block_tables.get(request_id, ()))

    # -- sharing ---------------------------------------------------------------------------

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` the parent's blocks (one more reference each), as for n > 1 / beams.

        The child's ``num_computed_tokens`` is the caller's to set (normally the parent's);
        before either writes into the shared partial last block, call
        ``cow_last_block_if_shared``.

        Raises:
            ValueError: if the child already has a table or the parent has none.
        """
        if child.request_id in self.block_tables:
            raise ValueError(f"child request {child.request_id!r} already has a block table")
        parent_table = self.block_tables.get(parent.request_id)
        if not parent_table:
            raise ValueError(f"parent request {parent.request_id!r} has no blocks to share")
        self.block_pool.incr_ref(parent_table)
        self.block_tables[child.request_id] = list(parent_table)

    def cow_last_block_if_shared(self, request: Request) -> tuple[int, int] | None:
        """Copy-on-write the block the request writes next, when another table shares it.

        The block written next is the table's last one when it still has free slots
        (``num_computed_tokens < len(table) * block_size``). If its ref_cnt is > 1, a fresh block
        replaces it in this request's table only and the old one loses a reference; the other
        owners' tables are unchanged. The caller must copy the K/V of ``src`` into ``dst``
        (``SchedulerOutput.blocks_to_copy``) before the step writes.

        Returns:
            (src, dst) physical ids to copy, or ``None`` when no copy is needed.
        Raises:
            NoFreeBlocksError (a ValueError): if a copy is needed and no block is free; nothing
                changes then.
        """
        table = self.block_tables.get(request.request_id)
        if not table:
            return None
        if request.num_computed_tokens >= len(table) * self.block_size:
            return None  # the last block is full: the next token goes to a new block
        src = table[-1]
        if self.block_pool.ref_cnt(src) <= 1:
            return None
        (dst,) = self.block_pool.get_new_blocks(1)
        self.block_pool.free_blocks([src])  # ref_cnt >= 2, so it stays in use by the others
        table[-1] = dst
        logger.debug("CoW for request %s: block %d -> %d", request.request_id, src, dst)
        return src, dst

    # -- invariants ------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Check the pool against the tables.

        Raises:
            RuntimeError: with the counts, if free + used != total, a block's ref_cnt differs
                from the number of tables holding it, a referenced block is in the free queue,
                or an unreferenced block is missing from it.
        """
        pool = self.block_pool
        holders: Counter[int] = Counter()
        for table in self.block_tables.values():
            holders.update(table)
        free_ids = pool.free_block_ids()
        if len(free_ids) != pool.get_num_free_blocks():
            raise RuntimeError(
                f"free queue holds {len(free_ids)} blocks but counts "
                f"{pool.get_num_free_blocks()}")
        free_set = set(free_ids)
        if len(free_set) != len(free_ids):
            raise RuntimeError(f"free queue has duplicates: {len(free_ids)} entries, "
                               f"{len(free_set)} distinct")
        used = sum(1 for block in pool.blocks if block.ref_cnt > 0)
        if used + len(free_ids) != pool.num_blocks:
            raise RuntimeError(
                f"free ({len(free_ids)}) + used ({used}) != total ({pool.num_blocks})")
        for block in pool.blocks:
            if block.ref_cnt != holders.get(block.block_id, 0):
                raise RuntimeError(
                    f"block {block.block_id} has ref_cnt {block.ref_cnt} but "
                    f"{holders.get(block.block_id, 0)} table entries hold it")
            if block.ref_cnt > 0 and block.block_id in free_set:
                raise RuntimeError(
                    f"block {block.block_id} has ref_cnt {block.ref_cnt} and is in the free queue")
