"""Scheduler without a model: tiny config (block_size=4, num_blocks=16), fake token ids, exact
token counts, block tables, statuses and preemptions."""

from __future__ import annotations

from typing import Callable

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.outputs import Logprob
from pagedllm.sampling_params import SamplingParams
from scheduler_mirror import MirroredScheduler

EOS = 2


def make_scheduler(block_size=4, num_blocks=16, max_num_seqs=8, max_num_batched_tokens=64,
                   max_model_len=64, enable_chunked_prefill=True):
    kv = KVCacheManager(block_size=block_size, num_blocks=num_blocks)
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens,
                          max_model_len=max_model_len,
                          enable_chunked_prefill=enable_chunked_prefill)
    return MirroredScheduler(cfg, kv), kv


def make_request(rid: str, prompt_len: int, max_tokens: int = 8, eos: bool = True,
                 **params) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, **params)
    if eos:
        sp.update_from_model([EOS])
    return Request(rid, list(range(100, 100 + prompt_len)), sp, max_tokens=max_tokens)


def fake_runner(out: SchedulerOutput, token: int | Callable[[str], int] = 7,
                **extra) -> ModelRunnerOutput:
    ids = [s.request_id for s in out.scheduled if s.sample]
    tok = token if callable(token) else (lambda _rid: token)
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=[tok(r) for r in ids],
                             sampled_logprobs=[-0.5] * len(ids), **extra)


def step(sched: Scheduler, token=7) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    out = sched.schedule()
    return out, sched.update_from_output(out, fake_runner(out, token))


def by_id(out: SchedulerOutput):
    return {s.request_id: s for s in out.scheduled}


def run_to_completion(sched: Scheduler, token=7, max_steps=1000,
                      tokens: dict[str, list[int]] | None = None) -> dict[str, list[int]]:
    """Step until nothing is left; returns (or extends) request id -> tokens streamed out."""
    tokens = {} if tokens is None else tokens
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return tokens
        _, outs = step(sched, token)
        for o in outs:
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    raise AssertionError("requests did not finish")


def test_hand_worked_prefill_then_decode():
    sched, kv = make_scheduler()
    r = make_request("a", 10, max_tokens=8)
    sched.add_request(r)
    assert sched.num_waiting == 1 and sched.num_running == 0

    out, outs = step(sched, token=50)
    s = by_id(out)["a"]
    assert s.num_scheduled_tokens == 10 and out.total_num_scheduled_tokens == 10
    assert s.token_ids == list(range(100, 110)) and s.num_computed_tokens == 0
    assert s.block_table == [0, 1, 2]  # 10 tokens at block_size 4 -> 3 blocks
    assert s.sample and s.resumed
    assert r.status == RequestStatus.RUNNING and r.first_scheduled_time is not None
    assert kv.num_free_blocks == 13
    assert [o.new_token_ids for o in outs] == [[50]] and outs[0].new_logprobs == [-0.5]
    assert r.num_computed_tokens == 10 and r.num_tokens == 11

    # Tokens 11 and 12 (positions 10, 11) fit block 2.
    for pos, tok in ((10, 51), (11, 52)):
        out, _ = step(sched, token=tok)
        s = by_id(out)["a"]
        assert (s.num_scheduled_tokens, s.num_computed_tokens) == (1, pos)
        assert s.token_ids == [r.all_token_ids[pos]] and not s.resumed and s.sample
        assert s.block_table == [0, 1, 2]
    # Token 13 (position 12) needs a 4th block.
    out, _ = step(sched, token=53)
    s = by_id(out)["a"]
    assert s.num_computed_tokens == 12 and s.token_ids == [52]
    assert s.block_table == [0, 1, 2, 3] and kv.num_free_blocks == 12
    assert r.output_token_ids == [50, 51, 52, 53]
    assert r.cumulative_logprob == pytest.approx(-2.0)

    tokens = run_to_completion(sched)
    assert len(r.output_token_ids) == 8 and len(tokens["a"]) == 4
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert kv.num_free_blocks == 16 and sched.get_request("a") is None
    out = sched.schedule()
    assert out.is_empty and out.finished_req_ids == {"a"}
    assert sched.schedule().finished_req_ids == set()


def test_block_tables_are_copies():
    sched, kv = make_scheduler()
    sched.add_request(make_request("a", 4))
    out = sched.schedule()
    out.scheduled[0].block_table.append(99)
    assert kv.get_block_table("a") == [0]


def test_chunked_prefill_splits_8_8_4_and_only_last_chunk_samples():
    sched, kv = make_scheduler(max_num_batched_tokens=8)
    r = make_request("a", 20, max_tokens=2)
    sched.add_request(r)
    expected = [(0, 8, False, [0, 1]), (8, 8, False, [0, 1, 2, 3]), (16, 4, True, [0, 1, 2, 3, 4])]
    for start, n, sample, table in expected:
        out, outs = step(sched)
        s = by_id(out)["a"]
        assert (s.num_computed_tokens, s.num_scheduled_tokens, s.sample) == (start, n, sample)
        assert s.token_ids == list(range(100 + start, 100 + start + n))
        assert s.block_table == table
        assert s.resumed == (start == 0)
        assert [o.new_token_ids for o in outs] == ([[7]] if sample else [])
    assert r.num_output_tokens == 1
    out, _ = step(sched)
    assert by_id(out)["a"].num_scheduled_tokens == 1
    assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED and kv.num_free_blocks == 16


def test_decodes_go_first_and_prefill_takes_the_rest_of_the_budget():
    sched, _ = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_request("a", 4, max_tokens=20))
    step(sched)  # a prefilled
    sched.add_request(make_request("b", 20, max_tokens=2))
    chunks = []
    for _ in range(3):
        out, _ = step(sched)
        assert out.scheduled[0].request_id == "a" and out.scheduled[0].num_scheduled_tokens == 1
        assert out.total_num_scheduled_tokens <= 8
        chunks.append(by_id(out)["b"].num_scheduled_tokens)
    assert chunks == [7, 7, 6]  # b's last chunk samples, and a decoded every step
    out, _ = step(sched)
    assert {s.request_id: s.num_scheduled_tokens for s in out.scheduled} == {"a": 1, "b": 1}


def test_max_num_seqs_respected():
    sched, _ = make_scheduler(max_num_seqs=2)
    for rid in "abc":
        sched.add_request(make_request(rid, 4, max_tokens=3))
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["a", "b"]
    assert sched.num_running == 2 and sched.num_waiting == 1
    step(sched)
    out, _ = step(sched)  # a and b finish here (3 tokens)
    assert len(out.scheduled) == 2 and sched.num_running == 0
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["c"] and out.finished_req_ids == {"a", "b"}


def test_waiting_queue_is_fcfs_no_skipping():
    sched, _ = make_scheduler(num_blocks=4)
    sched.add_request(make_request("a", 12, max_tokens=1))  # 3 blocks
    sched.add_request(make_request("b", 8, max_tokens=1))  # 2 blocks: does not fit
    sched.add_request(make_request("c", 2, max_tokens=1))  # would fit, but must wait behind b
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["a"]
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["b", "c"]


def test_without_chunked_prefill_a_prompt_waits_for_room():
    sched, _ = make_scheduler(max_num_batched_tokens=16, max_model_len=16,
                              enable_chunked_prefill=False)
    sched.add_request(make_request("a", 10, max_tokens=4))
    sched.add_request(make_request("b", 10, max_tokens=4))
    out, _ = step(sched)
    assert [(s.request_id, s.num_scheduled_tokens) for s in out.scheduled] == [("a", 10)]
    out, _ = step(sched)
    assert [(s.request_id, s.num_scheduled_tokens) for s in out.scheduled] == [("a", 1), ("b", 10)]


def test_preemption_latest_admitted_recomputes_and_everything_finishes():
    # 6 blocks x 4 tokens; three 8-token prompts fill the pool after the first step.
    sched, kv = make_scheduler(num_blocks=6, max_model_len=24)
    reqs = {rid: make_request(rid, 8, max_tokens=8) for rid in "abc"}
    for r in reqs.values():
        sched.add_request(r)
    tokens: dict[str, list[int]] = {}
    out, outs = step(sched)
    assert [s.request_id for s in out.scheduled] == ["a", "b", "c"] and kv.num_free_blocks == 0
    for o in outs:
        tokens.setdefault(o.request_id, []).extend(o.new_token_ids)

    # a's decode (position 8) needs a 3rd block: c, the latest admitted, is preempted and a
    # and b each take one of its blocks.
    out, outs = step(sched)
    for o in outs:
        tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert out.preempted_req_ids == {"c"}
    assert [s.request_id for s in out.scheduled] == ["a", "b"]
    c = reqs["c"]
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and sched.waiting[0] is c
    assert kv.get_block_table("c") == []
    assert sched.num_preemptions_total == 1 and sched.make_stats().num_preemptions == 1
    assert len(c.output_token_ids) == 1  # its token from step 1 is kept

    # c freed its table tail first, so block 5 is reused before block 4.
    assert kv.get_block_table("a") == [0, 1, 5] and kv.get_block_table("b") == [2, 3, 4]
    run_to_completion(sched, tokens=tokens)
    for rid, r in reqs.items():
        assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
        assert r.num_output_tokens == 8 and tokens[rid] == r.output_token_ids
    assert sched.num_preemptions_total >= 1
    assert kv.num_free_blocks == 6
    kv.check_integrity()


def test_resumed_request_recomputes_prompt_and_outputs():
    sched, kv = make_scheduler(num_blocks=4, max_model_len=16)
    a = make_request("a", 8, max_tokens=4)
    b = make_request("b", 7, max_tokens=2)
    sched.add_request(a)
    sched.add_request(b)
    step(sched, token=60)  # a: 2 blocks, b: 2 blocks, pool full
    out, _ = step(sched, token=61)  # a needs a 3rd block -> b preempted (b had 8 tokens, 2 blocks)
    assert out.preempted_req_ids == {"b"} and b.status == RequestStatus.PREEMPTED
    # b cannot come back while a runs (pool has 1 free block, b needs 2).
    while a.status == RequestStatus.RUNNING:
        out, _ = step(sched, token=62)
        assert "b" not in by_id(out) or out.preempted_req_ids
    out, _ = step(sched, token=63)
    s = by_id(out)["b"]
    assert s.resumed and s.num_computed_tokens == 0
    assert s.token_ids == list(range(100, 107)) + [60]  # prompt + the output it already had
    assert s.sample
    assert b.status == RequestStatus.FINISHED_LENGTH_CAPPED and b.output_token_ids == [60, 63]
    assert kv.num_free_blocks == 4


def test_abort_frees_blocks_at_once_and_late_output_is_ignored():
    sched, kv = make_scheduler()
    a, b = make_request("a", 10), make_request("b", 5)
    sched.add_request(a)
    sched.add_request(b)
    out = sched.schedule()
    assert kv.num_free_blocks == 16 - 3 - 2
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert kv.num_free_blocks == 14 and a.status == RequestStatus.FINISHED_ABORTED
    assert sched.num_running == 1 and sched.get_request("a") is None
    outs = sched.update_from_output(out, fake_runner(out))  # late output for a
    assert [o.request_id for o in outs] == ["b"] and a.output_token_ids == []
    out = sched.schedule()
    assert "a" in out.finished_req_ids and [s.request_id for s in out.scheduled] == ["b"]
    # abort a waiting request, an unknown one, and a list
    sched.add_request(make_request("c", 3))
    sched.finish_requests(["c", "nope", "b"], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests() and kv.num_free_blocks == 16
    assert sched.schedule().finished_req_ids == {"b", "c"}
    with pytest.raises(ValueError):
        sched.finish_requests("a", RequestStatus.RUNNING)


def _finish_with(tokens: list[int], **kw) -> Request:
    sched, kv = make_scheduler()
    r = make_request("a", 3, **kw)
    sched.add_request(r)
    it = iter(tokens)
    finished = []
    while sched.has_unfinished_requests():
        _, outs = step(sched, token=lambda _rid: next(it))
        finished += [o for o in outs if o.finished]
    assert kv.num_free_blocks == 16
    assert len(finished) == 1
    assert finished[0].finish_reason == r.get_finished_reason()
    assert finished[0].stop_reason == r.stop_reason
    return r


def test_eos_stops():
    r = _finish_with([5, 6, EOS, 9], max_tokens=8)
    assert r.output_token_ids == [5, 6, EOS]
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason is None   # the EOS: None, as vLLM
    assert r.get_finished_reason() == "stop"


def test_stop_reason_is_none_for_the_tokenizer_eos_only():
    """vLLM's rule: the tokenizer's EOS (the first EOS id) gives stop_reason None; the generation
    config's extra EOS ids and stop_token_ids give their id (vLLM adds the extras to
    stop_token_ids)."""
    for last, want in ((EOS, None), (13, 13), (11, 11)):
        sched, _ = make_scheduler()
        sp = SamplingParams(max_tokens=8, stop_token_ids=[11])
        sp.update_from_model([EOS, 13])
        r = Request("a", [100, 101, 102], sp, max_tokens=8)
        sched.add_request(r)
        tokens = iter([5, last, 9])
        while sched.has_unfinished_requests():
            step(sched, token=lambda _rid: next(tokens))
        assert r.output_token_ids == [5, last] and r.get_finished_reason() == "stop"
        assert r.stop_reason == want


def test_ignore_eos():
    r = _finish_with([EOS, EOS, EOS], max_tokens=3, ignore_eos=True)
    assert r.output_token_ids == [EOS] * 3 and r.get_finished_reason() == "length"


def test_stop_token_ids():
    r = _finish_with([5, 11, 6], max_tokens=8, stop_token_ids=[11])
    assert r.output_token_ids == [5, 11] and r.stop_reason == 11
    r = _finish_with([5, 11, 6], max_tokens=8, stop_token_ids=[11], ignore_eos=True)
    assert r.output_token_ids == [5, 11]  # stop_token_ids stop even with ignore_eos


def test_min_tokens():
    r = _finish_with([EOS, EOS, EOS, 9], max_tokens=8, min_tokens=3)
    assert r.output_token_ids == [EOS, EOS, EOS] and r.status == RequestStatus.FINISHED_STOPPED


def test_max_tokens_and_eos_on_last_token():
    r = _finish_with([5, 6, 7, 8], max_tokens=3)
    assert r.output_token_ids == [5, 6, 7] and r.get_finished_reason() == "length"
    assert r.stop_reason is None
    r = _finish_with([5, 6, EOS], max_tokens=3)
    assert r.get_finished_reason() == "stop"  # a stop token wins over the length cap


def test_max_model_len_caps():
    sched, kv = make_scheduler(max_model_len=12)
    r = make_request("a", 10, max_tokens=100)
    sched.add_request(r)
    run_to_completion(sched)
    assert r.num_output_tokens == 2 and r.num_tokens == 12
    assert r.get_finished_reason() == "length" and kv.num_free_blocks == 16


def test_prompt_logprobs_pass_through_and_are_not_repeated_after_recompute():
    sched, kv = make_scheduler(num_blocks=4, max_model_len=16, max_num_batched_tokens=6)
    a = make_request("a", 8, max_tokens=2)
    b = make_request("b", 8, max_tokens=2, prompt_logprobs=1)
    sched.add_request(a)
    sched.add_request(b)

    def lp(n):
        return [{1: Logprob(-1.0)} for _ in range(n)]

    delivered = []
    for _ in range(50):
        if not sched.has_unfinished_requests():
            break
        out = sched.schedule()
        plps = {s.request_id: lp(s.num_scheduled_tokens) for s in out.scheduled
                if s.request_id == "b" and s.num_computed_tokens < 8}
        outs = sched.update_from_output(out, fake_runner(out, prompt_logprobs=plps))
        for o in outs:
            if o.request_id == "b":
                assert o.new_prompt_logprobs is not None or o.new_token_ids
                if o.new_prompt_logprobs:
                    delivered += o.new_prompt_logprobs
                    if not o.new_token_ids:
                        assert not by_id(out)["b"].sample  # a non-sampling chunk still reports
    assert b.num_preemptions >= 1
    assert len(delivered) == 8  # once per prompt position despite the recompute
    assert kv.num_free_blocks == 4


def test_add_request_validation():
    sched, _ = make_scheduler(max_model_len=8)
    sched.add_request(make_request("a", 4))
    with pytest.raises(ValueError, match="already"):
        sched.add_request(make_request("a", 4))
    with pytest.raises(ValueError, match="max_model_len"):
        sched.add_request(make_request("b", 9))


def test_runner_sampling_for_a_non_sampling_request_is_an_error():
    sched, _ = make_scheduler(max_num_batched_tokens=4)
    sched.add_request(make_request("a", 10))
    out = sched.schedule()
    with pytest.raises(RuntimeError):
        sched.update_from_output(out, ModelRunnerOutput(req_ids=["a"], sampled_token_ids=[1]))


def test_make_stats():
    sched, _ = make_scheduler(max_num_batched_tokens=8)
    sched.add_request(make_request("a", 4, max_tokens=5))
    step(sched)
    sched.add_request(make_request("b", 12))
    sched.add_request(make_request("c", 12))
    step(sched)
    st = sched.make_stats()
    assert (st.num_running, st.num_waiting) == (2, 1)
    assert (st.num_scheduled_tokens, st.num_decode_tokens, st.num_prefill_tokens) == (8, 1, 7)
    assert st.num_scheduled_requests == 2 and st.num_preemptions == 0
    assert st.kv_cache_usage == pytest.approx((2 + 2) / 16)
    assert st.num_blocks == 16 and st.num_free_blocks == 12


def test_a_prompt_is_admitted_only_when_all_of_it_fits_beside_the_running():
    # 8 blocks x 4 tokens, 8-token chunks. a (8-token prompt, 8 outputs) runs; b's 28-token
    # prompt needs 7 blocks: its first chunk (2 blocks) would fit the 6 free ones, but its later
    # chunks would not, so admitting it would preempt a (vLLM V0's can_allocate rule).
    sched, kv = make_scheduler(num_blocks=8, max_num_batched_tokens=8, max_model_len=40)
    a = make_request("a", 8, max_tokens=8, eos=False)
    b = make_request("b", 28, max_tokens=2, eos=False)
    sched.add_request(a)
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["a"] and kv.num_free_blocks == 6
    sched.add_request(b)
    seen_b = False
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        ids = [s.request_id for s in out.scheduled]
        if "b" in ids:
            if not seen_b:
                assert a.is_finished() and ids == ["b"]   # b starts alone, after a
            seen_b = True
        else:
            assert ids == ["a"]
        assert not out.preempted_req_ids
        kv.check_integrity()
    assert seen_b and sched.num_preemptions_total == 0
    assert a.num_output_tokens == 8 and b.num_output_tokens == 2 and kv.num_free_blocks == 8


def test_a_prompt_whose_tail_fits_beside_the_running_is_admitted_in_chunks():
    # Same pool; b's 20-token prompt needs 5 blocks of the 6 free: it joins a at once.
    sched, kv = make_scheduler(num_blocks=8, max_num_batched_tokens=8, max_model_len=40)
    a = make_request("a", 8, max_tokens=4, eos=False)
    b = make_request("b", 20, max_tokens=2, eos=False)
    sched.add_request(a)
    step(sched)
    sched.add_request(b)
    out, _ = step(sched)
    assert [(s.request_id, s.num_scheduled_tokens) for s in out.scheduled] == [("a", 1), ("b", 7)]
    run_to_completion(sched)
    assert sched.num_preemptions_total == 0 and kv.num_free_blocks == 8
