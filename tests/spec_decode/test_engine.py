"""Speculative decoding end to end on tiny random checkpoints: greedy output token for token equal
to the same engine without speculation and to transformers, seeded sampling and logprobs equal
too (the runner rewinds seeded generators), stop strings and stop tokens inside accepted drafts,
preemption (recompute, swap), prefix caching and forks with the pools checked after every step,
abort, and the blocks of rejected drafts given back."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from oracle import OracleProposer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "engine"))
from test_forks import StepProbe  # noqa: E402  (tests/engine: the per-step integrity probe)

# Repetitive prompts, so that prompt lookup and suffix decoding find matches.
PROMPTS = [[5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7],
           list(range(30, 49)),
           [5, 9, 13, 200, 17, 3, 3, 40, 41, 5, 9, 13, 200],
           [77, 78, 79, 80, 81, 82, 83, 84, 77, 78, 79]]
MAX_TOKENS = 24
ORACLE = {"method": "ngram", "num_speculative_tokens": 5, "adaptive": False}


def make_llm(path, speculative_config=None, **kw) -> LLM:
    return LLM(path, dtype="float32", max_model_len=96, block_size=8, seed=0,
               speculative_config=speculative_config, **kw)


def generate(llm: LLM, params, prompts=PROMPTS, probe: bool = True):
    step_probe = StepProbe(llm) if probe else None
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    engine = llm.llm_engine
    kv = engine.kv_cache_manager
    kv.check_integrity(engine.scheduler.requests)
    assert kv.num_free_blocks == kv.num_blocks, "blocks left after the run"
    return outs, step_probe


def with_oracle(llm: LLM, references, **kw) -> OracleProposer:
    oracle = OracleProposer(references, vocab_size=llm.llm_engine.vocab_size, **kw)
    llm.llm_engine.spec_decoder.proposer = oracle
    return oracle


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module", params=["llama", "qwen3", "gemma3"])
def arch_reference(request, make_tiny_checkpoint, hf_greedy):
    path = make_tiny_checkpoint(request.param)
    want = hf_greedy(path, PROMPTS, MAX_TOKENS)
    outs, _ = generate(make_llm(path), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == want   # the engine without speculation
    return path, want


@pytest.mark.parametrize("method", ["oracle", "ngram", "suffix"])
def test_greedy_equals_transformers_with_every_proposer(arch_reference, method):
    path, want = arch_reference
    spec = ORACLE if method == "oracle" else \
        {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "adaptive": False} if method == "ngram" else \
        {"method": "suffix", "num_speculative_tokens": 4, "suffix_decoding_min_token_prob": 0.0,
         "suffix_decoding_max_spec_factor": 4.0, "adaptive": False}
    llm = make_llm(path, spec)
    if method == "oracle":
        with_oracle(llm, list(zip(PROMPTS, want)))
    outs, _ = generate(llm, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == want
    stats = llm.llm_engine.spec_decoder.stats
    assert stats.num_draft_tokens > 0
    if method == "oracle":
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        assert stats.num_accepted_tokens_per_pos[4] > 0    # whole drafts accepted too


SAMPLED = [SamplingParams(temperature=0.9, seed=11, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=3),
           SamplingParams(temperature=1.0, seed=5, top_p=0.8, top_k=20, max_tokens=MAX_TOKENS, ignore_eos=True),
           SamplingParams(temperature=0.7, seed=3, repetition_penalty=1.3, presence_penalty=0.5,
                          frequency_penalty=0.3, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1),
           SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2, min_tokens=4, stop_token_ids=[3])]


def test_seeded_sampling_penalties_and_logprobs_equal_without_speculation(make_tiny_checkpoint):
    path = make_tiny_checkpoint("llama")
    base, _ = generate(make_llm(path), SAMPLED)
    llm = make_llm(path, ORACLE)
    oracle = with_oracle(llm, [(p, o.outputs[0].token_ids) for p, o in zip(PROMPTS, base)], wrong=0.25)
    got, _ = generate(llm, SAMPLED)
    assert oracle.num_proposed > 0 and llm.llm_engine.spec_decoder.stats.num_accepted_tokens > 0
    for g, b in zip(got, base):
        g0, b0 = g.outputs[0], b.outputs[0]
        assert g0.token_ids == b0.token_ids
        assert g0.finish_reason == b0.finish_reason and g0.stop_reason == b0.stop_reason
        if b0.logprobs is not None:
            assert g0.cumulative_logprob == pytest.approx(b0.cumulative_logprob, abs=1e-3)
            for gl, bl in zip(g0.logprobs, b0.logprobs):
                assert gl.keys() == bl.keys()
                for tok in bl:
                    assert gl[tok].logprob == pytest.approx(bl[tok].logprob, abs=1e-4)
                    assert gl[tok].rank == bl[tok].rank


def test_stop_string_and_stop_token_inside_accepted_drafts(make_tiny_checkpoint):
    path = make_tiny_checkpoint("llama")
    base, _ = generate(make_llm(path), GREEDY)
    ref = base[1].outputs[0]
    # A stop token and a stop string that the reference reaches in its middle.
    stop_token = ref.token_ids[9]
    stop_text = ref.text[len(ref.text) // 2: len(ref.text) // 2 + 3]
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[stop_token]),
              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[stop_text]),
              SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)]
    prompts = [PROMPTS[1]] * 4
    want, _ = generate(make_llm(path), params, prompts)
    llm = make_llm(path, ORACLE)
    with_oracle(llm, [(PROMPTS[1], ref.token_ids)], wrong=0.0)   # every draft right: stops inside them
    got, _ = generate(llm, params, prompts)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].text == w.outputs[0].text
        assert (g.outputs[0].finish_reason, g.outputs[0].stop_reason) == \
            (w.outputs[0].finish_reason, w.outputs[0].stop_reason)
    assert len(got[0].outputs[0].token_ids) <= 10 and got[0].outputs[0].stop_reason == stop_token
    assert got[1].outputs[0].stop_reason == stop_text
    assert [len(g.outputs[0].token_ids) for g in got[2:]] == [3, 1]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_small_pool_preemption_prefix_caching_and_forks(make_tiny_checkpoint, mode):
    path = make_tiny_checkpoint("llama")
    params = [GREEDY, SAMPLED[0],
              SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=MAX_TOKENS, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)]
    prompts = PROMPTS[:3] + [PROMPTS[0]]            # a repeated prompt: prefix-cache hits
    want, _ = generate(make_llm(path, kv_cache_memory_bytes=16 << 20), params, prompts)
    llm = make_llm(path, ORACLE, num_gpu_blocks_override=12, preemption_mode=mode, swap_space=0.01)
    with_oracle(llm, [(p, o.outputs[0].token_ids) for p, o in zip(prompts, want)], wrong=0.3)
    got, probe = generate(llm, params, prompts)
    assert [[c.token_ids for c in o.outputs] for o in got] == [[c.token_ids for c in o.outputs] for o in want]
    sched = llm.llm_engine.scheduler
    assert sched.num_preemptions_by_mode[mode] > 0
    assert llm.llm_engine.spec_decoder.stats.num_accepted_tokens > 0
    assert not sched.worker_diffs.blocks_kept


def test_prefix_cache_holds_only_accepted_tokens(make_tiny_checkpoint):
    """Blocks registered while drafts were verified hold only accepted tokens: requests whose
    prompts are earlier requests' prompts + outputs hit them and get the same output."""
    path = make_tiny_checkpoint("llama")
    base, _ = generate(make_llm(path), GREEDY)
    llm = make_llm(path, ORACLE)
    with_oracle(llm, [(p, o.outputs[0].token_ids) for p, o in zip(PROMPTS, base)], wrong=0.4)
    generate(llm, GREEDY)
    longer = [p + o.outputs[0].token_ids[:16] for p, o in zip(PROMPTS, base)]
    want, _ = generate(make_llm(path), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), longer)
    hits = llm.llm_engine.kv_cache_manager.prefix_cache_stats.hits
    got, _ = generate(llm, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), longer)
    assert llm.llm_engine.kv_cache_manager.prefix_cache_stats.hits - hits >= 8 * len(PROMPTS)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]


def test_rejected_drafts_give_their_blocks_back(make_tiny_checkpoint):
    path = make_tiny_checkpoint("llama")
    llm = make_llm(path, {"method": "ngram", "num_speculative_tokens": 12, "adaptive": False})
    engine = llm.llm_engine
    with_oracle(llm, [(PROMPTS[1], [1] * MAX_TOKENS)], wrong=0.0)  # 12 drafts, all wrong (the model never says 1)
    engine.add_request("r", {"prompt_token_ids": PROMPTS[1]},
                       SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True))
    kv, sched = engine.kv_cache_manager, engine.scheduler
    seen_drafts = False
    while engine.has_unfinished_requests():
        out = sched.schedule()
        drafts = out.scheduled_spec_decode_tokens.get("r", [])
        if drafts:
            seen_drafts = True
            request = sched.requests["r"]
            # The step's table covers the drafts: 19 + k tokens (block size 8).
            assert len(kv.get_block_table("r")) == -(-request.num_computed_tokens // 8)
            runner_out = engine.executor.execute_model(out)
            assert runner_out.num_accepted_tokens["r"] == 0
            engine._process_runner_output(out, runner_out, 0.0)
            if "r" in sched.requests:
                assert len(kv.get_block_table("r")) == -(-sched.requests["r"].num_computed_tokens // 8)
                kv.check_integrity(sched.requests)
        else:
            engine._process_runner_output(out, engine.executor.execute_model(out), 0.0)
    assert seen_drafts
    assert kv.num_free_blocks == kv.num_blocks


def test_abort_while_speculating_frees_everything(make_tiny_checkpoint):
    path = make_tiny_checkpoint("llama")
    llm = make_llm(path, {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1,
                          "prompt_lookup_max": 3, "adaptive": False})
    engine = llm.llm_engine
    for i, p in enumerate(PROMPTS):
        engine.add_request(str(i), {"prompt_token_ids": p}, GREEDY)
    for _ in range(4):
        engine.step()
    engine.abort_request(["0", "2"])
    while engine.has_unfinished_requests():
        engine.step()
    engine.kv_cache_manager.check_integrity(engine.scheduler.requests)
    assert engine.kv_cache_manager.num_free_blocks == engine.kv_cache_manager.num_blocks
