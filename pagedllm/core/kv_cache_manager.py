"""Block tables: which physical KV blocks hold each request's tokens (PagedAttention).

Logical block ``i`` of a request holds its tokens ``[i * block_size, (i + 1) * block_size)``;
its block table maps ``i`` to a physical block id of the ``BlockPool``. Blocks are allocated
lazily, only when the tokens of the coming step need them, and shared blocks (``fork``) are
reference counted and copied before a write (copy-on-write).

Automatic prefix caching (vLLM V1's ``KVCacheManager``): every full block of a request has a
chained content hash (``kv_cache_utils``), kept in ``request.block_hashes``. Once a full block's
K/V is written (``cache_blocks``, called after the step that computed its last token), it is
registered in the pool under that hash. A new request first asks ``get_computed_blocks`` for the
longest run of registered blocks from its start and passes them to ``allocate_slots``, which
takes a reference to each (reviving freed ones) and allocates only the rest.

Swap preemption (vLLM's ``preemption_mode="swap"``): with host blocks (``num_cpu_blocks``) the
manager owns a ``SwapSpace`` (``swap_space.py``: the host pool, the swapped-out requests' host
tables and the copy records); ``swap_out`` / ``swap_in`` move a request's table there and back.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Mapping

from pagedllm.core.block_pool import BlockPool, NoFreeBlocksError
from pagedllm.core.kv_cache_spec import cdiv
from pagedllm.core.kv_cache_utils import ComputedBlocks, PrefixCacheStats, hash_block_tokens
from pagedllm.core.request import Request
from pagedllm.core.swap_space import SwapSpace

logger = logging.getLogger(__name__)


class KVCacheManager:
    """Allocates, shares and frees the blocks of each request.

    Args:
        block_size: tokens per block (>= 1).
        num_blocks: physical blocks in the pool (>= 1).
        enable_caching: automatic prefix caching. The engine passes
            ``CacheConfig.enable_prefix_caching`` (on by default there); off here so that
            block-table tests see plain allocation unless they ask for caching.
        num_cpu_blocks: [swap preemption] host blocks (0: none).
        enable_kv_cache_events: record KV-cache events in the pool (``take_events``).
    Raises:
        ValueError: for a non-positive ``block_size`` or ``num_blocks``.

    Attributes:
        block_tables: request id -> physical block ids, logical order.
        num_cached_block: request id -> how many of its leading blocks are registered in the
            prefix cache (or were found there); blocks past that index may still be written.
        prefix_cache_stats: running totals of lookups and hits (tokens).
        swap_space: [swap preemption] the host pool and the swapped-out tables (``SwapSpace``),
            or None without host blocks.
    """

    def __init__(self, block_size: int, num_blocks: int, enable_caching: bool = False,
                 num_cpu_blocks: int = 0, enable_kv_cache_events: bool = False) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        if not isinstance(num_cpu_blocks, int) or num_cpu_blocks < 0:
            raise ValueError(f"num_cpu_blocks must be an int >= 0, got {num_cpu_blocks!r}")
        self.block_size = block_size
        self.enable_caching = bool(enable_caching)
        self.block_pool = BlockPool(num_blocks, enable_kv_cache_events=enable_kv_cache_events)
        self.block_tables: dict[str, list[int]] = {}
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_stats = PrefixCacheStats()
        # Swap preemption: host blocks and the tables of swapped-out requests (flat tables of
        # num_kv_cache_groups entries per logical block; null entries stay null on the host).
        self.swap_space = SwapSpace(num_cpu_blocks, self.block_pool, self.num_kv_cache_groups,
                                    self.null_block_id) if num_cpu_blocks else None

    #: Block tables per request (the hybrid manager has one per KV cache group, interleaved).
    num_kv_cache_groups = 1

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

    def group_usage(self) -> list[float]:
        """Per KV cache group, the fraction of the pool its tables hold (one group here: ``usage``)."""
        return [self.usage]

    # -- allocation ------------------------------------------------------------------------

    #: the placeholder id of a table entry with no block behind it (the hybrid manager's); none here.
    null_block_id: int | None = None

    def _max_blocks_for(self, num_tokens: int, chunk_tokens: int) -> int:
        """Blocks one table holds at most for ``num_tokens`` tokens (one group: every block)."""
        return cdiv(num_tokens, self.block_size)

    def can_admit(self, request: Request, computed: ComputedBlocks, chunk_tokens: int) -> bool:
        """Whether the pool can hold all of a waiting request's tokens (its prompt, and its
        outputs after a preemption), counting its prefix-cache hit ``computed`` (vLLM V0's
        ``can_allocate``): admitting on the first prefill chunk alone would let later chunks
        preempt the requests admitted beside it.

        Args:
            chunk_tokens: the largest prefill chunk (``max_num_batched_tokens``); a sliding
                window group holds its window plus one chunk.
        """
        real_hits = [b for b in computed.block_ids if b != self.null_block_id]
        free_hits = sum(1 for b in real_hits if self.block_pool.ref_cnt(b) == 0)
        need = self._max_blocks_for(request.num_tokens, chunk_tokens) - len(real_hits) + free_hits
        return need <= self.block_pool.get_num_free_blocks()

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: ComputedBlocks | None = None) -> list[int] | None:
        """Make the request's table cover the tokens it computes in the coming step.

        Token ranges (vLLM V1's ``allocate_slots`` picture)::

            | num_computed_tokens | new_computed_blocks' tokens | <- num_new_tokens -> |
            | computed (K/V cached, in the table) | prefix-cache hit | scheduled this step |
            |<---- already in the table ---->|<- hit blocks ->|<- newly allocated blocks ->|

        Only ``cdiv(num_computed_tokens + hit tokens + num_new_tokens, block_size) - len(table)
        - len(hit blocks)`` blocks are taken (0 when the last block still has room). The hit
        blocks get one more reference each (free ones leave the free queue), and the lookup is
        counted in ``prefix_cache_stats``. Call it before ``num_computed_tokens`` advances for
        the step; the caller then sets ``num_computed_tokens`` to include the hit tokens.

        Args:
            request: the request; ``request.num_computed_tokens`` tokens are already cached.
            num_new_tokens: tokens to be computed this step (>= 0).
            new_computed_blocks: the ``get_computed_blocks`` result, for a request being
                admitted (no table yet); ``None`` for a running request.
        Returns:
            The newly allocated physical block ids (possibly empty; hit blocks not included),
            or ``None`` when the pool lacks free blocks; nothing changes then (the caller
            preempts or waits).
        Raises:
            ValueError: if ``num_new_tokens < 0``, or hit blocks are passed for a request that
                already has a table.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        rid = request.request_id
        table = self.block_tables.get(rid)
        have = 0 if table is None else len(table)
        hits = list(new_computed_blocks.block_ids) if new_computed_blocks is not None else []
        if hits and have:
            raise ValueError(f"request {rid!r} already has {have} blocks; prefix-cache hits are only "
                             "taken at admission")
        pool = self.block_pool
        num_tokens = request.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        need = max(cdiv(num_tokens, self.block_size) - have - len(hits), 0)
        # Hit blocks sitting in the free queue leave it when touched: they are not free for `need`.
        free_hits = sum(1 for b in hits if pool.ref_cnt(b) == 0)
        if need > pool.get_num_free_blocks() - free_hits:
            return None
        pool.touch(hits)
        new_ids = pool.get_new_blocks(need)
        if table is None:
            table = self.block_tables[rid] = []
        table.extend(hits)
        table.extend(new_ids)
        if new_computed_blocks is not None:
            self.num_cached_block[rid] = len(hits)
            self._record_lookup(new_computed_blocks)
        return new_ids

    def _record_lookup(self, computed: ComputedBlocks) -> None:
        """Count an admitted request's prefix-cache lookup in ``prefix_cache_stats`` (tokens)."""
        if computed.num_query_tokens:
            stats = self.prefix_cache_stats
            stats.num_requests += 1
            stats.queries += computed.num_query_tokens
            stats.hits += computed.num_computed_tokens

    # -- prefix caching --------------------------------------------------------------------

    def _update_block_hashes(self, request: Request) -> None:
        """Extend ``request.block_hashes`` to every full block of its known tokens."""
        hashes, bs = request.block_hashes, self.block_size
        tokens = request.all_token_ids
        while (len(hashes) + 1) * bs <= len(tokens):
            i = len(hashes)
            hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tokens[i * bs:(i + 1) * bs],
                                            request.block_hash_extra_keys))

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """Longest run of registered full blocks matching the request from its first token.

        At most ``(num_tokens - 1) // block_size`` blocks are taken, so at least the last token
        is computed (its logits are needed): a fully cached prompt recomputes its last block, as
        vLLM does. Nothing changes in the pool (``allocate_slots`` takes the references).

        Returns:
            The hit (possibly empty). Empty with ``num_query_tokens == 0`` when caching is off
            or the request asks for prompt logprobs (they need every prompt position).
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return ComputedBlocks()
        self._update_block_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        block_ids: list[int] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self.block_pool.get_cached_block(block_hash)
            if block_id is None:
                break
            block_ids.append(block_id)
        return ComputedBlocks(block_ids, len(block_ids) * self.block_size, request.num_tokens)

    def cache_blocks(self, request: Request, num_computed_tokens: int | None = None) -> None:
        """Register the request's newly full, written blocks in the prefix cache.

        Call after the step that computed them has written their K/V (the scheduler does so in
        ``update_from_output``): blocks ``num_cached_block[rid] .. num_computed_tokens //
        block_size - 1`` are registered. A no-op with caching off or without a table.

        Args:
            num_computed_tokens: tokens whose K/V is written; default
                ``request.num_computed_tokens``.
        """
        if not self.enable_caching:
            return
        rid = request.request_id
        table = self.block_tables.get(rid)
        if not table:
            return
        n = request.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        num_full = min(n // self.block_size, len(table))
        start = self.num_cached_block.get(rid, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request)
        hashes, bs = request.block_hashes, self.block_size
        self.block_pool.cache_full_blocks(table[start:num_full], hashes[start:num_full],
                                          hashes[start - 1] if start else None,
                                          request.all_token_ids[start * bs:num_full * bs], bs,
                                          request.lora_request, request.block_hash_extra_keys)
        self.num_cached_block[rid] = num_full

    def take_events(self) -> list:
        """The pool's KV-cache events since the last call (``BlockPool.take_events``)."""
        return self.block_pool.take_events()

    def reset_prefix_cache(self) -> bool:
        """Forget every registered block (vLLM's ``reset_prefix_cache``).

        Returns:
            True when cleared; False (nothing changed) while any block is in use.
        """
        return self.block_pool.reset_prefix_cache()

    def free(self, request: Request) -> None:
        """Drop the request's table and one reference to each of its blocks.

        Blocks go back in reverse logical order (see ``BlockPool.free_blocks``). A request
        without a table is a no-op.
        """
        table = self._pop_table(request.request_id)
        if table:
            self._free_device_blocks(table)
        if self.swap_space is not None:
            self.swap_space.free(request.request_id)

    def _pop_table(self, request_id: str) -> list[int] | None:
        """Remove the request's device table and its bookkeeping; return the table (None if none)."""
        self.num_cached_block.pop(request_id, None)
        return self.block_tables.pop(request_id, None)

    def _set_table(self, request_id: str, table: list[int]) -> None:
        """Give a request (swapped in) the device table ``table``, nothing of it registered yet."""
        self.block_tables[request_id] = table
        self.num_cached_block[request_id] = 0

    def _free_device_blocks(self, block_ids: list[int]) -> None:
        """One reference less to each block (null entries skipped), in reverse order; copy
        records to freed ones go."""
        real = [b for b in block_ids if b != self.null_block_id]
        self.block_pool.free_blocks(reversed(real))
        if self.swap_space is not None:
            self.swap_space.forget_freed(device_ids=real)

    def trim(self, request: Request) -> int:
        """[speculative decoding] Give back the blocks past ``cdiv(num_computed_tokens,
        block_size)``: after a verification step rolled ``num_computed_tokens`` back over rejected
        draft tokens, blocks that held only those are freed (they are this request's alone and
        not in the prefix cache: allocated for this step, past every full block).

        Returns:
            The new table length (blocks); unchanged when nothing was past it.
        Raises:
            RuntimeError: if a block to free is shared or registered (a bookkeeping bug).
        """
        table = self.block_tables.get(request.request_id)
        if not table:
            return 0
        keep = cdiv(request.num_computed_tokens, self.block_size)
        extra = table[keep:]
        if extra:
            for block_id in extra:
                block = self.block_pool.blocks[block_id]
                if block.ref_cnt != 1 or block.block_hash is not None:
                    raise RuntimeError(f"request {request.request_id!r}: block {block_id} past its computed "
                                       f"tokens is shared (ref_cnt {block.ref_cnt}) or cached")
            del table[keep:]
            self._free_device_blocks(extra)
        return len(table)

    # -- swap preemption ---------------------------------------------------------------------

    @property
    def num_cpu_blocks(self) -> int:
        """Host blocks for swap preemption (0 without a host pool)."""
        return 0 if self.swap_space is None else self.swap_space.num_cpu_blocks

    @property
    def cpu_block_pool(self) -> BlockPool | None:
        """The host pool (``swap_space.cpu_block_pool``), or None without host blocks."""
        return None if self.swap_space is None else self.swap_space.cpu_block_pool

    @property
    def cpu_block_tables(self) -> Mapping[str, list[int]]:
        """Request id -> host block ids of the swapped-out requests (empty without host blocks)."""
        return {} if self.swap_space is None else self.swap_space.cpu_block_tables

    def is_swapped(self, request: Request) -> bool:
        """True while the request's blocks are in the host pool."""
        return self.swap_space is not None and self.swap_space.is_swapped(request.request_id)

    def can_swap_out(self, request: Request) -> bool:
        """True when the host pool has room for the request's blocks (shared full blocks already
        copied there count once)."""
        table = self.block_tables.get(request.request_id)
        if self.swap_space is None or not table:
            return False
        return self.swap_space.can_swap_out(table, request.num_computed_tokens // self.block_size)

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """Move the request's blocks to the host pool and free its device blocks.

        ``request.num_computed_tokens`` is kept (its K/V stays valid on the host).

        Returns:
            (device block, host block) pairs to copy before the next forward.
        Raises:
            NoFreeBlocksError (a ValueError): if ``can_swap_out`` is False; nothing changes then.
        """
        if not self.can_swap_out(request):
            raise NoFreeBlocksError(f"the host pool cannot take request {request.request_id!r}")
        rid = request.request_id
        table = self._pop_table(rid)
        return self.swap_space.swap_out(rid, table, request.num_computed_tokens // self.block_size)

    def _cached_block_at(self, request: Request, k: int) -> int | None:
        """[swap-in, prefix caching] A registered device block holding table entry ``k`` of the
        request (logical block ``k`` here), or None."""
        hashes = request.block_hashes
        return self.block_pool.get_cached_block(hashes[k]) if self.enable_caching and k < len(hashes) else None

    def swap_in(self, request: Request, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Move a swapped-out request back into device blocks and allocate its next tokens' slots.

        A full block still on the device (held by a sharer, or registered in the prefix cache
        under its hash) is taken instead of copied. The full blocks it gets are registered in the
        prefix cache again (their K/V arrives before the next forward).

        Returns:
            (host block, device block) pairs to copy before the next forward, or ``None`` when
            the device pool lacks blocks (nothing changes then).
        """
        rid, G = request.request_id, self.num_kv_cache_groups
        if self.enable_caching:
            self._update_block_hashes(request)
        # Blocks past the computed tokens are inside every window: one per group.
        num_extra = G * max(cdiv(request.num_computed_tokens + num_new_tokens, self.block_size)
                            - len(self.swap_space.cpu_block_tables[rid]) // G, 0)
        moved = self.swap_space.swap_in(rid, request.num_computed_tokens // self.block_size, num_extra,
                                        lambda k: self._cached_block_at(request, k))
        if moved is None:
            return None
        table, pairs = moved
        self._set_table(rid, table)
        self.cache_blocks(request)
        if self.allocate_slots(request, num_new_tokens) is None:
            raise RuntimeError(f"request {rid!r}: {num_extra} free blocks past its swapped table were "
                               "counted but allocation failed")
        return pairs

    def num_stored_tokens(self, requests: Mapping[str, Request]) -> int:
        """Tokens whose K/V the used blocks hold, each shared block counted once.

        A request's first ``num_computed_tokens // block_size`` blocks are full; its last one
        holds the remainder. Tables of requests missing from ``requests`` are skipped.
        """
        full: set[int] = set()
        partial: dict[int, int] = {}
        bs = self.block_size
        for rid, table in self.block_tables.items():
            request = requests.get(rid)
            if request is None:
                continue
            n_full, rest = divmod(request.num_computed_tokens, bs)
            full.update(table[:n_full])
            if rest and n_full < len(table):
                block_id = table[n_full]
                partial[block_id] = max(partial.get(block_id, 0), rest)
        return bs * len(full) + sum(n for b, n in partial.items() if b not in full)

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
        self.num_cached_block[child.request_id] = self.num_cached_block.get(parent.request_id, 0)

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

    def cow_last_blocks_if_shared(self, request: Request) -> list[tuple[int, int]]:
        """``cow_last_block_if_shared`` as a list of (src, dst) pairs to copy (one per KV cache
        group whose block written next is shared; empty when none is)."""
        pair = self.cow_last_block_if_shared(request)
        return [] if pair is None else [pair]

    # -- invariants ------------------------------------------------------------------------

    def _holders(self) -> Counter[int]:
        """How many table entries hold each block (what its ref_cnt must be)."""
        holders: Counter[int] = Counter()
        for table in self.block_tables.values():
            holders.update(table)
        return holders

    def check_integrity(self, requests: Mapping[str, Request] | None = None) -> None:
        """Check the pool against the tables and the prefix cache, and the host pool against the
        swapped-out tables (``SwapSpace.check``): the one integrity check (tests call it after
        steps; subclasses refine its parts, ``_holders`` and ``_check_prefix_cache``).

        Args:
            requests: the live requests by id, if known (the scheduler's); enables the checks
                against each request's ``num_computed_tokens`` and ``block_hashes``.
        Raises:
            RuntimeError: with the counts, if free + used != total, a block's ref_cnt differs
                from the number of tables holding it, a referenced block is in the free queue,
                an unreferenced block is missing from it (or a free block has ref_cnt != 0), a
                cached hash does not map to exactly one block storing that hash, or a block is
                registered at a table position the request may still write (past its
                ``num_cached_block``, or past its computed tokens); with ``requests``, also if a
                table is not exactly ``cdiv(num_computed_tokens, block_size)`` blocks long; and as
                ``SwapSpace.check``.
        """
        pool = self.block_pool
        holders = self._holders()
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
        for block_id in free_ids:
            if pool.blocks[block_id].ref_cnt != 0:
                raise RuntimeError(f"free block {block_id} has ref_cnt {pool.blocks[block_id].ref_cnt}")
        if self.swap_space is not None:
            self.swap_space.check(self.block_tables, self.block_size, requests)
        self._check_cached_hashes()
        self._check_prefix_cache(requests)

    def _check_cached_hashes(self) -> None:
        """The pool's hash -> block map against the hashes the blocks store."""
        pool = self.block_pool
        for block_hash, block in pool.cached_block_hash_to_block.items():
            if block.block_hash != block_hash:
                raise RuntimeError(f"cached hash {block_hash[:4].hex()} maps to block {block.block_id}, "
                                   f"which stores another hash")
        hashed = [b for b in pool.blocks if b.block_hash is not None]
        if len(hashed) != len(pool.cached_block_hash_to_block):
            raise RuntimeError(f"{len(hashed)} blocks store a hash but the cache maps "
                               f"{len(pool.cached_block_hash_to_block)} hashes")
        if hashed and not self.enable_caching:
            raise RuntimeError(f"{len(hashed)} blocks are registered with prefix caching off")

    def _check_prefix_cache(self, requests: Mapping[str, Request] | None) -> None:
        """Per table: registered blocks only where no owner writes, under the request's hashes."""
        pool, bs = self.block_pool, self.block_size
        if set(self.num_cached_block) - set(self.block_tables):
            raise RuntimeError("num_cached_block lists requests without a table")
        for rid, table in self.block_tables.items():
            num_cached = self.num_cached_block.get(rid, 0)
            if num_cached > len(table):
                raise RuntimeError(f"request {rid!r}: {num_cached} cached blocks but a table of {len(table)}")
            request = None if requests is None else requests.get(rid)
            # A block shared through a fork may be registered by another owner first; fine while
            # it is full for this request (no owner writes a full block).
            num_full = 0 if request is None else request.num_computed_tokens // bs
            for i, block_id in enumerate(table):
                shared_ok = i < num_full if request is not None else pool.blocks[block_id].ref_cnt > 1
                if i >= num_cached and pool.blocks[block_id].block_hash is not None and not shared_ok:
                    raise RuntimeError(
                        f"request {rid!r} may still write block {block_id} (logical {i}, "
                        f"{num_cached} cached) but it is registered in the prefix cache")
            if request is None:
                continue
            if len(table) != cdiv(request.num_computed_tokens, bs):
                raise RuntimeError(f"request {rid!r}: a table of {len(table)} blocks for "
                                   f"{request.num_computed_tokens} computed tokens")
            if num_cached * bs > request.num_computed_tokens:
                raise RuntimeError(f"request {rid!r}: {num_cached} blocks registered but only "
                                   f"{request.num_computed_tokens} tokens computed")
            for i in range(min(num_cached, len(request.block_hashes))):
                stored = pool.blocks[table[i]].block_hash
                if stored is not None and stored != request.block_hashes[i]:
                    raise RuntimeError(f"request {rid!r}: block {table[i]} (logical {i}) is registered "
                                       f"under a hash that is not the request's")
