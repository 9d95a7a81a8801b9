"""The KV memory comparison on small, hand-checkable configs (scheduler only, no model)."""

from __future__ import annotations

import pytest

from pagedllm.benchmarks.datasets import dataset_file, load_jsonl_requests, resample_lengths
from pagedllm.benchmarks.memory import simulate_kv_concurrency


def test_fixed_lengths_give_exact_concurrency_and_utilization():
    # Budget 2 x 32 = 64 tokens = 16 blocks of 4. Prompt 13 + 3 outputs: the KV peaks at 15 tokens
    # (the last token is never fed back) = 4 blocks, and admission already takes ceil(13/4) = 4.
    # So exactly 4 run at once (static: 2), with no preemption.
    lengths = [(13, 3)] * 12
    r = simulate_kv_concurrency(lengths, block_size=4, max_model_len=32, static_concurrency=2,
                                max_num_seqs=64, max_num_batched_tokens=64)
    assert (r.num_blocks, r.kv_budget_tokens, r.static_concurrency) == (16, 64, 2)
    assert r.peak_concurrency == 4 and r.peak_ratio == 2.0
    assert r.num_preemptions == 0
    # 12 requests, 4 at a time, 3 steps each (prefill, 2 decodes): 9 steps of batch 4.
    assert r.num_steps == 9 and r.mean_concurrency_all_steps == 4.0
    # Waiting requests during the first two waves (6 steps), always 4 running.
    assert r.mean_concurrency == 4.0 and r.mean_ratio == 2.0
    # After the update of the prefill step 13 of 16 slots are stored, after the first decode 14;
    # after the last decode the requests are gone (not counted): (13/16 + 14/16) / 2.
    assert r.kv_utilization == pytest.approx((13 / 16 + 14 / 16) / 2)
    assert r.peak_kv_usage == 1.0


def test_max_num_seqs_caps_concurrency():
    r = simulate_kv_concurrency([(13, 3)] * 12, block_size=4, max_model_len=32, static_concurrency=2,
                                max_num_seqs=3, max_num_batched_tokens=64)
    assert r.peak_concurrency == 3


def test_growth_past_admission_preempts():
    # Prompt 4 (1 block) growing to 4 + 7 outputs -> 10 KV tokens = 3 blocks: 8 blocks admit 8
    # requests at first, which then must preempt as they grow.
    r = simulate_kv_concurrency([(4, 7)] * 8, block_size=4, max_model_len=16, static_concurrency=2,
                                max_num_seqs=64, max_num_batched_tokens=64)
    assert r.num_blocks == 8 and r.peak_concurrency == 8
    assert r.num_preemptions > 0


def test_bad_configs():
    with pytest.raises(ValueError, match="max_model_len"):
        simulate_kv_concurrency([(30, 5)], block_size=4, max_model_len=32)
    with pytest.raises(ValueError, match="multiple of block_size"):
        simulate_kv_concurrency([(3, 1)], block_size=5, max_model_len=32, static_concurrency=2)
    with pytest.raises(ValueError, match="empty"):
        simulate_kv_concurrency([])


def test_shipped_workload_beats_static_and_sweep_orders_utilization():
    lengths = resample_lengths(load_jsonl_requests(dataset_file("workload")), 256, seed=0)
    results = {bs: simulate_kv_concurrency(lengths, block_size=bs) for bs in (8, 16, 32)}
    r16 = results[16]
    assert r16.static_concurrency == 8 and r16.num_requests == 256
    assert r16.peak_concurrency > 5 * 8 and r16.mean_concurrency > 4 * 8
    # Smaller blocks waste less of the last block.
    assert results[8].kv_utilization > results[16].kv_utilization > results[32].kv_utilization


def test_make_stats_stored_tokens_and_allocated_slots():
    from pagedllm.config import SchedulerConfig
    from pagedllm.core.kv_cache_manager import KVCacheManager
    from pagedllm.core.request import Request
    from pagedllm.core.sched_output import ModelRunnerOutput
    from pagedllm.core.scheduler import Scheduler
    from pagedllm.sampling_params import SamplingParams

    kv = KVCacheManager(block_size=4, num_blocks=16)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64), kv)
    for rid, n in (("a", 10), ("b", 5)):
        sched.add_request(Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=3, ignore_eos=True), 3))
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(req_ids=["a", "b"], sampled_token_ids=[7, 7]))
    st = sched.make_stats()
    # 10 tokens in 3 blocks + 5 tokens in 2 blocks: 15 stored in 5 x 4 = 20 slots.
    assert (st.num_stored_tokens, st.num_allocated_slots) == (15, 20)
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(req_ids=["a", "b"], sampled_token_ids=[7, 7]))
    st = sched.make_stats()
    assert (st.num_stored_tokens, st.num_allocated_slots) == (17, 20)  # 11 + 6, no new block


def test_hybrid_layer_windows_run_more_long_requests_at_once():
    """Gemma-3-like layers (5 sliding of window 64 per full one, 12 layers): the same byte budget
    as 4 requests of 1,024 tokens holds 4 x 64 blocks of 12 layers = 4 x 64 x 6 pages of 2 layers;
    a 1,000-token request holds at most 63 full pages + 5 x (cdiv(63 + 1, 16) + 1) = 88 pages while
    decoding, so about 15 requests fit instead of 4."""
    from pagedllm.benchmarks.cli import _layer_windows
    from pagedllm.benchmarks.memory import simulate_kv_concurrency

    windows = _layer_windows("64*5,full,64*5,full")
    assert windows == [64] * 5 + [None] + [64] * 5 + [None]
    lengths = [(1000, 24)] * 32
    one = simulate_kv_concurrency(lengths, block_size=16, max_model_len=1024, static_concurrency=4)
    hybrid = simulate_kv_concurrency(lengths, block_size=16, max_model_len=1024, static_concurrency=4,
                                     layer_windows=windows)
    assert one.num_blocks == 256 and hybrid.num_blocks == 256 * 6
    assert 4 <= one.peak_concurrency <= 5   # 4 fit; a fifth is admitted on its first chunk, then preempted
    assert hybrid.mean_concurrency >= 3 * one.mean_concurrency
    with pytest.raises(ValueError, match="--layer-windows"):
        _layer_windows("64*0")
