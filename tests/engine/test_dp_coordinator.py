"""The data-parallel load balancer without processes: least load first (in flight, then KV usage),
prefix affinity within the margin, dead replicas out of rotation; and LLM(data_parallel_size=2)
equals data_parallel_size=1 with the batch spread evenly, a beam search included (one replica)."""

from __future__ import annotations

import pytest

from pagedllm import SamplingParams
from pagedllm.core.kv_cache_utils import hash_request_tokens
from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.engine.dp_coordinator import PREFIX_AFFINITY_MARGIN, DPLoadBalancer


def test_least_load_then_kv_usage_not_round_robin():
    lb = DPLoadBalancer(3, block_size=4, enable_prefix_affinity=False)
    lb.assign("a", 0, [1, 2, 3])
    lb.assign("b", 1, [1, 2, 3])
    assert lb.choose([9]) == 2                     # the only idle replica
    lb.assign("c", 2, [9])
    lb.update_kv_usage(0, 0.5)
    lb.update_kv_usage(1, 0.1)
    lb.update_kv_usage(2, 0.3)
    assert lb.choose([9]) == 1                     # equal in flight: lower KV usage
    lb.finish("a")
    assert lb.choose([9]) == 0                     # fewer in flight beats KV usage
    assert [r.num_served for r in lb.replicas] == [1, 1, 1]


def test_prefix_affinity_within_the_margin():
    lb = DPLoadBalancer(2, block_size=4)
    shared = list(range(100, 116))                 # 4 full blocks
    lb.assign("s0", 1, shared + [1])
    # Replica 1 holds the prefix and carries 1 more request than replica 0: it still wins.
    assert lb.choose(shared + [2]) == 1
    for i in range(PREFIX_AFFINITY_MARGIN):
        lb.assign(f"x{i}", 1, [50 + i])
    # Now PREFIX_AFFINITY_MARGIN + 1 more than replica 0: load wins.
    assert lb.choose(shared + [3]) == 0
    assert lb.choose([7, 7, 7, 7, 8]) == 0         # no match: least load
    # The hashes are the prefix cache's content hashes (same in every process).
    assert lb.prefix_hashes(shared + [1]) == hash_request_tokens(4, shared)


def test_dead_replica_is_out_of_rotation():
    lb = DPLoadBalancer(2, block_size=4)
    lb.assign("a", 1, [1, 2, 3, 4])
    lb.assign("b", 1, [1, 2, 3, 4])
    assert lb.mark_dead(1) == ["a", "b"]
    assert lb.owner("a") is None and lb.alive() == [0]
    assert lb.choose([1, 2, 3, 4]) == 0
    lb.mark_dead(0)
    with pytest.raises(RuntimeError, match="no data-parallel replica is alive"):
        lb.choose([1])


@pytest.mark.multiprocess   # spawns replica processes (~15 s each start on two shared cores)
@pytest.mark.timeout(300)
def test_offline_llm_dp2_equals_dp1_and_spreads_the_batch(make_tiny_checkpoint):
    from pagedllm.entrypoints.llm import LLM

    folder = make_tiny_checkpoint("llama")
    prompts = [[5 + i % 7, 9, 13, 200 - i, 17, 3, 40 + i] for i in range(16)]
    params = [SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=6, ignore_eos=True)] * 8
    kwargs = dict(dtype="float32", max_model_len=128, block_size=8, kv_cache_memory_bytes=4 << 20)
    beam = BeamSearchParams(beam_width=3, max_tokens=5, ignore_eos=True)
    single = LLM(folder, **kwargs)
    want = [o.outputs[0].token_ids for o in single.generate(prompts, params, use_tqdm=False)]
    want_beams = [[(s.tokens, round(s.cum_logprob, 4)) for s in o.sequences]
                  for o in single.beam_search([{"prompt_token_ids": p} for p in prompts[:2]], beam)]
    del single
    llm = LLM(folder, data_parallel_size=2, **kwargs)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        assert got == want
        assert [r.num_served for r in llm.llm_engine.balancer.replicas] == [8, 8]
        # A beam search runs whole in one replica (its beams share blocks there): DP=1's beams.
        got_beams = [[(s.tokens, round(s.cum_logprob, 4)) for s in o.sequences]
                     for o in llm.beam_search([{"prompt_token_ids": p} for p in prompts[:2]], beam)]
        assert got_beams == want_beams
        with pytest.raises(ValueError, match="logits_processors"):
            llm.generate([[1, 2]], SamplingParams(logits_processors=[lambda ids, logits: logits]), use_tqdm=False)
    finally:
        llm.llm_engine.shutdown()
    assert not any(p.is_alive() for p in llm.llm_engine.processes)
