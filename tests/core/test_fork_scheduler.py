"""n > 1 forks without a model: the prompt computed once, hand-computed block tables, the
copy-on-write pairs and the table diffs the worker rebuilds (block_size=4, num_blocks=16)."""

from __future__ import annotations

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.sampling_params import SamplingParams
from scheduler_mirror import MirroredScheduler


def make(num_blocks=16, budget=64, max_num_seqs=8, enable=True):
    kv = KVCacheManager(block_size=4, num_blocks=num_blocks, enable_caching=enable)
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=64,
                          enable_chunked_prefill=True)
    return MirroredScheduler(cfg, kv), kv


def group(rid, prompt, n, max_tokens=3):
    reqs = [Request(f"{i}_{rid}", list(prompt), SamplingParams(max_tokens=max_tokens), max_tokens=max_tokens)
            for i in range(n)]
    return reqs[0], reqs[1:]


def step(sched, tokens=None):
    """One step; the fake worker samples for the scheduled rows, then the forks (batch order),
    as ModelRunner does. Returns (output, {id: token})."""
    out = sched.schedule()
    ids = [s.request_id for s in out.scheduled if s.sample]
    ids += [state.req_id for parent, state in sched.worker_states.forks if parent in ids]
    toks = [tokens.get(i, 7) if tokens else 7 for i in ids]
    sched.update_from_output(out, ModelRunnerOutput(req_ids=ids, sampled_token_ids=toks,
                                                    sampled_logprobs=[0.0] * len(ids)))
    sched.kv_cache_manager.check_integrity(sched.requests)
    return out, dict(zip(ids, toks))


def test_prompt_once_then_fork_and_copy_on_write():
    sched, kv = make()
    parent, forks = group("a", range(100, 106), n=3)  # 6 tokens: block 0 full, block 1 partial
    sched.add_request(parent, forks)
    assert sched.get_num_unfinished_requests() == 3 and sched.num_waiting == 1
    out, sampled = step(sched, {"0_a": 11, "1_a": 12, "2_a": 13})
    # Only the parent computed the prompt; both forks sampled from its row.
    assert out.num_scheduled_tokens == {"0_a": 6}
    assert out.forked_req_ids == {"1_a": "0_a", "2_a": "0_a"}
    assert sampled == {"0_a": 11, "1_a": 12, "2_a": 13}
    new = {n.req_id: n for n in out.scheduled_new_reqs}
    assert new["1_a"].block_ids == new["2_a"].block_ids == [0, 1] and new["1_a"].num_computed_tokens == 6
    assert [kv.block_pool.ref_cnt(b) for b in (0, 1)] == [3, 3]
    assert kv.block_pool.num_cached_blocks == 1   # the full block, registered once
    # Decode: the first two writers copy the shared partial block, the last writes in place.
    out, _ = step(sched)
    assert out.blocks_to_copy == [(1, 2), (1, 3)]
    assert {s.request_id: s.block_table for s in out.scheduled} == {"0_a": [0, 2], "1_a": [0, 3], "2_a": [0, 1]}
    diffs = {c.req_id: c for c in out.scheduled_cached_reqs}
    assert diffs["0_a"].replaced_block_ids == [(1, 2)] and diffs["2_a"].replaced_block_ids == []
    assert diffs["1_a"].new_token_ids == [12]
    assert [kv.block_pool.ref_cnt(b) for b in range(4)] == [3, 1, 1, 1]
    assert [s.token_ids for s in out.scheduled] == [[11], [12], [13]]
    step(sched)  # the third token: all finish (max_tokens=3)
    assert not sched.has_unfinished_requests()
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


def test_fork_after_chunked_prefill_and_full_last_block():
    sched, kv = make(budget=4)
    parent, forks = group("a", range(8), n=2)  # 8 tokens = 2 full blocks, in 2 chunks
    sched.add_request(parent, forks)
    out, sampled = step(sched)
    assert out.num_scheduled_tokens == {"0_a": 4} and not out.forked_req_ids and not sampled
    out, sampled = step(sched)
    assert out.forked_req_ids == {"1_a": "0_a"} and set(sampled) == {"0_a", "1_a"}
    out, _ = step(sched)
    assert out.blocks_to_copy == []   # the last block was full: each writes a new block
    assert {s.request_id: s.block_table for s in out.scheduled} == {"0_a": [0, 1, 2], "1_a": [0, 1, 3]}


def test_group_admission_waits_for_room():
    sched, kv = make(max_num_seqs=3)
    other = Request("x", [1, 2, 3], SamplingParams(max_tokens=5), max_tokens=5)
    sched.add_request(other)
    parent, forks = group("a", range(5), n=3)
    sched.add_request(parent, forks)
    out, _ = step(sched)
    assert list(out.num_scheduled_tokens) == ["x"]   # 1 running + 3 samples > 3 seqs
    with pytest.raises(ValueError, match="max_num_seqs"):
        p, f = group("b", range(5), n=4)
        sched.add_request(p, f)


@pytest.mark.parametrize("when", [0, 1, 2])
def test_abort_mid_fork_frees_everything(when):
    sched, kv = make(budget=4)
    parent, forks = group("a", range(10), n=3)
    sched.add_request(parent, forks)
    for _ in range(when):
        step(sched)
    sched.finish_requests([r.request_id for r in [parent] + forks], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests() and sched.get_num_unfinished_requests() == 0
    kv.check_integrity(sched.requests)
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    out = sched.schedule()   # the worker forgets them
    assert {"0_a", "1_a", "2_a"} <= out.finished_req_ids


def test_parent_aborted_alone_leaves_forks_to_compute_the_prompt():
    sched, kv = make(budget=4)
    parent, forks = group("a", range(10), n=2)
    sched.add_request(parent, forks)
    step(sched)
    sched.finish_requests("0_a", RequestStatus.FINISHED_ABORTED)
    for _ in range(6):
        step(sched)
    assert forks[0].num_output_tokens == 3 and forks[0].is_finished()
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


def test_preempted_fork_recomputes_its_own_tokens():
    sched, kv = make(num_blocks=5, budget=64)   # 3 samples of 6 + 3 tokens do not fit 5 blocks
    parent, forks = group("a", range(100, 106), n=3, max_tokens=6)
    sched.add_request(parent, forks)
    toks = {"0_a": 20, "1_a": 21, "2_a": 22}
    for _ in range(30):
        if not sched.has_unfinished_requests():
            break
        step(sched, toks)
    assert sched.num_preemptions_total > 0
    assert [r.output_token_ids for r in [parent] + forks] == [[20] * 6, [21] * 6, [22] * 6]
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


def test_groups_filling_max_num_seqs_run():
    """Seats count the samples of admitted groups only: a group of max_num_seqs samples, and two
    groups that together fill max_num_seqs, both run (a waiting group's samples take no seat)."""
    sched, kv = make(max_num_seqs=8, num_blocks=64)
    for rid in "ab":
        parent, forks = group(rid, range(5), n=4)
        sched.add_request(parent, forks)
    out, sampled = step(sched)
    assert set(out.num_scheduled_tokens) == {"0_a", "0_b"} and len(sampled) == 8
    sched, kv = make(max_num_seqs=3)
    parent, forks = group("c", range(5), n=3)
    sched.add_request(parent, forks)
    while sched.has_unfinished_requests():
        step(sched)
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


def test_beam_group_takes_its_width_of_max_num_seqs():
    """A beam search of width 3 with max_num_seqs 4: its first beam enters with 3 seats reserved, so
    of two later single requests only one runs beside it, and the beams never push the running
    batch past max_num_seqs."""
    from pagedllm.engine.beam_search import BeamSearchManager, BeamSearchParams
    from pagedllm.outputs import Logprob

    class Tok:
        eos_token_id = None

        def decode(self, ids, skip_special_tokens=True):
            return ""

    sched, kv = make(max_num_seqs=4, num_blocks=32)
    mgr = BeamSearchManager(sched, Tok())
    mgr.add_request("q", None, [10, 11, 12], BeamSearchParams(3, 3), 0.0)
    for rid in "xy":
        sched.add_request(Request(rid, [1, 2, 3], SamplingParams(max_tokens=8), max_tokens=8))
    result, peak, ran = None, 0, set()
    while sched.has_unfinished_requests():
        out = sched.schedule()
        peak = max(peak, len(sched.running))
        ran |= set(out.num_scheduled_tokens)
        if "q" in mgr.instances:
            assert "y" not in out.num_scheduled_tokens
        ids = [r for r in out.num_scheduled_tokens if sched.requests[r].num_computed_tokens == sched.requests[r].num_tokens]
        tops = [{5 + i: Logprob(-0.1 * (i + 1), i + 1) for i in range(6)} for _ in ids]
        core = sched.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, sampled_token_ids=[5] * len(ids), sampled_logprobs=[0.0] * len(ids), top_logprobs=tops))
        kv.check_integrity(sched.requests)
        _, finished = mgr.process_outputs(core)
        result = finished[0] if finished else result
    assert peak == 4 and {"x", "y"} <= ran
    assert len(result.outputs) == 3
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


def test_waiting_groups_do_not_reserve_seqs():
    """Forks of parents that are still waiting take no seq: two n=3 groups fit max_num_seqs=6
    together, and 20 groups queued behind max_num_seqs=6 drain two at a time (counting every
    queued group's forks would admit nothing, ever)."""
    sched, kv = make(num_blocks=64, budget=256, max_num_seqs=6)
    for i in range(20):
        parent, forks = group(f"g{i}", range(100 + i, 104 + i), n=3, max_tokens=2)
        sched.add_request(parent, forks)
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"0_g0": 4, "0_g1": 4}
    assert sched.num_running == 6
    steps = 1
    while sched.has_unfinished_requests():
        step(sched)
        steps += 1
        assert steps < 100
    assert kv.num_free_blocks == kv.num_blocks
