"""Swap preemption's host side (vLLM's ``preemption_mode="swap"`` and ``swap_space``).

A second ``BlockPool`` of host blocks (``num_cpu_blocks``; the worker holds their tensors) and the
host tables of the swapped-out requests. ``swap_out`` moves a request's device table to host blocks
and frees the device blocks; ``swap_in`` moves it back into device blocks. Both return the (src,
dst) pairs the worker copies before the next forward (a block id names the same page in every
layer's tensor, so the worker copies the pair in each layer).

Tables are flat: with ``num_groups`` KV cache groups (the hybrid manager's) logical block ``i``
of group ``g`` is entry ``i * num_groups + g``. With a ``null_block_id`` (the hybrid pool's block
0, standing for a sliding group's blocks out of the window) the host pool reserves the same id
as its own null block: a null entry stays null on the host and back, takes no host block and is
never copied.

A full block shared by several requests is copied once each way: ``dev_to_cpu`` / ``cpu_to_dev``
remember where a full block's copy went while both ends are held (full blocks are never written
again, so the copy stays exact), and the next sharer takes a reference to it instead of copying
again. Whoever frees device blocks calls ``forget_freed`` so that a record never names a reused
block.

``KVCacheManager`` and ``HybridKVCacheManager`` own one (``swap_space``) when they have host blocks.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Iterable, Mapping

from pagedllm.core.block_pool import BlockPool
from pagedllm.core.kv_cache_spec import cdiv
from pagedllm.core.request import Request


def _forget(pool: BlockPool, block_ids: Iterable[int], forward: dict[int, int], backward: dict[int, int]) -> None:
    """Drop the copy records of the blocks of ``pool`` among ``block_ids`` that are now free:
    their entries in ``forward`` (keyed by them) and in ``backward`` (pointing at them)."""
    freed = {b for b in block_ids if pool.blocks[b].ref_cnt == 0}
    if freed:
        for b in freed:
            forward.pop(b, None)
        for other, b in list(backward.items()):
            if b in freed:
                del backward[other]


class SwapSpace:
    """Host blocks, the swapped-out requests' host tables, and the device <-> host copy records.

    Args:
        num_cpu_blocks: host blocks (>= 1; with ``null_block_id``, one of them is the host null
            block, never allocated).
        device_pool: the device ``BlockPool`` the tables move out of and back into.
        num_groups: KV cache groups interleaved in a table (entry ``k`` is logical block
            ``k // num_groups``).
        null_block_id: the table entry standing for no block (the hybrid manager's
            ``NULL_BLOCK_ID``), or None when every entry is a block.
    Raises:
        RuntimeError: if the host pool's first block is not ``null_block_id``.

    Attributes:
        cpu_block_pool: the host ``BlockPool``.
        cpu_block_tables: request id -> flat host block ids (null entries kept), while swapped out.
        dev_to_cpu: device block -> the host block holding its copy (a full block swapped out).
        cpu_to_dev: host block -> the device block holding its copy (a full block swapped in).
    """

    def __init__(self, num_cpu_blocks: int, device_pool: BlockPool, num_groups: int = 1,
                 null_block_id: int | None = None) -> None:
        self.device_pool = device_pool
        self.cpu_block_pool = BlockPool(num_cpu_blocks)
        self.num_groups = num_groups
        self.null_block_id = null_block_id
        if null_block_id is not None:
            (null,) = self.cpu_block_pool.get_new_blocks(1)
            if null != null_block_id:
                raise RuntimeError(f"the host pool's first block is {null}, expected the null block {null_block_id}")
        self.cpu_block_tables: dict[str, list[int]] = {}
        self.dev_to_cpu: dict[int, int] = {}
        self.cpu_to_dev: dict[int, int] = {}

    @property
    def num_cpu_blocks(self) -> int:
        """Host blocks in the pool."""
        return self.cpu_block_pool.num_blocks

    def is_swapped(self, request_id: str) -> bool:
        """True while the request's blocks are in the host pool."""
        return request_id in self.cpu_block_tables

    def forget_freed(self, device_ids: Iterable[int] = (), cpu_ids: Iterable[int] = ()) -> None:
        """Drop copy records whose device or host end was just freed (it may be reused)."""
        _forget(self.device_pool, device_ids, self.dev_to_cpu, self.cpu_to_dev)
        _forget(self.cpu_block_pool, cpu_ids, self.cpu_to_dev, self.dev_to_cpu)

    def _is_full(self, k: int, num_full: int) -> bool:
        """Whether table entry ``k`` is one of the first ``num_full`` logical blocks (full)."""
        return k // self.num_groups < num_full

    def _real(self, table: Iterable[int]) -> list[int]:
        """The entries of ``table`` that are blocks (null entries dropped)."""
        return [b for b in table if b != self.null_block_id]

    def can_swap_out(self, table: list[int], num_full: int) -> bool:
        """True when the host pool has room for ``table`` (its first ``num_full`` logical blocks
        full; those already copied to the host count once, null entries not at all)."""
        need = sum(1 for k, d in enumerate(table)
                   if d != self.null_block_id and not (self._is_full(k, num_full) and d in self.dev_to_cpu))
        return need <= self.cpu_block_pool.get_num_free_blocks()

    def swap_out(self, request_id: str, table: list[int], num_full: int) -> list[tuple[int, int]]:
        """Give the request a host table copying ``table`` and free the device blocks of ``table``.

        Call only when ``can_swap_out(table, num_full)``; ``table`` is no longer the caller's.
        Null entries stay null (no host block, no copy).

        Args:
            table: the flat device table (``num_groups`` entries per logical block).
            num_full: the request's full logical blocks (``num_computed_tokens // block_size``).
        Returns:
            (device block, host block) pairs to copy before the next forward.
        """
        cpu = self.cpu_block_pool
        cpu_table, pairs = [], []
        for k, d in enumerate(table):
            if d == self.null_block_id:
                cpu_table.append(d)
                continue
            full = self._is_full(k, num_full)
            c = self.dev_to_cpu.get(d) if full else None
            if c is not None:
                cpu.incr_ref([c])
            else:
                (c,) = cpu.get_new_blocks(1)
                pairs.append((d, c))
                if full:
                    self.dev_to_cpu[d] = c
            cpu_table.append(c)
        self.cpu_block_tables[request_id] = cpu_table
        real = self._real(table)
        self.device_pool.free_blocks(reversed(real))
        self.forget_freed(device_ids=real)
        return pairs

    def swap_in(self, request_id: str, num_full: int, num_extra_blocks: int,
                cached_block: Callable[[int], int | None]) -> tuple[list[int], list[tuple[int, int]]] | None:
        """Move a swapped-out request's host table back into device blocks and free its host blocks.

        A full block whose device copy is still held (by a sharer that stayed, or one swapped in
        earlier) is shared again instead of copied; otherwise ``cached_block(k)`` may name a
        device block holding table entry ``k`` (a prefix-cache hit), taken as well. Null entries
        stay null.

        Args:
            num_full: the request's full logical blocks (only those may be shared or taken).
            num_extra_blocks: device blocks the caller allocates right after (its next tokens);
                counted so that they are free.
            cached_block: flat table index -> a registered device block with its contents, or None.
        Returns:
            (the device table, (host block, device block) pairs to copy before the next forward),
            or ``None`` when the device pool lacks blocks (nothing changes then).
        """
        pool, cpu_table = self.device_pool, self.cpu_block_tables[request_id]
        on_device = {c: d for d, c in self.dev_to_cpu.items()}
        on_device.update(self.cpu_to_dev)
        source: list[int | None] = []   # the device block each entry takes, None: a new copy
        for k, c in enumerate(cpu_table):
            d = None
            if c == self.null_block_id:
                d = c
            elif self._is_full(k, num_full):
                d = on_device.get(c)
                if d is None:
                    d = cached_block(k)
            source.append(d)
        taken = self._real(d for d in source if d is not None)
        num_revived = sum(1 for d in taken if pool.ref_cnt(d) == 0)
        if source.count(None) + num_revived + num_extra_blocks > pool.get_num_free_blocks():
            return None
        # Hits first: a new allocation must not evict a free cached block taken below.
        pool.touch(taken)
        table, pairs = [], []
        for k, c in enumerate(cpu_table):
            d = source[k]
            if d is None:
                (d,) = pool.get_new_blocks(1)
                pairs.append((c, d))
                if self._is_full(k, num_full):
                    self.cpu_to_dev[c] = d
            table.append(d)
        self.free(request_id)
        return table, pairs

    def free(self, request_id: str) -> None:
        """Drop the request's host table (if any) and one reference to each of its host blocks."""
        cpu_table = self._real(self.cpu_block_tables.pop(request_id, ()))
        if cpu_table:
            self.cpu_block_pool.free_blocks(cpu_table)
            self.forget_freed(cpu_ids=cpu_table)

    def check(self, device_tables: Mapping[str, list[int]], block_size: int,
              requests: Mapping[str, Request] | None = None) -> None:
        """Check the host pool against the host tables and the copy records (the swap part of
        ``KVCacheManager.check_integrity``).

        Args:
            device_tables: the device block tables (no request may hold both kinds).
            requests: the live requests by id, if known; enables the table-length check.
        Raises:
            RuntimeError: with the counts, if a request holds device and host blocks, free + used
                != total, a host block's ref_cnt differs from the number of host tables holding
                it (the null block: 1, the pool's own), a copy record outlived one of its blocks
                or names a null block, or (with ``requests``) a host table is not
                ``cdiv(num_computed_tokens, block_size)`` logical blocks long.
        """
        both = set(device_tables) & set(self.cpu_block_tables)
        if both:
            raise RuntimeError(f"{len(both)} requests hold both device and host blocks")
        cpu = self.cpu_block_pool
        holders: Counter[int] = Counter()
        for table in self.cpu_block_tables.values():
            holders.update(self._real(table))
        if self.null_block_id is not None:
            holders[self.null_block_id] = 1   # the host pool's own reference
            if self.null_block_id in self.dev_to_cpu or self.null_block_id in self.cpu_to_dev:
                raise RuntimeError("a copy record names the null block")
        used = sum(1 for b in cpu.blocks if b.ref_cnt > 0)
        if used + cpu.get_num_free_blocks() != cpu.num_blocks:
            raise RuntimeError(f"host pool: free ({cpu.get_num_free_blocks()}) + used ({used}) != "
                               f"total ({cpu.num_blocks})")
        for block in cpu.blocks:
            if block.ref_cnt != holders.get(block.block_id, 0):
                raise RuntimeError(f"host block {block.block_id} has ref_cnt {block.ref_cnt} but "
                                   f"{holders.get(block.block_id, 0)} swapped tables hold it")
        for d, c in self.dev_to_cpu.items():
            if self.device_pool.blocks[d].ref_cnt == 0 or cpu.blocks[c].ref_cnt == 0:
                raise RuntimeError(f"copy record device {d} -> host {c} outlived one of its blocks")
        for c, d in self.cpu_to_dev.items():
            if self.device_pool.blocks[d].ref_cnt == 0 or cpu.blocks[c].ref_cnt == 0:
                raise RuntimeError(f"copy record host {c} -> device {d} outlived one of its blocks")
        for rid, table in self.cpu_block_tables.items():
            request = None if requests is None else requests.get(rid)
            if request is not None and len(table) != cdiv(request.num_computed_tokens, block_size) * self.num_groups:
                raise RuntimeError(f"swapped request {rid!r}: a host table of {len(table)} entries "
                                   f"({self.num_groups} groups) for {request.num_computed_tokens} computed tokens")
