"""Block tables per KV cache group: sliding-window groups keep only their window (vLLM V1's hybrid manager).

Each request has one block table per group (``kv_cache_spec.KVCacheGroups``), all from one
``BlockPool``; they are stored interleaved in ``block_tables[rid]`` (logical block ``i`` of group
``g`` at ``i * G + g``), so every group's table has the same length, ``cdiv(num_computed_tokens,
block_size)`` blocks. A full group behaves as ``KVCacheManager``'s single table. A sliding group
of window ``w`` replaces each block whose tokens all lie before ``num_computed_tokens - w + 1``
(no future query reads them) by ``NULL_BLOCK_ID`` and frees it; with prefix caching it goes
back to the free queue still hashed, so a later request may take it as a hit. On admission it
never allocates such blocks (a prefix-cache hit gives it only the window's blocks).

Prefix caching: each group registers its full blocks under the chained hash of the tokens plus
the group index (different groups' blocks for the same tokens are different pages). A hit of
``n`` blocks needs every full group's first ``n`` blocks and every sliding group's last
``cdiv(w - 1, block_size)`` blocks before block ``n`` (vLLM's hybrid lookup); the lookup takes
the longest ``n`` for which both hold.

Swap preemption: with host blocks the manager owns a ``SwapSpace`` over the flat tables. A
swap-out first frees the sliding groups' blocks out of the window (``remove_skipped_blocks``), so
only the window goes to the host: null entries stay null in the host table (the host pool
reserves its block 0 as the null block), take no host block and are not copied; a full block
shared by several requests is copied once each way. Swap-in gives the real entries device
blocks (or shares / takes from the prefix cache the full ones still on the device) and restores
the per-group null counts from the table.

Not supported here (``kv_cache_spec`` callers fall back to ``KVCacheManager``): draft models on
a model without a full-attention group (a draft's pool is indexed by the full group's table).
"""

from __future__ import annotations

from collections import Counter
from typing import Mapping

from pagedllm.core.block_pool import NoFreeBlocksError
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_cache_spec import NULL_BLOCK_ID, KVCacheGroups, cdiv
from pagedllm.core.kv_cache_utils import BlockHash, ComputedBlocks, group_block_hash
from pagedllm.core.request import Request


def _num_leading_nulls(ids: list[int]) -> int:
    """Null entries at the start of one group's table (its blocks before the window)."""
    n = 0
    while n < len(ids) and ids[n] == NULL_BLOCK_ID:
        n += 1
    return n


class HybridKVCacheManager(KVCacheManager):
    """Per-group block tables over one pool; sliding groups free what falls out of the window.

    Args:
        block_size: tokens per block (>= 1).
        num_blocks: pages in the pool (>= 2: block 0 is the null block, never allocated).
        groups: the layer groups (``make_kv_cache_groups``).
        enable_caching: automatic prefix caching.
        num_cpu_blocks: [swap preemption] host blocks (0: no host pool; else >= 2, block 0 is
            the host null block).
        enable_kv_cache_events: record KV-cache events; each ``BlockStored`` / ``BlockRemoved``
            carries its group's index in ``group_idx`` and the plain chained hash (the same
            hashes in every group).
    Raises:
        ValueError: for a non-positive ``block_size``, fewer than 2 blocks, or a negative
            ``num_cpu_blocks``.

    Attributes:
        block_tables: request id -> flat interleaved per-group physical ids (see the module doc).
        num_cached_block: request id -> logical blocks registered in the prefix cache (per group).
    """

    def __init__(self, block_size: int, num_blocks: int, groups: KVCacheGroups,
                 enable_caching: bool = False, num_cpu_blocks: int = 0,
                 enable_kv_cache_events: bool = False) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 2:
            raise ValueError(f"num_blocks must be an int >= 2 (block 0 is the null block), got {num_blocks!r}")
        self.groups = groups
        self.windows = groups.sliding_windows
        self.num_kv_cache_groups = groups.num_groups   # before the base makes the swap space
        super().__init__(block_size, num_blocks, enable_caching=enable_caching, num_cpu_blocks=num_cpu_blocks,
                         enable_kv_cache_events=enable_kv_cache_events)
        (null,) = self.block_pool.get_new_blocks(1)
        if null != NULL_BLOCK_ID:
            raise RuntimeError(f"the pool's first block is {null}, expected the null block {NULL_BLOCK_ID}")
        # Per request and group: its leading logical blocks already replaced by the null block.
        self._num_skipped: dict[str, list[int]] = {}

    # -- sizes -----------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        """Usable blocks (the null block excluded)."""
        return self.block_pool.num_blocks - 1

    @property
    def usage(self) -> float:
        """Fraction of usable blocks in use, in [0, 1]."""
        return 1.0 - self.block_pool.get_num_free_blocks() / self.num_blocks

    def group_usage(self) -> list[float]:
        """Per group, the fraction of usable blocks its tables hold (a shared block counted once)."""
        G = self.num_kv_cache_groups
        held = [set() for _ in range(G)]
        for table in self.block_tables.values():
            for k, b in enumerate(table):
                if b != NULL_BLOCK_ID:
                    held[k % G].add(b)
        return [len(h) / self.num_blocks for h in held]

    def _skip_before(self, group: int, num_computed_tokens: int) -> int:
        """Logical blocks of ``group`` no query from ``num_computed_tokens`` on reads (0 for a full group)."""
        w = self.windows[group]
        if w is None:
            return 0
        return max(num_computed_tokens - w + 1, 0) // self.block_size

    def remove_skipped_blocks(self, request: Request) -> None:
        """Null and free the sliding groups' blocks that fell out of the window of the request's
        next query (at ``num_computed_tokens``)."""
        table = self.block_tables.get(request.request_id)
        if not table:
            return
        G = self.num_kv_cache_groups
        skipped = self._num_skipped[request.request_id]
        freed = []
        for g in range(G):
            upto = min(self._skip_before(g, request.num_computed_tokens), len(table) // G)
            for i in range(skipped[g], upto):
                b = table[i * G + g]
                if b != NULL_BLOCK_ID:
                    freed.append(b)
                    table[i * G + g] = NULL_BLOCK_ID
            skipped[g] = max(skipped[g], upto)
        if freed:
            self._free_device_blocks(freed)

    # -- allocation ------------------------------------------------------------------------

    null_block_id = NULL_BLOCK_ID

    def _max_blocks_for(self, num_tokens: int, chunk_tokens: int) -> int:
        """Summed over the groups; a sliding group holds its window plus one chunk."""
        return self.groups.max_blocks_per_request(num_tokens, self.block_size, chunk_tokens)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: ComputedBlocks | None = None) -> list[int] | None:
        """``KVCacheManager.allocate_slots`` per group: first the sliding groups' blocks out of
        the window are freed (``remove_skipped_blocks``; kept freed even when the allocation then
        fails), then each group gets the step's new logical blocks, a sliding group the null
        block for those before its window.

        ``new_computed_blocks.block_ids`` is flat and interleaved like the tables.

        Returns:
            The newly allocated physical ids (all groups), or ``None`` when the pool lacks
            free blocks (no table changes then).
        Raises:
            ValueError: as ``KVCacheManager.allocate_slots``.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        rid, G, bs, pool = request.request_id, self.num_kv_cache_groups, self.block_size, self.block_pool
        table = self.block_tables.get(rid)
        hits = list(new_computed_blocks.block_ids) if new_computed_blocks is not None else []
        if hits and table:
            raise ValueError(f"request {rid!r} already has {len(table) // G} blocks; prefix-cache hits are only "
                             "taken at admission")
        self.remove_skipped_blocks(request)
        have = 0 if table is None else len(table) // G
        num_hit = len(hits) // G
        num_computed = request.num_computed_tokens + num_hit * bs
        n_total = max(cdiv(num_computed + num_new_tokens, bs), have + num_hit)
        new_entries = []   # (group, is_real) for logical blocks have + num_hit .. n_total - 1
        for i in range(have + num_hit, n_total):
            for g in range(G):
                new_entries.append(i >= self._skip_before(g, num_computed))
        need = sum(new_entries)
        real_hits = [b for b in hits if b != NULL_BLOCK_ID]
        free_hits = sum(1 for b in real_hits if pool.ref_cnt(b) == 0)
        if need > pool.get_num_free_blocks() - free_hits:
            return None
        pool.touch(real_hits)
        new_ids = pool.get_new_blocks(need)
        if table is None:
            table = self.block_tables[rid] = []
            self._num_skipped[rid] = [0] * G
        table.extend(hits)
        it = iter(new_ids)
        table.extend(next(it) if real else NULL_BLOCK_ID for real in new_entries)
        if hits:
            skipped = self._num_skipped[rid]
            for g in range(G):
                while skipped[g] < num_hit and hits[skipped[g] * G + g] == NULL_BLOCK_ID:
                    skipped[g] += 1
        if new_computed_blocks is not None:
            self.num_cached_block[rid] = num_hit
            self._record_lookup(new_computed_blocks)
        return new_ids

    # -- prefix caching --------------------------------------------------------------------

    def _window_hit(self, hashes: list[BlockHash], num_blocks: int, group: int) -> bool:
        """True when ``group``'s blocks that a query at ``num_blocks * block_size`` reads are cached."""
        k = self.groups.groups[group].num_window_blocks(self.block_size)
        pool = self.block_pool
        return all(pool.get_cached_block(group_block_hash(hashes[i], group)) is not None
                   for i in range(max(num_blocks - k, 0), num_blocks))

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """The longest hit of ``n`` blocks: every full group's first ``n`` blocks and every
        sliding group's window before block ``n`` are registered (at most ``(num_tokens - 1) //
        block_size`` blocks, as ``KVCacheManager.get_computed_blocks``).

        Returns:
            The hit; ``block_ids`` flat and interleaved, null for a sliding group's blocks
            before its window.
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return ComputedBlocks()
        self._update_block_hashes(request)
        G, pool = self.num_kv_cache_groups, self.block_pool
        hashes = request.block_hashes
        n = min((request.num_tokens - 1) // self.block_size, len(hashes))
        for g in range(G):
            if self.windows[g] is None:
                run = 0
                while run < n and pool.get_cached_block(group_block_hash(hashes[run], g)) is not None:
                    run += 1
                n = run
        sliding = [g for g in range(G) if self.windows[g] is not None]
        while n > 0 and not all(self._window_hit(hashes, n, g) for g in sliding):
            n -= 1
        block_ids = []
        for i in range(n):
            for g in range(G):
                if i < self._skip_before(g, n * self.block_size):
                    block_ids.append(NULL_BLOCK_ID)
                else:
                    block_ids.append(pool.get_cached_block(group_block_hash(hashes[i], g)))
        return ComputedBlocks(block_ids, n * self.block_size, request.num_tokens)

    def cache_blocks(self, request: Request, num_computed_tokens: int | None = None) -> None:
        """Register each group's newly full, written blocks (null entries skipped)."""
        if not self.enable_caching:
            return
        rid, G = request.request_id, self.num_kv_cache_groups
        table = self.block_tables.get(rid)
        if not table:
            return
        n = request.num_computed_tokens if num_computed_tokens is None else num_computed_tokens
        num_full = min(n // self.block_size, len(table) // G)
        start = self.num_cached_block.get(rid, 0)
        if num_full <= start:
            return
        self._update_block_hashes(request)
        hashes, bs = request.block_hashes, self.block_size
        for g in range(G):
            # Each run of real (non-null) blocks is registered together: one BlockStored per run.
            i = start
            while i < num_full:
                if table[i * G + g] == NULL_BLOCK_ID:
                    i += 1
                    continue
                j = i
                while j < num_full and table[j * G + g] != NULL_BLOCK_ID:
                    j += 1
                self.block_pool.cache_full_blocks(
                    [table[k * G + g] for k in range(i, j)], [group_block_hash(hashes[k], g) for k in range(i, j)],
                    group_block_hash(hashes[i - 1], g) if i else None, request.all_token_ids[i * bs:j * bs], bs,
                    request.lora_request, request.block_hash_extra_keys)
                i = j
        self.num_cached_block[rid] = num_full

    def reset_prefix_cache(self) -> bool:
        """Forget every registered block; False (nothing changed) while any block is in use."""
        pool = self.block_pool
        if pool.get_num_free_blocks() != self.num_blocks:
            return False
        pool.clear_cached_blocks()
        return True

    def _pop_table(self, request_id: str) -> list[int] | None:
        """Remove the request's tables and bookkeeping (null counts too); return the flat table."""
        self._num_skipped.pop(request_id, None)
        return super()._pop_table(request_id)

    def _set_table(self, request_id: str, table: list[int]) -> None:
        """Give a request (swapped in) the flat table ``table``; each group's null count is its
        leading null entries."""
        super()._set_table(request_id, table)
        G = self.num_kv_cache_groups
        self._num_skipped[request_id] = [_num_leading_nulls(table[g::G]) for g in range(G)]

    def trim(self, request: Request) -> int:
        """[speculative decoding] Every group's blocks past ``cdiv(num_computed_tokens, block_size)``
        are freed (see ``KVCacheManager.trim``).

        Returns:
            The new flat table length (G entries per logical block).
        Raises:
            RuntimeError: if a block to free is shared or registered.
        """
        table = self.block_tables.get(request.request_id)
        if not table:
            return 0
        keep = cdiv(request.num_computed_tokens, self.block_size) * self.num_kv_cache_groups
        extra = [b for b in table[keep:] if b != NULL_BLOCK_ID]
        for block_id in extra:
            block = self.block_pool.blocks[block_id]
            if block.ref_cnt != 1 or block.block_hash is not None:
                raise RuntimeError(f"request {request.request_id!r}: block {block_id} past its computed "
                                   f"tokens is shared (ref_cnt {block.ref_cnt}) or cached")
        del table[keep:]
        self._free_device_blocks(extra)
        return len(table)

    def num_stored_tokens(self, requests: Mapping[str, Request]) -> int:
        """Token slots holding K/V in used blocks, each shared block counted once (all groups)."""
        G, bs = self.num_kv_cache_groups, self.block_size
        full: set[int] = set()
        partial: dict[int, int] = {}
        for rid, table in self.block_tables.items():
            request = requests.get(rid)
            if request is None:
                continue
            n_full, rest = divmod(request.num_computed_tokens, bs)
            for k, b in enumerate(table):
                if b == NULL_BLOCK_ID:
                    continue
                if k // G < n_full:
                    full.add(b)
                elif k // G == n_full and rest:
                    partial[b] = max(partial.get(b, 0), rest)
        return bs * len(full) + sum(n for b, n in partial.items() if b not in full)

    # -- swap preemption ---------------------------------------------------------------------

    def can_swap_out(self, request: Request) -> bool:
        """``KVCacheManager.can_swap_out`` for the window only: first the sliding groups' blocks
        out of the window are freed (``remove_skipped_blocks``, as ``allocate_slots`` does; kept
        freed whatever the answer), so they need no host block."""
        self.remove_skipped_blocks(request)
        return super().can_swap_out(request)

    def swap_out(self, request: Request) -> list[tuple[int, int]]:
        """``KVCacheManager.swap_out`` of every group's table: the sliding groups' blocks out of
        the window are freed first; null entries stay null in the host table (no host block,
        no copy); a full block already copied to the host by a sharer is not copied again.

        Returns:
            (device block, host block) pairs to copy before the next forward (each pair is one
            page: the worker copies it in every layer's tensor).
        Raises:
            NoFreeBlocksError (a ValueError): if ``can_swap_out`` is False; only the
                out-of-window blocks were freed then.
        """
        self.remove_skipped_blocks(request)
        return super().swap_out(request)

    def _cached_block_at(self, request: Request, k: int) -> int | None:
        """[swap-in, prefix caching] The registered device block of flat entry ``k`` (logical
        block ``k // G`` of group ``k % G``), or None."""
        i, g = divmod(k, self.num_kv_cache_groups)
        hashes = request.block_hashes
        if not self.enable_caching or i >= len(hashes):
            return None
        return self.block_pool.get_cached_block(group_block_hash(hashes[i], g))

    # -- sharing ---------------------------------------------------------------------------

    def fork(self, parent: Request, child: Request) -> None:
        """Give ``child`` the parent's tables (one more reference per non-null block)."""
        if child.request_id in self.block_tables:
            raise ValueError(f"child request {child.request_id!r} already has a block table")
        parent_table = self.block_tables.get(parent.request_id)
        if not parent_table:
            raise ValueError(f"parent request {parent.request_id!r} has no blocks to share")
        self.block_pool.incr_ref([b for b in parent_table if b != NULL_BLOCK_ID])
        self.block_tables[child.request_id] = list(parent_table)
        self.num_cached_block[child.request_id] = self.num_cached_block.get(parent.request_id, 0)
        self._num_skipped[child.request_id] = list(self._num_skipped[parent.request_id])

    def cow_last_block_if_shared(self, request: Request) -> tuple[int, int] | None:
        """Not meaningful with several groups: use ``cow_last_blocks_if_shared``."""
        raise NotImplementedError("the hybrid manager copies one block per group: cow_last_blocks_if_shared")

    def cow_last_blocks_if_shared(self, request: Request) -> list[tuple[int, int]]:
        """Copy-on-write, per group, the block the request writes next when another table shares it.

        Returns:
            (src, dst) pairs to copy before the step writes (one per shared group's last block).
        Raises:
            NoFreeBlocksError: if the copies need more blocks than are free; nothing changes then.
        """
        table = self.block_tables.get(request.request_id)
        G = self.num_kv_cache_groups
        if not table or request.num_computed_tokens >= len(table) // G * self.block_size:
            return []
        last = len(table) - G
        shared = [k for k in range(last, len(table))
                  if table[k] != NULL_BLOCK_ID and self.block_pool.ref_cnt(table[k]) > 1]
        if len(shared) > self.block_pool.get_num_free_blocks():
            raise NoFreeBlocksError(f"copy-on-write needs {len(shared)} blocks, "
                                    f"{self.block_pool.get_num_free_blocks()} are free")
        pairs = []
        for k in shared:
            src = table[k]
            (dst,) = self.block_pool.get_new_blocks(1)
            self.block_pool.free_blocks([src])
            table[k] = dst
            pairs.append((src, dst))
        return pairs

    # -- invariants ------------------------------------------------------------------------

    def _holders(self) -> Counter[int]:
        holders: Counter[int] = Counter(b for t in self.block_tables.values() for b in t if b != NULL_BLOCK_ID)
        holders[NULL_BLOCK_ID] = 1   # the manager's own reference
        return holders

    def check_integrity(self, requests: Mapping[str, Request] | None = None) -> None:
        """``KVCacheManager.check_integrity`` (device pool, per-group tables, host pool), and per
        group the swapped-out host tables (``_check_swapped``).

        Raises:
            RuntimeError: as ``KVCacheManager.check_integrity`` and ``_check_swapped``.
        """
        super().check_integrity(requests)
        self._check_swapped(requests)

    def _check_swapped(self, requests: Mapping[str, Request] | None) -> None:
        """Per swapped-out request and group: the host table is whole logical blocks, null
        entries are only leading ones and only in sliding groups, and (with ``requests``) they
        are exactly the blocks out of the window of the request's next query (swap-out keeps
        the window, nothing before it).

        Raises:
            RuntimeError: naming the request, the group and the counts.
        """
        G = self.num_kv_cache_groups
        for rid, table in self.cpu_block_tables.items():
            if len(table) % G:
                raise RuntimeError(f"swapped request {rid!r}: a host table of {len(table)} entries for {G} groups")
            request = None if requests is None else requests.get(rid)
            for g in range(G):
                ids = table[g::G]
                nulls = _num_leading_nulls(ids)
                if NULL_BLOCK_ID in ids[nulls:]:
                    raise RuntimeError(f"swapped request {rid!r}, group {g}: a null entry after "
                                       f"{nulls} leading ones in {len(ids)}")
                if self.windows[g] is None and nulls:
                    raise RuntimeError(f"swapped request {rid!r}: full-attention group {g} holds {nulls} null entries")
                if request is not None and nulls != self._skip_before(g, request.num_computed_tokens):
                    raise RuntimeError(f"swapped request {rid!r}, group {g}: {nulls} null entries but "
                                       f"{self._skip_before(g, request.num_computed_tokens)} blocks are out "
                                       f"of the window at {request.num_computed_tokens} computed tokens")

    def _check_prefix_cache(self, requests: Mapping[str, Request] | None) -> None:
        """Per group: table lengths, null entries only before the window, registered blocks at
        positions no owner writes and under the request's hash for that group."""
        pool, bs, G = self.block_pool, self.block_size, self.num_kv_cache_groups
        if pool.blocks[NULL_BLOCK_ID].block_hash is not None:
            raise RuntimeError("the null block is registered in the prefix cache")
        if set(self.num_cached_block) - set(self.block_tables) or set(self._num_skipped) != set(self.block_tables):
            raise RuntimeError("num_cached_block / skipped counts list requests without a table")
        for rid, table in self.block_tables.items():
            if len(table) % G:
                raise RuntimeError(f"request {rid!r}: a flat table of {len(table)} entries for {G} groups")
            n = len(table) // G
            request = None if requests is None else requests.get(rid)
            num_cached = self.num_cached_block.get(rid, 0)
            if num_cached > n:
                raise RuntimeError(f"request {rid!r}: {num_cached} cached blocks but tables of {n}")
            for g in range(G):
                ids = table[g::G]
                if self.windows[g] is None and NULL_BLOCK_ID in ids:
                    raise RuntimeError(f"request {rid!r}: full-attention group {g} holds the null block")
                skipped = self._num_skipped[rid][g]
                if any(b == NULL_BLOCK_ID for b in ids[skipped:]) or any(b != NULL_BLOCK_ID for b in ids[:skipped]):
                    raise RuntimeError(f"request {rid!r}, group {g}: null blocks are not exactly its first {skipped}")
                if request is None:
                    continue
                if skipped > self._skip_before(g, request.num_computed_tokens):
                    raise RuntimeError(f"request {rid!r}, group {g}: {skipped} blocks nulled but only "
                                       f"{self._skip_before(g, request.num_computed_tokens)} are out of the window")
                num_full = request.num_computed_tokens // bs
                for i, b in enumerate(ids):
                    if b == NULL_BLOCK_ID:
                        continue
                    stored = pool.blocks[b].block_hash
                    if stored is not None and i >= num_full:
                        raise RuntimeError(f"request {rid!r} may still write block {b} (group {g}, logical {i}) "
                                           "but it is registered in the prefix cache")
                    if stored is not None and i < min(num_cached, len(request.block_hashes)) \
                            and stored != group_block_hash(request.block_hashes[i], g):
                        raise RuntimeError(f"request {rid!r}: block {b} (group {g}, logical {i}) is registered "
                                           "under a hash that is not the request's")
            if request is not None and n != cdiv(request.num_computed_tokens, bs):
                raise RuntimeError(f"request {rid!r}: tables of {n} blocks for "
                                   f"{request.num_computed_tokens} computed tokens")
