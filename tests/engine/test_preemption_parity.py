"""Preemption end to end on a tiny random checkpoint: with a pool of a few blocks, recompute and
swap preemption give the same greedy and seeded outputs as a large pool; the pools are checked
after every step and hold nothing at the end; an abort while swapped frees everything."""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from test_forks import StepProbe

PROMPTS = [list(range(30, 49)), list(range(60, 71)), [5, 9, 13, 200, 17, 3, 3, 40, 41], list(range(100, 113))]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True),
          SamplingParams(temperature=0.9, seed=11, max_tokens=24, ignore_eos=True),
          SamplingParams(temperature=1.0, seed=5, n=2, max_tokens=20, ignore_eos=True, logprobs=0),
          SamplingParams(temperature=0.0, max_tokens=22, ignore_eos=True)]


def run(path, **kw):
    engine = LLM(path, dtype="float32", max_model_len=64, seed=0, block_size=8, **kw)
    probe = StepProbe(engine)
    outs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    kv = engine.llm_engine.kv_cache_manager
    kv.check_integrity(engine.llm_engine.scheduler.requests)
    assert kv.num_free_blocks == kv.num_blocks
    if kv.cpu_block_pool is not None:
        assert all(b.ref_cnt == 0 for b in kv.cpu_block_pool.blocks) and not kv.cpu_block_tables
    return engine, probe, [[(o.token_ids, o.cumulative_logprob) for o in r.outputs] for r in outs]


@pytest.fixture(scope="module")
def reference(make_tiny_checkpoint):
    path = make_tiny_checkpoint("llama")
    _, _, want = run(path, kv_cache_memory_bytes=16 << 20)
    return path, want


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_small_pool_preemption_matches_large_pool(reference, mode):
    path, want = reference
    engine, probe, got = run(path, num_gpu_blocks_override=9, preemption_mode=mode, swap_space=0.01)
    assert [[t for t, _ in r] for r in got] == [[t for t, _ in r] for r in want]
    for g, w in zip(got, want):
        assert [c for _, c in g] == pytest.approx([c for _, c in w], abs=1e-4) if g[0][1] is not None else True
    sched = engine.llm_engine.scheduler
    assert sched.num_preemptions_by_mode[mode] > 0
    other = "recompute" if mode == "swap" else "swap"
    assert sched.num_preemptions_by_mode[other] == 0
    if mode == "swap":
        assert engine.llm_engine.kv_cache_manager.num_cpu_blocks > 0
    else:
        assert engine.llm_engine.kv_cache_manager.cpu_block_pool is None   # no host pool without swap


def test_swap_without_host_pool_room_recomputes(reference):
    path, want = reference
    # 1 host block: no request fits, every preemption falls back to recompute.
    engine = LLM(path, dtype="float32", max_model_len=64, seed=0, block_size=8, num_gpu_blocks_override=9,
                 preemption_mode="swap", swap_space=0)
    outs = engine.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    assert [[o.token_ids for o in r.outputs] for r in outs] == [[t for t, _ in r] for r in want]
    assert engine.llm_engine.scheduler.num_preemptions_by_mode == {
        "recompute": engine.llm_engine.scheduler.num_preemptions_total, "swap": 0}


def test_abort_while_swapped_frees_everything(reference):
    path, _ = reference
    engine = LLM(path, dtype="float32", max_model_len=64, seed=0, block_size=8, num_gpu_blocks_override=9,
                 preemption_mode="swap", swap_space=0.01)
    core = engine.llm_engine
    for i, (p, sp) in enumerate(zip(PROMPTS, PARAMS)):
        core.add_request(f"r{i}", {"prompt_token_ids": p}, sp)
    kv = core.kv_cache_manager
    for _ in range(100):
        core.step()
        if kv.cpu_block_tables:
            break
    assert kv.cpu_block_tables
    core.abort_request([f"r{i}" for i in range(len(PROMPTS))])
    kv.check_integrity(core.scheduler.requests)
    assert kv.num_free_blocks == kv.num_blocks and all(b.ref_cnt == 0 for b in kv.cpu_block_pool.blocks)
    core.step()
    assert core.executor.driver_worker.model_runner.requests.requests == {}


@pytest.mark.parametrize("kwargs, field", [(dict(preemption_mode="evict"), "preemption_mode"),
                                           (dict(swap_space=-1), "swap_space")])
def test_bad_preemption_settings_name_the_field(reference, kwargs, field):
    from pagedllm.engine.arg_utils import EngineArgs
    path, _ = reference
    with pytest.raises(ValueError, match=field):
        EngineArgs(model=path, **kwargs).create_engine_config(model_max_len=64)
