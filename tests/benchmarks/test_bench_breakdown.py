"""StepBreakdown: component times add up to the wall time and the engine is left as it was."""

from __future__ import annotations

import time

from pagedllm import LLM, SamplingParams
from pagedllm.benchmarks.breakdown import StepBreakdown


def test_breakdown_sums_to_wall_and_restores_the_engine(make_tiny_checkpoint):
    # exact_greedy_head="off": the sampler (timed below) then runs for these greedy rows on every CPU.
    llm = LLM(make_tiny_checkpoint("gemma3"), dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=128,
              block_size=8, exact_greedy_head="off")
    engine = llm.llm_engine
    model = engine.executor.driver_worker.model_runner.model
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    before = [o.outputs[0].token_ids for o in llm.generate(["a b c", "d e f g h"], params, use_tqdm=False)]
    with StepBreakdown(engine) as bd:
        t0 = time.perf_counter()
        during = [o.outputs[0].token_ids for o in llm.generate(["a b c", "d e f g h"], params, use_tqdm=False)]
        bd.wall_s = time.perf_counter() - t0
    assert during == before  # timing changes nothing
    rows = {name: s for name, s, _ in bd.table()}
    assert abs(sum(rows.values()) - bd.wall_s) < 1e-9
    for name in ("linear layers", "LM head", "attention", "sampler", "scheduler", "output processing"):
        assert rows[name] > 0, name
    # 5 steps at most 2 requests: every component is inside the wall time
    assert all(s <= bd.wall_s for s in rows.values())
    # restored: no instance attributes left, no hooks left
    assert "step" not in vars(engine) and "execute_model" not in vars(engine.executor.driver_worker.model_runner)
    assert "forward" not in vars(model) and "compute_logits" not in vars(model)
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    after = [o.outputs[0].token_ids for o in llm.generate(["a b c", "d e f g h"], params, use_tqdm=False)]
    assert after == before


def test_rank_table_shares_are_of_each_rank_step_time():
    from pagedllm.benchmarks.breakdown import format_rank_times

    ranks = [dict(rank=0, pp_rank=0, tp_rank=0, num_threads=1, num_steps=10, execute_model=8.0,
                  all_reduce=0.0, all_gather=0.0, send=2.0, recv=0.0),
             dict(rank=1, pp_rank=1, tp_rank=0, num_threads=1, num_steps=10, execute_model=9.0,
                  all_reduce=0.0, all_gather=0.0, send=0.0, recv=0.9)]
    lines = format_rank_times(ranks, wall_s=10.0).splitlines()
    assert lines[2].split() == ["0", "0", "0", "1", "10", "8.00", "80.0%", "0.00", "s", "0.0%", "0.00", "s", "0.0%",
                                "2.00", "s", "25.0%", "0.00", "s", "0.0%"]
    assert lines[3].split()[5:7] == ["9.00", "90.0%"] and lines[3].split()[-3:] == ["0.90", "s", "10.0%"]


def test_overlap_s_counts_the_time_both_ran():
    from pagedllm.benchmarks.breakdown import overlap_s

    assert overlap_s([(0.0, 2.0), (3.0, 5.0)], [(1.0, 4.0)]) == 2.0
    assert overlap_s([(0.0, 1.0)], [(1.0, 2.0), (2.5, 3.0)]) == 0.0
    assert overlap_s([(0.0, 10.0)], [(1.0, 2.0), (3.0, 4.5)]) == 2.5


def test_breakdown_of_constrained_steps_counts_the_hidden_fill_once(make_tiny_checkpoint):
    """Constrained steps fill the bitmask beside the forward (on the forward thread): the part of
    the fill that ran beside it is taken off once, so the rows still sum to the wall time."""
    from pagedllm.sampling_params import StructuredOutputsParams

    llm = LLM(make_tiny_checkpoint("llama"), dtype="float32", kv_cache_memory_bytes=8 << 20, max_model_len=128,
              block_size=8)
    params = SamplingParams(temperature=1.0, seed=3, max_tokens=8,
                            structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    llm.generate(["warm up"], params, use_tqdm=False)   # the backend and the grammar compile
    with StepBreakdown(llm.llm_engine) as bd:
        t0 = time.perf_counter()
        llm.generate(["a b c", "d e f g h"], params, use_tqdm=False)
        bd.wall_s = time.perf_counter() - t0
    rows = {name: s for name, s, _ in bd.table()}
    assert abs(sum(rows.values()) - bd.wall_s) < 1e-9
    assert rows["grammar bitmask fill"] > 0 and rows["grammar mask apply"] > 0
    assert -rows["grammar bitmask fill"] <= rows["fill beside the forward"] <= 0
    assert "sample_tokens" not in vars(llm.llm_engine.executor.driver_worker.model_runner)
