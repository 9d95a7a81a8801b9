"""Beam search: equal to transformers' beam search (EOS disabled) on tiny random Llama / Qwen2 /
Gemma 3 checkpoints, W in {2, 4}: the same W sequences in the same order, scores equal to
``sequences_scores`` rescaled to vLLM's length convention; beams share blocks (no prefix block
recomputed), the pool is empty afterwards; EOS handling on a hand-computed case; bad input."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM
from pagedllm.engine.beam_search import BeamSearchParams, get_beam_search_score

PROMPT = [5, 9, 13, 200, 17, 3, 3, 40, 41, 77, 12]   # 11 tokens: a partial last block of 3
N = 6


@pytest.fixture(scope="module")
def engines(make_tiny_checkpoint):
    cache = {}

    def get(arch):
        if arch not in cache:
            path = make_tiny_checkpoint(arch)
            cache[arch] = (path, LLM(path, max_model_len=128, kv_cache_memory_bytes=16 << 20, seed=0, block_size=4))
        return cache[arch]

    return get


def hf_beams(path, width):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    with torch.no_grad():
        out = model.generate(torch.tensor([PROMPT]), num_beams=width, num_return_sequences=width, do_sample=False,
                             max_new_tokens=N, length_penalty=1.0, early_stopping=False,
                             return_dict_in_generate=True, output_scores=True)
    return out.sequences.tolist(), out.sequences_scores.tolist()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma3"])
@pytest.mark.parametrize("width", [2, 4])
def test_matches_transformers(engines, arch, width):
    path, llm = engines(arch)
    (ours,) = llm.beam_search([{"prompt_token_ids": PROMPT}], BeamSearchParams(width, N, ignore_eos=True))
    seqs, scores = hf_beams(path, width)
    assert [s.tokens for s in ours.sequences] == seqs
    # transformers divides the sum of logprobs by the generated length; vLLM by the whole length.
    for s, hf_score in zip(ours.sequences, scores):
        assert s.cum_logprob == pytest.approx(hf_score * N, abs=1e-4)
        assert get_beam_search_score(s.tokens, s.cum_logprob, None) == pytest.approx(
            hf_score * N / (len(PROMPT) + N), abs=1e-4)
    kv = llm.llm_engine.kv_cache_manager
    kv.check_integrity(llm.llm_engine.scheduler.requests)
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)


def test_beams_share_blocks_prompt_computed_once(engines):
    _, llm = engines("llama")
    sched = llm.llm_engine.scheduler
    real, scheduled = sched.schedule, []

    def schedule():
        out = real()
        scheduled.append((dict(out.num_scheduled_tokens), list(out.blocks_to_copy)))
        llm.llm_engine.kv_cache_manager.check_integrity(sched.requests)
        return out

    sched.schedule = schedule
    assert llm.reset_prefix_cache()   # earlier tests cached this prompt
    try:
        llm.beam_search([{"prompt_token_ids": PROMPT}], BeamSearchParams(4, N, ignore_eos=True))
    finally:
        sched.schedule = real
    # Step 1 computes the prompt once; every later step computes one token per live beam
    # (nothing of a prefix recomputed); copies happen only for shared partial blocks.
    assert list(scheduled[0][0].values()) == [len(PROMPT)]
    assert all(set(n.values()) == {1} and len(n) <= 4 for n, _ in scheduled[1:] if n)
    assert sched.num_preemptions_total == 0
    assert any(copies for _, copies in scheduled)


class _Tok:
    eos_token_id = 2

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def test_eos_candidates_complete_hand_computed():
    """Width 2, controlled log-probabilities: step 1 gives beams [5] (-0.1) and [6] (-0.5), and
    EOS (-1.0) completes [2] at once; step 2 from [5]: EOS -0.2 completes [5, 2] (-0.3), [5, 7]
    (-0.4), [5, 8] (-1.1); from [6]: [6, 7] (-0.6), EOS -3 completes [6, 2] (-3.5), [6, 9]
    (-2.5). Survivors [5, 7], [6, 7] hit max_tokens=2. Final by cum / len (prompt of 3 included,
    a trailing EOS not counted): [5, 2] -0.3/4, [5, 7] -0.4/5, [6, 7] -0.6/5, [2] -1.0/3."""
    from pagedllm.config import SchedulerConfig
    from pagedllm.core.kv_cache_manager import KVCacheManager
    from pagedllm.core.sched_output import ModelRunnerOutput
    from pagedllm.core.scheduler import Scheduler
    from pagedllm.engine.beam_search import BeamSearchManager
    from pagedllm.outputs import Logprob

    kv = KVCacheManager(block_size=4, num_blocks=16)
    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32), kv)
    mgr = BeamSearchManager(sched, _Tok())
    mgr.add_request("q", None, [10, 11, 12], BeamSearchParams(2, 2), 0.0)
    # Top-4 logprobs per beam, keyed by its last token (None = the prompt).
    table = {None: {5: -0.1, 6: -0.5, 2: -1.0, 3: -4.0},
             5: {2: -0.2, 7: -0.3, 8: -1.0, 9: -5.0},
             6: {7: -0.1, 9: -2.0, 2: -3.0, 3: -6.0}}
    result = None
    for _ in range(10):
        out = sched.schedule()
        ids = [r for r in out.num_scheduled_tokens if sched.requests[r].num_computed_tokens == sched.requests[r].num_tokens]
        last = [sched.requests[r].output_token_ids[-1] if sched.requests[r].output_token_ids else None for r in ids]
        tops = [{t: Logprob(lp, i + 1) for i, (t, lp) in enumerate(table[l].items())} for l in last]
        core = sched.update_from_output(out, ModelRunnerOutput(
            req_ids=ids, sampled_token_ids=[next(iter(t)) for t in tops], sampled_logprobs=[0.0] * len(ids),
            top_logprobs=tops))
        kv.check_integrity(sched.requests)
        _, finished = mgr.process_outputs(core)
        if finished:
            (result,) = finished
            break
    got = [(s.tokens[3:], round(s.cum_logprob, 6), s.finish_reason) for s in result.beam_sequences]
    assert got == [([5, 2], -0.3, "stop"), ([5, 7], -0.4, "length")]
    assert [o.token_ids for o in result.outputs] == [[5, 2], [5, 7]]
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks) and not sched.has_unfinished_requests()


def test_bad_beam_params_name_the_field():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(0, 4)
    with pytest.raises(ValueError, match="temperature"):
        BeamSearchParams(2, 4, temperature=0.7)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(2, 0)
