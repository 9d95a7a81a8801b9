"""The scheduler's side of structured output, without torch or xgrammar: a fake grammar handle
(``core.request.StructuredOutputHandle``) shows WAITING_FOR_FSM, bitmask rows, matcher advance,
termination, and a failed compile."""

from __future__ import annotations

from pagedllm.config import SchedulerConfig
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched_output import ModelRunnerOutput
from pagedllm.core.scheduler import Scheduler
from pagedllm.sampling_params import SamplingParams


class FakeGrammar:
    """Ready when told; accepts tokens < 50; terminates after ``length`` tokens."""

    def __init__(self, length: int = 3) -> None:
        self.ready, self.error, self.accepted, self.length = False, None, [], length

    def is_ready(self) -> bool:
        return self.ready

    def accept_tokens(self, token_ids):
        self.accepted.extend(token_ids)
        return all(t < 50 for t in token_ids)

    def is_terminated(self) -> bool:
        return len(self.accepted) >= self.length


def _scheduler():
    kv = KVCacheManager(block_size=4, num_blocks=32)
    return Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64), kv)


def _request(rid, grammar=None, max_tokens=10):
    return Request(rid, [100, 101, 102, 103, 104], SamplingParams(max_tokens=max_tokens), max_tokens,
                   structured_output_request=grammar)


def _run(sched, out, token=7):
    ids = [rid for rid in out.num_scheduled_tokens]
    return sched.update_from_output(out, ModelRunnerOutput(req_ids=ids, sampled_token_ids=[token] * len(ids),
                                                           sampled_logprobs=[0.0] * len(ids),
                                                           top_logprobs=[None] * len(ids)))


def test_compiling_request_waits_without_blocking_the_queue():
    sched = _scheduler()
    grammar = FakeGrammar()
    sched.add_request(_request("g", grammar))
    sched.add_request(_request("plain"))
    assert sched.requests["g"].status == RequestStatus.WAITING_FOR_FSM
    assert RequestStatus.WAITING < RequestStatus.WAITING_FOR_FSM < RequestStatus.PREEMPTED
    assert not RequestStatus.is_finished(RequestStatus.WAITING_FOR_FSM)
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["plain"] and not out.structured_output_request_ids
    assert [r.request_id for r in sched.waiting] == ["g"]  # still first in line
    _run(sched, out)
    grammar.ready = True
    out = sched.schedule()
    assert list(out.num_scheduled_tokens) == ["plain", "g"]
    assert out.structured_output_request_ids == {"g": 0}  # its prefill reaches its last token: it samples
    assert sched.requests["g"].status == RequestStatus.RUNNING
    outputs = {o.request_id: o for o in _run(sched, out, token=9)}
    assert grammar.accepted == [9] and outputs["g"].finish_reason is None
    # The grammar ends after 3 tokens: finish reason "stop", no stop token.
    _run(sched, sched.schedule(), token=9)
    outputs = {o.request_id: o for o in _run(sched, sched.schedule(), token=9)}
    assert grammar.accepted == [9, 9, 9]
    assert outputs["g"].finish_reason == "stop" and outputs["g"].stop_reason is None
    assert "g" not in sched.requests


def test_non_final_prefill_chunk_gets_no_bitmask_row():
    kv = KVCacheManager(block_size=4, num_blocks=32)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=3, max_model_len=64), kv)
    grammar = FakeGrammar()
    grammar.ready = True
    sched.add_request(_request("g", grammar))
    first = sched.schedule()
    assert first.num_scheduled_tokens == {"g": 3} and not first.structured_output_request_ids
    sched.update_from_output(first, ModelRunnerOutput())  # a partial prefill samples nothing
    second = sched.schedule()
    assert second.num_scheduled_tokens == {"g": 2} and second.structured_output_request_ids == {"g": 0}


def test_failed_compile_finishes_the_request_as_aborted():
    sched = _scheduler()
    grammar = FakeGrammar()
    grammar.ready, grammar.error = True, "RuntimeError: boom"
    sched.add_request(_request("g", grammar))
    out = sched.schedule()
    assert out.is_empty and "g" not in sched.requests
    outputs = _run(sched, out)
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("g", "abort")]


def test_abort_while_compiling_leaves_nothing():
    sched = _scheduler()
    sched.add_request(_request("g", FakeGrammar()))
    sched.finish_requests("g", RequestStatus.FINISHED_ABORTED)
    assert not sched.waiting and "g" not in sched.requests
    assert sched.schedule().finished_req_ids == {"g"}


def test_forks_get_their_own_matcher_and_bitmask_row():
    """n = 3 with a grammar: the parent computes the prompt; at the fork each sample's own handle
    becomes ready (its matcher starts fresh) and has its own bitmask row for the parent's logits
    row; each handle then sees only its own sample's tokens."""
    sched = _scheduler()
    grammars = [FakeGrammar(length=5) for _ in range(3)]
    reqs = [_request(f"{i}_g", g) for i, g in enumerate(grammars)]
    sched.add_request(reqs[0], forks=reqs[1:])
    assert sched.schedule().num_scheduled_tokens == {}  # compiling: nothing runs
    for g in grammars:
        g.ready = True
    out = sched.schedule()
    assert out.num_scheduled_tokens == {"0_g": 5}
    assert out.forked_req_ids == {"1_g": "0_g", "2_g": "0_g"}
    assert out.structured_output_request_ids == {"0_g": 0, "1_g": 1, "2_g": 2}
    ids = ["0_g", "1_g", "2_g"]
    sched.update_from_output(out, ModelRunnerOutput(req_ids=ids, sampled_token_ids=[10, 11, 12],
                                                    sampled_logprobs=[0.0] * 3, top_logprobs=[None] * 3))
    assert [g.accepted for g in grammars] == [[10], [11], [12]]
    out = sched.schedule()
    assert sorted(out.structured_output_request_ids) == ids and len(set(out.structured_output_request_ids.values())) == 3


def test_preempted_or_aborted_request_has_no_bitmask_row_and_drops_its_handle():
    """A constrained request preempted (recompute or swap) leaves the step's bitmask rows; its
    handle keeps its accepted tokens (the outputs are kept, nothing to replay); on abort the
    scheduler holds no reference to the handle any more."""
    import gc
    import weakref

    for mode in ("recompute", "swap"):
        kv = KVCacheManager(block_size=4, num_blocks=4, num_cpu_blocks=8 if mode == "swap" else 0)
        sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=16,
                                          preemption_mode=mode), kv)
        a, b = FakeGrammar(length=99), FakeGrammar(length=99)
        a.ready = b.ready = True
        sched.add_request(_request("a", a, max_tokens=8))
        sched.add_request(_request("b", b, max_tokens=8))
        preempted = None
        for _ in range(6):
            out = sched.schedule()
            if out.preempted_req_ids:
                preempted = next(iter(out.preempted_req_ids))
                assert preempted not in out.structured_output_request_ids
                assert set(out.structured_output_request_ids) <= set(out.num_scheduled_tokens)
                break
            _run(sched, out, token=7)
        assert preempted == "b", mode
        assert sched.num_preemptions_by_mode[mode] == 1
        assert b.accepted == [7] * sched.get_request("b").num_output_tokens  # kept, not replayed
        ref = weakref.ref(b)
        del b
        sched.finish_requests("b", RequestStatus.FINISHED_ABORTED)
        gc.collect()
        assert ref() is None and sched.get_request("b") is None
