"""Swap preemption without a model: hand-computed swap pairs, tables rewritten on swap-in,
nothing recomputed, shared full blocks swapped once, the recompute fallback and aborts
(block_size=4)."""

from __future__ import annotations

import logging

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.sampling_params import SamplingParams
from scheduler_mirror import MirroredScheduler


def make(num_blocks, num_cpu_blocks, enable=True, mode="swap"):
    kv = KVCacheManager(block_size=4, num_blocks=num_blocks, enable_caching=enable, num_cpu_blocks=num_cpu_blocks)
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64,
                          enable_chunked_prefill=True, preemption_mode=mode)
    return MirroredScheduler(cfg, kv), kv


def req(rid, prompt, max_tokens):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens)


def step(sched, token=7):
    out = sched.schedule()
    ids = [s.request_id for s in out.scheduled if s.sample]
    ids += [st.req_id for parent, st in sched.worker_states.forks if parent in ids]
    sched.update_from_output(out, ModelRunnerOutput(req_ids=ids, sampled_token_ids=[token] * len(ids),
                                                    sampled_logprobs=[0.0] * len(ids)))
    sched.kv_cache_manager.check_integrity(sched.requests)
    return out


def test_swap_out_and_in_hand_computed():
    sched, kv = make(num_blocks=4, num_cpu_blocks=4)
    a, b = req("a", range(6), 8), req("b", range(20, 26), 8)   # 2 blocks each: the pool is full
    sched.add_request(a)
    sched.add_request(b)
    out = step(sched)
    assert {s.request_id: s.block_table for s in out.scheduled} == {"a": [0, 1], "b": [2, 3]}
    step(sched)
    step(sched)   # 8 computed tokens each: 2 full blocks
    out = step(sched)   # a needs a third block: b (admitted last) is swapped out
    assert out.preempted_req_ids == {"b"} and out.blocks_to_swap_out == [(2, 0), (3, 1)]
    assert kv.is_swapped(b) and b.num_computed_tokens == 8 and b.status == RequestStatus.PREEMPTED
    assert sched.make_stats().num_swapped == 1 and sched.num_preemptions_by_mode == {"recompute": 0, "swap": 1}
    while not a.is_finished():
        out = step(sched)
    # a finished: b comes back into fresh blocks, its table rewritten, nothing recomputed.
    out = step(sched)
    assert [c for c, _ in out.blocks_to_swap_in] == [0, 1]
    (diff,) = out.scheduled_cached_reqs
    assert diff.resumed_from_preemption and diff.num_computed_tokens == 8
    assert out.num_scheduled_tokens == {"b": 1}
    (s,) = out.scheduled
    assert s.block_table[:2] == [d for _, d in out.blocks_to_swap_in] and len(s.block_table) == 3
    while sched.has_unfinished_requests():
        step(sched)
    assert b.num_output_tokens == 8
    assert all(x.ref_cnt == 0 for x in kv.block_pool.blocks) and all(x.ref_cnt == 0 for x in kv.cpu_block_pool.blocks)


def test_shared_full_blocks_swapped_once_and_stay_shared():
    kv = KVCacheManager(block_size=4, num_blocks=8, enable_caching=True, num_cpu_blocks=8)
    p, c1, c2 = (req(r, range(10), 4) for r in ("p", "c1", "c2"))   # 2 full blocks + 2 tokens
    assert kv.allocate_slots(p, 10) == [0, 1, 2]
    p.num_computed_tokens = 10
    kv.cache_blocks(p)
    for c in (c1, c2):
        kv.fork(p, c)
        c.num_computed_tokens = 10
    assert kv.swap_out(c1) == [(0, 0), (1, 1), (2, 2)]
    # c2's full blocks are already on the host: only its partial block is copied.
    assert kv.swap_out(c2) == [(2, 3)]
    assert kv.cpu_block_tables == {"c1": [0, 1, 2], "c2": [0, 1, 3]}
    assert [kv.cpu_block_pool.ref_cnt(b) for b in range(4)] == [2, 2, 1, 1]
    assert [kv.block_pool.ref_cnt(b) for b in range(3)] == [1, 1, 1]
    kv.check_integrity({"p": p, "c1": c1, "c2": c2})
    # Back in: the full blocks p still holds are shared again, the partial ones copied.
    assert kv.swap_in(c1, 1) == [(2, 3)]
    assert kv.swap_in(c2, 1) == [(3, 4)]
    assert kv.get_block_table("c1") == [0, 1, 3] and kv.get_block_table("c2") == [0, 1, 4]
    assert [kv.block_pool.ref_cnt(b) for b in range(5)] == [3, 3, 1, 1, 1]
    kv.check_integrity({"p": p, "c1": c1, "c2": c2})
    # With p gone, a second round copies the full blocks to the host once and back once.
    kv.free(p)
    out1 = kv.swap_out(c1)
    assert [d for d, _ in out1] == [0, 1, 3]
    out2 = kv.swap_out(c2)
    assert [d for d, _ in out2] == [4]
    assert kv.cpu_block_tables["c2"][:2] == kv.cpu_block_tables["c1"][:2]
    assert kv.num_free_blocks == 8
    # Back in: blocks 0 and 1 are still registered in the prefix cache (freed, not evicted):
    # taken as hits, only the partial blocks are copied.
    assert kv.swap_in(c1, 1) == [(out1[2][1], kv.get_block_table("c1")[2])]
    assert kv.swap_in(c2, 1) == [(out2[0][1], kv.get_block_table("c2")[2])]
    assert kv.get_block_table("c2")[:2] == kv.get_block_table("c1")[:2] == [0, 1]
    kv.check_integrity({"c1": c1, "c2": c2})
    kv.free(c1)
    kv.free(c2)
    kv.check_integrity({})
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks) and all(b.ref_cnt == 0 for b in kv.cpu_block_pool.blocks)
    assert not kv.swap_space.dev_to_cpu and not kv.swap_space.cpu_to_dev


def test_forks_swapped_under_pressure_finish_with_their_tokens():
    sched, kv = make(num_blocks=6, num_cpu_blocks=8)
    forks = [req(f"{i}_p", range(10), 8) for i in range(3)]
    sched.add_request(forks[0], forks[1:])
    while sched.has_unfinished_requests():
        step(sched)
    assert sched.num_preemptions_by_mode["swap"] > 0 and sched.num_preemptions_by_mode["recompute"] == 0
    assert [r.output_token_ids for r in forks] == [[7] * 8] * 3
    assert all(x.ref_cnt == 0 for x in kv.block_pool.blocks) and all(x.ref_cnt == 0 for x in kv.cpu_block_pool.blocks)


def test_host_pool_too_small_falls_back_to_recompute(caplog):
    sched, kv = make(num_blocks=4, num_cpu_blocks=1)
    a, b = req("a", range(6), 8), req("b", range(20, 26), 8)
    sched.add_request(a)
    sched.add_request(b)
    with caplog.at_level(logging.WARNING, logger="pagedllm.core.scheduler"):
        while sched.has_unfinished_requests():
            out = step(sched)
            assert not out.blocks_to_swap_out
    assert sched.num_preemptions_by_mode["recompute"] > 0 and sched.num_preemptions_by_mode["swap"] == 0
    assert sum("cannot take" in r.message for r in caplog.records) == 1
    assert a.num_output_tokens == b.num_output_tokens == 8


def test_abort_mid_swap_frees_host_and_device_blocks():
    sched, kv = make(num_blocks=4, num_cpu_blocks=4)
    a, b = req("a", range(6), 8), req("b", range(20, 26), 8)
    sched.add_request(a)
    sched.add_request(b)
    for _ in range(4):
        step(sched)
    assert kv.is_swapped(b)
    sched.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    kv.check_integrity(sched.requests)
    assert not kv.cpu_block_tables and not kv.swap_space.dev_to_cpu and not kv.swap_space.cpu_to_dev
    assert all(x.ref_cnt == 0 for x in kv.block_pool.blocks) and all(x.ref_cnt == 0 for x in kv.cpu_block_pool.blocks)
