"""Randomized scheduler soak: random prompts, max_tokens, fake EOS, aborts and a small pool.

A fake model runner keeps a fake paged KV cache (slot -> (request, position, token)) written
through the block tables, so a block handed to two live requests, a stale table, or a wrong
chunk shows up as a read-back mismatch. Budgets and pool integrity are checked every step;
at the end every request has finished with the right number of tokens and no block leaked.
"""

from __future__ import annotations

import random

import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager, cdiv
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams
from scheduler_mirror import MirroredScheduler

EOS = 0


class FakeRunner:
    """Writes each scheduled token into its slot and checks earlier positions read back."""

    def __init__(self, block_size: int, rng: random.Random, eos_prob: float) -> None:
        self.block_size = block_size
        self.rng = rng
        self.eos_prob = eos_prob
        self.kv: dict[int, tuple[str, int, int]] = {}

    def slot(self, table: list[int], pos: int) -> int:
        return table[pos // self.block_size] * self.block_size + pos % self.block_size

    def execute(self, out: SchedulerOutput, requests: dict[str, Request]) -> ModelRunnerOutput:
        req_ids, tokens = [], []
        for s in out.scheduled:
            r = requests[s.request_id]
            start, n = s.num_computed_tokens, s.num_scheduled_tokens
            assert len(s.block_table) * self.block_size >= start + n
            assert s.token_ids == r.all_token_ids[start:start + n]
            for i, tok in enumerate(s.token_ids):
                self.kv[self.slot(s.block_table, start + i)] = (s.request_id, start + i, tok)
            # Attention would read every earlier position of this request: they must be intact.
            for pos in range(start + n):
                assert self.kv[self.slot(s.block_table, pos)] == (
                    s.request_id, pos, r.all_token_ids[pos]), (s.request_id, pos)
            if s.sample:
                req_ids.append(s.request_id)
                tokens.append(EOS if self.rng.random() < self.eos_prob else self.rng.randint(1, 9))
        return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=tokens,
                                 sampled_logprobs=[-1.0] * len(req_ids))


def soak(seed: int) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([1, 2, 4, 8])
    max_model_len = rng.randint(8, 64)
    num_blocks = cdiv(max_model_len, block_size) + rng.randint(0, 8)  # a request always fits
    chunked = rng.random() < 0.8
    max_num_batched_tokens = (rng.randint(1, 48) if chunked
                              else rng.randint(max_model_len, max_model_len + 16))
    max_num_seqs = rng.randint(1, 8)
    kv = KVCacheManager(block_size=block_size, num_blocks=num_blocks)
    sched = MirroredScheduler(SchedulerConfig(max_num_seqs=max_num_seqs,
                                      max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len,
                                      enable_chunked_prefill=chunked), kv)
    runner = FakeRunner(block_size, rng, eos_prob=rng.choice([0.0, 0.05, 0.2]))

    num_requests = rng.randint(1, 24)
    pending: list[Request] = []
    for i in range(num_requests):
        prompt_len = rng.randint(1, max_model_len)
        room = max_model_len - prompt_len
        # Usually resolved as the engine does (<= room); sometimes larger, capped by max_model_len.
        max_tokens = rng.randint(1, max(room, 1) + (4 if rng.random() < 0.3 else 0))
        sp = SamplingParams(max_tokens=max_tokens, min_tokens=rng.randint(0, min(max_tokens, 3)),
                            ignore_eos=rng.random() < 0.2,
                            stop_token_ids=[9] if rng.random() < 0.2 else None)
        sp.update_from_model([EOS])
        pending.append(Request(f"r{i}", [rng.randint(1, 9) for _ in range(prompt_len)], sp,
                               max_tokens=max_tokens))

    all_reqs = {r.request_id: r for r in pending}
    streamed: dict[str, list[int]] = {rid: [] for rid in all_reqs}
    finish_outputs: dict[str, str] = {}
    aborted: set[str] = set()
    reported_finished: set[str] = set()
    for _ in range(5000):
        # Random arrivals.
        while pending and rng.random() < 0.5:
            sched.add_request(pending.pop(0))
        # Random aborts.
        if sched.has_unfinished_requests() and rng.random() < 0.03:
            victim = rng.choice(list(sched.requests))
            sched.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            aborted.add(victim)
            kv.check_integrity()
        if not sched.has_unfinished_requests() and not pending:
            break
        had_work = sched.has_unfinished_requests()
        live = dict(sched.requests)
        out = sched.schedule()
        reported_finished |= out.finished_req_ids

        # Budgets and shape of the step.
        ns = [s.num_scheduled_tokens for s in out.scheduled]
        assert all(n >= 1 for n in ns)
        assert sum(ns) == out.total_num_scheduled_tokens <= max_num_batched_tokens
        assert len(out.scheduled) <= max_num_seqs and sched.num_running <= max_num_seqs
        ids = [s.request_id for s in out.scheduled]
        assert len(set(ids)) == len(ids)
        assert not set(ids) & out.preempted_req_ids
        if had_work:
            assert out.scheduled, "no progress with unfinished requests"
        tables = [set(s.block_table) for s in out.scheduled]
        assert sum(map(len, tables)) == len(set().union(*tables)), "blocks shared between requests"
        for s in out.scheduled:
            r = live[s.request_id]
            assert s.resumed == (s.num_computed_tokens == 0)
            assert s.sample == (r.num_computed_tokens == r.num_tokens)
            assert len(s.block_table) == cdiv(r.num_computed_tokens, block_size)
            if not chunked:
                assert s.num_computed_tokens + s.num_scheduled_tokens == r.num_tokens
        kv.check_integrity()

        runner_out = runner.execute(out, live)
        # Sometimes an abort lands between the forward and the update: its output is dropped.
        if runner_out.req_ids and rng.random() < 0.03:
            victim = rng.choice(runner_out.req_ids)
            sched.finish_requests(victim, RequestStatus.FINISHED_ABORTED)
            aborted.add(victim)
        for o in sched.update_from_output(out, runner_out):
            assert o.request_id not in finish_outputs
            streamed[o.request_id] += o.new_token_ids
            if o.finished:
                finish_outputs[o.request_id] = o.finish_reason
        kv.check_integrity()
    else:
        raise AssertionError("soak did not finish")

    reported_finished |= sched.schedule().finished_req_ids
    assert kv.num_free_blocks == num_blocks and not kv.block_tables
    assert not sched.requests and sched.num_running == sched.num_waiting == 0
    assert reported_finished == set(all_reqs)
    for rid, r in all_reqs.items():
        assert r.is_finished()
        assert streamed[rid] == r.output_token_ids
        if rid in aborted:
            assert r.status == RequestStatus.FINISHED_ABORTED and rid not in finish_outputs
            continue
        assert finish_outputs[rid] == r.get_finished_reason()
        stops = r.sampling_params.all_stop_token_ids
        min_tokens = r.sampling_params.min_tokens
        # No stop token was passed over once it was allowed.
        for i, tok in enumerate(r.output_token_ids[:-1]):
            assert not (i + 1 >= min_tokens and tok in stops)
        if r.status == RequestStatus.FINISHED_STOPPED:
            assert r.output_token_ids[-1] in stops and r.num_output_tokens >= min_tokens
            eos = r.sampling_params.eos_token_ids
            primary_eos = not r.sampling_params.ignore_eos and eos and r.output_token_ids[-1] == eos[0]
            assert r.stop_reason == (None if primary_eos else r.output_token_ids[-1])
        else:
            assert r.status == RequestStatus.FINISHED_LENGTH_CAPPED
            # A prompt of max_model_len tokens still gets one token (whose K/V is never needed).
            assert r.num_output_tokens == min(r.max_tokens,
                                              max(1, max_model_len - r.num_prompt_tokens))


@pytest.mark.parametrize("seed", range(60))
def test_scheduler_soak(seed):
    soak(seed)
