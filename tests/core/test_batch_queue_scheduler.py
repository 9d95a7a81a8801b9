"""The scheduler with batches in flight (pipeline parallelism's batch queue), without a model:
``schedule()`` runs again before the previous batch's output is back. A request in a batch in
flight is neither scheduled again nor preempted; tokens equal those of one batch at a time."""

from __future__ import annotations

import pytest

from pagedllm.core.request import RequestStatus
from pagedllm.core.scheduler import Scheduler
from test_scheduler import fake_runner, make_request, make_scheduler


def _token(sched: Scheduler):
    """A made-up sampler that depends on what the request holds (id and length), so a token
    computed from a stale or out-of-order state would differ."""
    return lambda rid: 10 + (sum(map(ord, rid)) * 7 + sched.requests[rid].num_tokens) % 50


def _run(sched: Scheduler, depth: int) -> tuple[dict[str, list[int]], list[list[str]]]:
    """Drive ``sched`` keeping up to ``depth`` batches in flight (the engine's loop); returns the
    tokens per request and each non-empty batch's request ids."""
    tokens: dict[str, list[int]] = {}
    batches: list[list[str]] = []
    queue = []
    for _ in range(500):
        if not sched.has_unfinished_requests() and not queue:
            break
        if len(queue) < depth:
            out = sched.schedule()
            if not out.is_empty or not queue:
                queue.append((out, fake_runner(out, _token(sched))))
                if not out.is_empty:
                    batches.append(list(out.num_scheduled_tokens))
                if not out.is_empty and len(queue) < depth:
                    continue
        out, runner_out = queue.pop(0)
        for o in sched.update_from_output(out, runner_out):
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    return tokens, batches


def _add(sched: Scheduler, n: int, prompt_len: int = 6, max_tokens: int = 5) -> None:
    for i in range(n):
        sched.add_request(make_request(f"r{i}", prompt_len + i % 3, max_tokens=max_tokens, eos=False))


def test_two_batches_in_flight_hold_disjoint_requests_and_give_the_same_tokens():
    sync, _ = make_scheduler(num_blocks=32, max_num_batched_tokens=14)
    _add(sync, 6)
    want, _ = _run(sync, depth=1)

    sched, kv = make_scheduler(num_blocks=32, max_num_batched_tokens=14)
    _add(sched, 6)
    first = sched.schedule()        # r0 (6) + r1 (7): 13 of 14 tokens, r2's 8 do not fit (chunk of 1)
    assert first.num_scheduled_tokens == {"r0": 6, "r1": 7, "r2": 1}
    assert sched.num_in_flight == 3
    second = sched.schedule()       # before the first's output: the rest of r2 may not run, r3.. may
    assert set(second.num_scheduled_tokens).isdisjoint(first.num_scheduled_tokens)
    assert second.num_scheduled_tokens == {"r3": 6, "r4": 7, "r5": 1}
    third = sched.schedule()        # everyone is in flight: nothing
    assert third.is_empty
    sched.update_from_output(first, fake_runner(first, _token(sched)))
    assert sched.num_in_flight == 3
    fourth = sched.schedule()       # r0 and r1 decode, r2's prompt goes on; r3..r5 still in flight
    assert fourth.num_scheduled_tokens == {"r0": 1, "r1": 1, "r2": 7}
    sched.update_from_output(second, fake_runner(second, _token(sched)))
    sched.update_from_output(third, fake_runner(third, _token(sched)))
    sched.update_from_output(fourth, fake_runner(fourth, _token(sched)))
    _run(sched, depth=2)
    assert not sched.has_unfinished_requests() and kv.num_free_blocks == kv.num_blocks

    sched, kv = make_scheduler(num_blocks=32, max_num_batched_tokens=14)
    _add(sched, 6)
    got, batches = _run(sched, depth=2)
    assert got == want and all(len(t) == 5 for t in got.values())
    assert kv.num_free_blocks == kv.num_blocks and sched.num_in_flight == 0
    # Consecutive batches never share a request (each request is in one batch at a time).
    assert all(set(a).isdisjoint(b) for a, b in zip(batches, batches[1:]))


def test_a_request_in_flight_is_not_preempted():
    # 4 blocks of 4: r0 and r1 (8 tokens each) fill the pool, one batch each (budget 8).
    sched, kv = make_scheduler(num_blocks=4, max_num_batched_tokens=8, max_model_len=16)
    sched.add_request(make_request("r0", 8, max_tokens=4, eos=False))
    sched.add_request(make_request("r1", 8, max_tokens=4, eos=False))
    first, second = sched.schedule(), sched.schedule()
    assert list(first.num_scheduled_tokens) == ["r0"] and list(second.num_scheduled_tokens) == ["r1"]
    assert kv.num_free_blocks == 0
    sched.update_from_output(first, fake_runner(first))
    # r0's next token needs a 3rd block. One batch at a time would preempt r1 (admitted last), but
    # r1 is in flight: r0 preempts itself and r1 keeps its blocks.
    third = sched.schedule()
    assert third.preempted_req_ids == {"r0"} and third.is_empty
    assert sched.requests["r1"].status == RequestStatus.RUNNING
    assert sched.requests["r0"].status == RequestStatus.PREEMPTED
    assert len(kv.get_block_table("r1")) == 2
    sched.update_from_output(second, fake_runner(second))
    sched.update_from_output(third, fake_runner(third))
    tokens, _ = _run(sched, depth=2)
    assert len(tokens["r0"]) == len(tokens["r1"]) == 3   # the first token of each came above
    assert kv.num_free_blocks == kv.num_blocks


def test_an_id_still_in_flight_cannot_be_reused():
    sched, _ = make_scheduler()
    sched.add_request(make_request("a", 6))
    out = sched.schedule()
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    with pytest.raises(ValueError, match="'a' is still in a batch in flight"):
        sched.add_request(make_request("a", 6))
    sched.update_from_output(out, fake_runner(out))   # the late output is ignored
    sched.add_request(make_request("a", 6))           # and the id is free again


def test_with_two_batches_in_flight_a_batch_takes_half_the_requests():
    from pagedllm.config import SchedulerConfig
    from pagedllm.core.kv_cache_manager import KVCacheManager
    from scheduler_mirror import MirroredScheduler

    sched = MirroredScheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64),
                      KVCacheManager(block_size=4, num_blocks=32), max_concurrent_batches=2)
    _add(sched, 5)
    first, second = sched.schedule(), sched.schedule()   # ceil(5 / 2) = 3, then the other 2
    assert list(first.num_scheduled_tokens) == ["r0", "r1", "r2"]
    assert list(second.num_scheduled_tokens) == ["r3", "r4"]
    sched.update_from_output(first, fake_runner(first, _token(sched)))
    third = sched.schedule()
    assert list(third.num_scheduled_tokens) == ["r0", "r1", "r2"]   # decodes, the same split
    for out in (second, third):
        sched.update_from_output(out, fake_runner(out, _token(sched)))
    _, batches = _run(sched, depth=2)
    assert all(len(b) <= 3 for b in batches) and not sched.has_unfinished_requests()
