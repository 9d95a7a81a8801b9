"""Hybrid KV cache: layer groups, per-group block tables, sliding-window freeing (hand-computed)."""

import pytest

from pagedllm.core.hybrid_kv_cache_manager import HybridKVCacheManager
from pagedllm.core.kv_cache_spec import (
    NULL_BLOCK_ID, KVCacheGroupSpec, make_kv_cache_groups, resolve_kv_cache_groups, split_group_block_ids)
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams


def req(rid: str, n: int, base: int = 100) -> Request:
    return Request(rid, list(range(base, base + n)), SamplingParams(), max_tokens=8)


def gemma3_windows(num_layers: int, window: int) -> list[int | None]:
    return [None if (i + 1) % 6 == 0 else window for i in range(num_layers)]


def test_gemma3_270m_grouping_and_per_request_blocks():
    groups = make_kv_cache_groups(gemma3_windows(18, 512))
    assert groups.group_size == 3 and groups.num_groups == 6
    assert groups.groups[0] == KVCacheGroupSpec((5, 11, 17), None)
    assert groups.groups[1] == KVCacheGroupSpec((0, 1, 2), 512)
    assert groups.groups[2] == KVCacheGroupSpec((3, 4, 6), 512)
    assert groups.layer_tensor_index()[:7] == [0, 1, 2, 0, 1, 0, 2]
    assert groups.layer_group()[:7] == [1, 1, 1, 2, 2, 0, 2]
    # 8192 tokens, block 16: 512 full-group blocks + 5 x (cdiv(511 + 1, 16) + 1) = 512 + 5 * 33.
    assert groups.max_blocks_per_request(8192, 16) == 677
    # Pages of 3 layers instead of 18: 677 * 3 / (512 * 18) = 0.22 of today's bytes.
    assert 677 * 3 / (512 * 18) < 0.3


def test_pipeline_stages_allocate_pairs_for_their_own_layers():
    # Gemma 3 270M over two stages of 9 layers: the groups stay global (a stage pages the same
    # block ids); each stage holds as many pairs as any group has layers on it.
    groups = make_kv_cache_groups(gemma3_windows(18, 512))
    assert groups.num_tensor_pairs() == groups.group_size == 3
    # Stage 0: full (5), (0, 1, 2), (3, 4, 6), (7, 8): 3 pairs.
    assert groups.num_tensor_pairs(0, 9) == 3
    assert groups.layer_tensor_index(0, 9) == [0, 1, 2, 0, 1, 0, 2, 0, 1]
    assert groups.layer_group(0, 9) == [1, 1, 1, 2, 2, 0, 2, 3, 3]
    # Stage 1: (9), (10, 12, 13), full (11, 17), (14, 15, 16).
    assert groups.num_tensor_pairs(9, 18) == 3
    assert groups.layer_tensor_index(9, 18) == [0, 0, 0, 1, 2, 0, 1, 2, 1]
    assert groups.layer_group(9, 18) == [3, 4, 0, 4, 4, 5, 5, 5, 0]
    # Tiny Gemma 3 (sliding, full, sliding, full) over stages of 1 and 3 layers.
    tiny = make_kv_cache_groups([8, None, 8, None])
    assert (tiny.num_tensor_pairs(0, 1), tiny.layer_tensor_index(0, 1), tiny.layer_group(0, 1)) == (1, [0], [1])
    assert (tiny.num_tensor_pairs(1, 4), tiny.layer_tensor_index(1, 4), tiny.layer_group(1, 4)) == \
        (2, [0, 0, 1], [0, 1, 0])
    with pytest.raises(ValueError, match="layer range \\[3, 3\\)"):
        tiny.num_tensor_pairs(3, 3)
    assert resolve_kv_cache_groups([8, None, 8, None]).is_hybrid


def test_groupings_mistral_gemma2_and_fallbacks():
    mistral = make_kv_cache_groups([8] * 4)
    assert mistral.num_groups == 1 and mistral.groups[0].sliding_window == 8 and mistral.is_hybrid
    gemma2 = make_kv_cache_groups([8, None, 8, None])
    assert [g.layer_indices for g in gemma2.groups] == [(1, 3), (0, 2)] and gemma2.group_size == 2
    full = make_kv_cache_groups([None] * 3)
    assert not full.is_hybrid and full.fallback_reason is None
    odd = make_kv_cache_groups([8] * 10 + [None])   # gcd 1: 11 groups of one layer
    assert not odd.is_hybrid and "11 groups" in odd.fallback_reason
    with pytest.raises(ValueError, match="layer_windows\\[1\\]"):
        make_kv_cache_groups([8, 0])
    assert split_group_block_ids([1, 2, 3, 4, 5, 6], 2) == [[1, 3, 5], [2, 4, 6]]
    with pytest.raises(ValueError):
        split_group_block_ids([1, 2, 3], 2)


def test_sliding_group_frees_blocks_out_of_the_window():
    # Group 0 full, group 1 window 8 (block 4): a query at p reads p-7..p.
    groups = make_kv_cache_groups([None, 8])
    kv = HybridKVCacheManager(4, 32, groups)
    assert kv.num_blocks == 31 and kv.num_free_blocks == 31
    r = req("a", 14)
    # Prefill of 14 tokens: 4 logical blocks in both groups (the chunk's own queries need them all).
    assert kv.allocate_slots(r, 14) == [1, 2, 3, 4, 5, 6, 7, 8]
    assert kv.get_block_table("a") == [1, 2, 3, 4, 5, 6, 7, 8]
    r.num_computed_tokens = 14
    kv.check_integrity({"a": r})
    # Decode at 14: reads 7..14, so blocks 0 (0-3) of the sliding group are out: freed, nulled.
    assert kv.allocate_slots(r, 1) == []
    assert split_group_block_ids(kv.get_block_table("a"), 2) == [[1, 3, 5, 7], [NULL_BLOCK_ID, 4, 6, 8]]
    assert kv.num_free_blocks == 31 - 7
    r.num_computed_tokens = 16
    # Decode at 16 reads 9..16: logical 0 and 1 out; a fifth block opens in both groups (from
    # the free queue's head: the freed blocks 2 and 4 went to its tail).
    assert kv.allocate_slots(r, 1) == [9, 10]
    assert split_group_block_ids(kv.get_block_table("a"), 2) == [[1, 3, 5, 7, 9], [0, 0, 6, 8, 10]]
    r.num_computed_tokens = 17
    kv.check_integrity({"a": r})
    assert kv.num_stored_tokens({"a": r}) == 4 * 4 + 1 + 2 * 4 + 1
    kv.free(r)
    assert kv.num_free_blocks == 31
    kv.check_integrity({})


def test_prefix_hit_takes_full_blocks_and_only_the_window():
    groups = make_kv_cache_groups([None, 8])
    kv = HybridKVCacheManager(4, 64, groups, enable_caching=True)
    a = req("a", 20)
    kv.allocate_slots(a, 20)
    a.num_computed_tokens = 20
    kv.cache_blocks(a)
    table_a = split_group_block_ids(kv.get_block_table("a"), 2)
    kv.allocate_slots(a, 1)   # frees sliding blocks 0..2 (tokens < 13) to the cached free queue
    assert split_group_block_ids(kv.get_block_table("a"), 2)[1][:3] == [0, 0, 0]
    kv.free(a)
    # Same 18-token prompt prefix + 2 new: at most (22 - 1) // 4 = 5 blocks, the 5th is a's block 4 ...
    b = Request("b", list(range(100, 120)) + [1, 2], SamplingParams(), max_tokens=8)
    hit = kv.get_computed_blocks(b)
    assert hit.num_computed_tokens == 20
    # full group: all 5; sliding group: the last cdiv(7, 4) = 2 blocks before block 5.
    assert split_group_block_ids(hit.block_ids, 2) == [table_a[0], [0, 0, 0, table_a[1][3], table_a[1][4]]]
    assert kv.allocate_slots(b, 2, hit) is not None
    b.num_computed_tokens = 22
    kv.check_integrity({"b": b})
    # Evict the sliding group's block 3: the hit shrinks to where the window is still cached.
    kv.free(b)
    kv.block_pool._evict(kv.block_pool.blocks[table_a[1][3]])
    c = Request("c", list(range(100, 120)) + [1, 2], SamplingParams(), max_tokens=8)
    hit = kv.get_computed_blocks(c)
    # n=5 needs sliding blocks 3, 4 (3 evicted); n=4 needs 2, 3 (2 freed while a ran: still cached? no,
    # block 2 was registered too); the first n whose window is cached: blocks 1..2 -> n = 3.
    assert hit.num_computed_tokens == 12
    assert split_group_block_ids(hit.block_ids, 2) == [table_a[0][:3], [0, table_a[1][1], table_a[1][2]]]
    kv.check_integrity()


def test_fork_and_copy_on_write_copy_each_groups_last_block():
    groups = make_kv_cache_groups([None, 8])
    kv = HybridKVCacheManager(4, 32, groups)
    parent, child = req("p", 6), req("c", 6)
    kv.allocate_slots(parent, 6)
    parent.num_computed_tokens = child.num_computed_tokens = 6
    kv.fork(parent, child)
    assert kv.get_block_table("c") == [1, 2, 3, 4]
    assert kv.cow_last_blocks_if_shared(child) == [(3, 5), (4, 6)]
    assert kv.get_block_table("c") == [1, 2, 5, 6] and kv.get_block_table("p") == [1, 2, 3, 4]
    assert kv.cow_last_blocks_if_shared(parent) == []
    kv.check_integrity({"p": parent, "c": child})
    with pytest.raises(NotImplementedError):
        kv.cow_last_block_if_shared(child)


def test_trim_cuts_every_group_and_reset_prefix_cache():
    groups = make_kv_cache_groups([None, 8])
    kv = HybridKVCacheManager(4, 16, groups, enable_caching=True)
    r = req("a", 4)
    kv.allocate_slots(r, 9)    # 4 tokens + 5 drafts: 3 logical blocks
    r.num_computed_tokens = 5  # 1 draft accepted
    assert kv.trim(r) == 4
    assert kv.num_free_blocks == 11
    kv.cache_blocks(r)
    kv.check_integrity({"a": r})
    assert not kv.reset_prefix_cache()
    kv.free(r)
    assert kv.reset_prefix_cache() and kv.block_pool.num_cached_blocks == 0


def test_allocation_fails_without_changing_the_tables():
    groups = make_kv_cache_groups([None, 8])
    kv = HybridKVCacheManager(4, 5, groups)   # 4 usable blocks
    a = req("a", 8)
    assert kv.allocate_slots(a, 8) == [1, 2, 3, 4]
    b = req("b", 1)
    assert kv.allocate_slots(b, 1) is None and kv.get_block_table("b") == []
    a.num_computed_tokens = 8
    # Decode at 8 reads 1..8 (block 0 holds 1..3 still): a new block per group needs 2, none free.
    assert kv.allocate_slots(a, 1) is None
    assert split_group_block_ids(kv.get_block_table("a"), 2) == [[1, 3], [2, 4]]
    a.num_computed_tokens = 11   # (as if the table were longer: only the window math matters here)
    # At 11 (reads 4..11) the sliding block 0 is out: freed even though the allocation fails.
    assert kv.allocate_slots(a, 2) is None
    assert split_group_block_ids(kv.get_block_table("a"), 2) == [[1, 3], [0, 4]]
    assert kv.usage == 0.75 and kv.group_usage() == [0.5, 0.25]
    a.num_computed_tokens = 8
    with pytest.raises(RuntimeError, match="out of the window"):
        kv.check_integrity({"a": a})
    kv.check_integrity()


def test_scheduler_stats_and_prometheus_show_per_group_usage():
    from prometheus_client import generate_latest

    from pagedllm.config import SchedulerConfig
    from pagedllm.core.scheduler import Scheduler
    from pagedllm.metrics.prometheus import PrometheusStatLogger

    kv = HybridKVCacheManager(4, 21, make_kv_cache_groups([None, 8]))
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), kv)
    sched.add_request(req("a", 14))
    out = sched.schedule()
    # 4 logical blocks in each group, interleaved in the one table the message carries.
    assert out.scheduled_new_reqs[0].block_ids == [1, 2, 3, 4, 5, 6, 7, 8]
    stats = sched.make_stats()
    assert stats.kv_cache_group_usage == [0.2, 0.2] and stats.kv_cache_usage == 0.4
    prom = PrometheusStatLogger("m", 64, 64, initial=stats)
    text = generate_latest(prom.registry).decode()
    assert 'pagedllm:kv_cache_group_usage_perc{engine="0",kv_cache_group="1",model_name="m"} 0.2' in text


def test_can_admit_counts_the_whole_prompt_and_only_the_window_plus_a_chunk():
    groups = make_kv_cache_groups([None, 8])
    kv = HybridKVCacheManager(4, 21, groups)   # 20 usable blocks
    assert kv.allocate_slots(req("a", 8), 8) is not None and kv.num_free_blocks == 16

    def can_admit(n, chunk):
        r = req(f"r{n}", n)
        return kv.can_admit(r, kv.get_computed_blocks(r), chunk)
    # 4-token chunks: full group cdiv(n, 4), window group cdiv(8 - 1 + 4, 4) + 1 = 4.
    assert can_admit(48, 4) and not can_admit(52, 4)         # 12 + 4 = 16; 13 + 4 = 17
    # 8-token chunks: the window group holds cdiv(15, 4) + 1 = 5.
    assert can_admit(44, 8) and not can_admit(48, 8)         # 11 + 5 = 16; 12 + 5 = 17
    assert can_admit(8, 64)                                   # short: min(2, ...) per group


# -- swap preemption ---------------------------------------------------------------------------

def _host_free(kv) -> int:
    return kv.cpu_block_pool.get_num_free_blocks()


def test_swap_keeps_only_the_window_and_copies_shared_full_blocks_once():
    # Group 0 full, group 1 window 8 (block 4). 31 usable device blocks; 12 host blocks, host
    # block 0 is the host null block: 11 usable.
    groups = make_kv_cache_groups([None, 8])
    kv = HybridKVCacheManager(4, 32, groups, enable_caching=True, num_cpu_blocks=12)
    assert kv.num_cpu_blocks == 12 and _host_free(kv) == 11
    a = req("a", 14)
    assert kv.allocate_slots(a, 14) == [1, 2, 3, 4, 5, 6, 7, 8]
    a.num_computed_tokens = 14
    kv.cache_blocks(a)                       # logical 0..2 of both groups registered
    # b shares a's first 12 tokens: a prefix-cache hit of 3 blocks; its sliding group takes only
    # the window before block 3 (logical 1, 2), logical 0 is null.
    b = Request("b", list(range(100, 112)) + [1, 2], SamplingParams(), max_tokens=8)
    hit = kv.get_computed_blocks(b)
    assert hit.num_computed_tokens == 12 and hit.block_ids == [1, NULL_BLOCK_ID, 3, 4, 5, 6]
    assert kv.allocate_slots(b, 2, hit) == [9, 10]
    b.num_computed_tokens = 14
    reqs = {"a": a, "b": b}
    kv.check_integrity(reqs)
    assert kv.num_free_blocks == 31 - 10

    # Swap-out of a at 14 computed tokens: the sliding group's logical 0 (tokens 0-3; the next
    # query at 14 reads 7..14) is freed first and stays null: 7 real pages -> 7 host blocks.
    assert kv.can_swap_out(a)
    assert kv.get_block_table("a") == [1, NULL_BLOCK_ID, 3, 4, 5, 6, 7, 8]
    assert kv.swap_out(a) == [(1, 1), (3, 2), (4, 3), (5, 4), (6, 5), (7, 6), (8, 7)]
    assert kv.is_swapped(a) and kv.get_block_table("a") == []
    assert kv.cpu_block_tables["a"] == [1, NULL_BLOCK_ID, 2, 3, 4, 5, 6, 7]
    assert _host_free(kv) == 11 - 7
    assert kv.num_free_blocks == 31 - 10 + 3   # a's 2 (out of the window), 7, 8; b holds the rest
    kv.check_integrity(reqs)

    # Swap-out of b: its full blocks (shared with a through the prefix cache) are on the host
    # already: only its own last blocks are copied.
    assert kv.swap_out(b) == [(9, 8), (10, 9)]
    assert kv.cpu_block_tables["b"] == [1, NULL_BLOCK_ID, 2, 3, 4, 5, 8, 9]
    # Host refs: the null block 1 (the pool's own), the shared full pages 2, the last blocks 1.
    assert [kv.cpu_block_pool.ref_cnt(c) for c in range(10)] == [1, 2, 2, 2, 2, 2, 1, 1, 1, 1]
    assert _host_free(kv) == 2 and kv.num_free_blocks == 31
    kv.check_integrity(reqs)

    # With the prefix cache cleared nothing is left on the device: a's swap-in copies its 7
    # pages into fresh blocks (the free queue's head: 11, 12, ...), b's then shares a's full
    # ones and copies only its last blocks.
    assert kv.reset_prefix_cache()
    assert kv.swap_in(a, 1) == [(1, 11), (2, 12), (3, 13), (4, 14), (5, 15), (6, 16), (7, 17)]
    assert kv.get_block_table("a") == [11, NULL_BLOCK_ID, 12, 13, 14, 15, 16, 17]
    assert _host_free(kv) == 4 and kv.num_free_blocks == 31 - 7
    kv.check_integrity(reqs)
    assert kv.swap_in(b, 1) == [(8, 18), (9, 19)]
    assert kv.get_block_table("b") == [11, NULL_BLOCK_ID, 12, 13, 14, 15, 18, 19]
    assert _host_free(kv) == 11 and kv.num_free_blocks == 31 - 9
    assert not kv.cpu_block_tables and not kv.swap_space.dev_to_cpu and not kv.swap_space.cpu_to_dev
    kv.check_integrity(reqs)
    # The swapped-in tables run on: a's decode at 14 fits its last block.
    assert kv.allocate_slots(a, 1) == []
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 31 and _host_free(kv) == 11
    kv.check_integrity({})


def test_swap_in_takes_blocks_still_in_the_prefix_cache_and_host_room_counts_real_pages():
    groups = make_kv_cache_groups([None, 8])
    # 8 host blocks = the null block + 7: exactly a's real pages at 14 tokens (8 entries, 1 null).
    kv = HybridKVCacheManager(4, 32, groups, enable_caching=True, num_cpu_blocks=8)
    small = HybridKVCacheManager(4, 32, groups, enable_caching=True, num_cpu_blocks=7)
    for m in (kv, small):
        a = req("a", 14)
        m.allocate_slots(a, 14)
        a.num_computed_tokens = 14
        m.cache_blocks(a)
    assert not small.can_swap_out(a) and small.get_block_table("a")[1] == NULL_BLOCK_ID
    with pytest.raises(ValueError, match="host pool cannot take"):
        small.swap_out(a)
    small.check_integrity({"a": a})
    assert kv.can_swap_out(a)
    assert len(kv.swap_out(a)) == 7 and _host_free(kv) == 0
    assert kv.num_free_blocks == 31 and kv.swap_space.dev_to_cpu == {}
    kv.check_integrity({"a": a})
    # Its full blocks (logical 0..2) are still registered in the free queue: taken back, not
    # copied; only the partial last blocks (logical 3) are copied, into the queue's head (9, 10).
    assert kv.swap_in(a, 2) == [(6, 9), (7, 10)]
    assert kv.get_block_table("a") == [1, NULL_BLOCK_ID, 3, 4, 5, 6, 9, 10]
    assert kv.num_free_blocks == 31 - 7 and _host_free(kv) == 7
    kv.check_integrity({"a": a})


def test_integrity_check_covers_swapped_tables_per_group():
    groups = make_kv_cache_groups([None, 8])
    kv = HybridKVCacheManager(4, 32, groups, num_cpu_blocks=12)
    a = req("a", 14)
    kv.allocate_slots(a, 14)
    a.num_computed_tokens = 14
    kv.swap_out(a)
    host = kv.cpu_block_tables["a"]
    assert host == [1, NULL_BLOCK_ID, 2, 3, 4, 5, 6, 7]
    kv.check_integrity({"a": a})
    # The window moved on while swapped (a bookkeeping bug): logical 1 should be null too.
    a.num_computed_tokens = 16
    with pytest.raises(RuntimeError, match="group 1: 1 null entries but 2 blocks are out of the window"):
        kv.check_integrity({"a": a})
    a.num_computed_tokens = 14
    host[0], host[1] = NULL_BLOCK_ID, 1    # a full group's entry nulled
    with pytest.raises(RuntimeError, match="full-attention group 0 holds 1 null entries"):
        kv.check_integrity({"a": a})
