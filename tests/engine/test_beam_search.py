"""Beam search: equal to transformers' beam search (EOS disabled) on tiny random Llama / Qwen2 /
Gemma 3 checkpoints, W in {2, 4}: the same W sequences in the same order, scores equal to
``sequences_scores`` rescaled to vLLM's length convention; beams share blocks (no prefix block
recomputed), the pool is empty afterwards; EOS handling on a hand-computed case; bad input."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagedllm import LLM, SamplingParams
from pagedllm.engine.beam_search import BeamSearchParams, get_beam_search_score

PROMPT = [5, 9, 13, 200, 17, 3, 3, 40, 41, 77, 12]   # 11 tokens: a partial last block of 3
N = 6


@pytest.fixture(scope="module")
def engines(make_tiny_checkpoint):
    cache = {}

    def get(arch):
        if arch not in cache:
            path = make_tiny_checkpoint(arch)
            cache[arch] = (path, LLM(path, dtype="float32", max_model_len=128, kv_cache_memory_bytes=16 << 20, seed=0, block_size=4))
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
    # vLLM's LLM.beam_search: text = tokenizer.decode(tokens), the prompt and special tokens included.
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    assert [s.text for s in ours.sequences] == [hf_tok.decode(s) for s in seqs]
    # transformers divides the sum of logprobs by the generated length; vLLM by the whole length.
    for s, hf_score in zip(ours.sequences, scores):
        assert s.cum_logprob == pytest.approx(hf_score * N, abs=1e-4)
        assert get_beam_search_score(s.tokens, s.cum_logprob, None) == pytest.approx(
            hf_score * N / (len(PROMPT) + N), abs=1e-4)
    kv = llm.llm_engine.kv_cache_manager
    kv.check_integrity(llm.llm_engine.scheduler.requests)
    assert kv.num_free_blocks == kv.num_blocks   # every block back (the hybrid null block is not counted)


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
    assert kv.num_free_blocks == kv.num_blocks   # every block back (the hybrid null block is not counted) and not sched.has_unfinished_requests()


def test_bad_beam_params_name_the_field():
    with pytest.raises(ValueError, match="beam_width"):
        BeamSearchParams(0, 4)
    with pytest.raises(ValueError, match="temperature"):
        BeamSearchParams(2, 4, temperature=0.7)
    with pytest.raises(ValueError, match="max_tokens"):
        BeamSearchParams(2, 0)


def assert_pools_empty(core) -> None:
    kv = core.kv_cache_manager
    kv.check_integrity(core.scheduler.requests)
    assert kv.num_free_blocks == kv.num_blocks   # every block back (the hybrid null block is not counted)
    if kv.cpu_block_pool is not None:
        assert all(b.ref_cnt == 0 for b in kv.cpu_block_pool.blocks) and not kv.cpu_block_tables


@pytest.mark.parametrize("steps", [0, 1, 4])
def test_abort_mid_beam_search_frees_every_block_and_others_finish(engines, steps):
    """Abort a width-4 beam search before its prompt ran, right after it, and after its beams
    forked: every block it held is freed at once (the pool holds only the other request's), the
    other request finishes with its output alone, then every ref count is 0."""
    from pagedllm import SamplingParams

    _, llm = engines("llama")
    core = llm.llm_engine
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    other_prompt = list(range(60, 75))
    (alone,) = llm.generate({"prompt_token_ids": other_prompt}, greedy, use_tqdm=False)
    core.add_request("other", {"prompt_token_ids": other_prompt}, greedy)
    core.add_beam_search_request("beams", {"prompt_token_ids": PROMPT}, BeamSearchParams(4, 20, ignore_eos=True))
    kv, sched = core.kv_cache_manager, core.scheduler
    outs = []
    for _ in range(steps):
        outs += core.step()
        kv.check_integrity(sched.requests)
    if steps == 4:
        assert sum(r.request_id.endswith("_beams") for r in sched.running) == 4   # forked beams
    (aborted,) = core.abort_request("beams")
    assert aborted.request_id == "beams" and aborted.finished and aborted.outputs == []
    kv.check_integrity(sched.requests)
    other_blocks = set(kv.get_block_table("other"))
    assert all(b.ref_cnt == (b.block_id in other_blocks) for b in kv.block_pool.blocks)
    assert not core.beam_search.instances and not core.beam_search.beam_to_instance
    while core.has_unfinished_requests():
        outs += core.step()
        kv.check_integrity(sched.requests)
    (done,) = [o for o in outs if o.request_id == "other" and o.finished]
    assert done.outputs[0].token_ids == alone.outputs[0].token_ids
    assert_pools_empty(core)
    core.step()   # the worker drops them too
    assert core.executor.driver_worker.model_runner.requests.requests == {}


@pytest.fixture(scope="module")
def beams_big_pool(engines):
    path, llm = engines("llama")
    prompts = [{"prompt_token_ids": PROMPT}, {"prompt_token_ids": list(range(60, 73))}]
    return path, prompts, llm.beam_search(prompts, BeamSearchParams(4, 12, ignore_eos=True))


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_beams_match_a_large_pool(beams_big_pool, mode):
    """Two width-4 beam searches in a pool of 14 blocks of 4 tokens: beams are preempted (their
    blocks recomputed or swapped) and the results equal those of a large pool."""
    path, prompts, want = beams_big_pool
    llm = LLM(path, dtype="float32", max_model_len=48, seed=0, block_size=4, num_gpu_blocks_override=14,
              preemption_mode=mode, swap_space=0.01)
    core = llm.llm_engine
    real = core.scheduler.schedule

    def schedule():
        out = real()
        core.kv_cache_manager.check_integrity(core.scheduler.requests)
        return out

    core.scheduler.schedule = schedule
    got = llm.beam_search(prompts, BeamSearchParams(4, 12, ignore_eos=True))
    assert core.scheduler.num_preemptions_by_mode[mode] > 0
    for g, w in zip(got, want):
        assert [s.tokens for s in g.sequences] == [s.tokens for s in w.sequences]
        assert [s.cum_logprob for s in g.sequences] == pytest.approx([s.cum_logprob for s in w.sequences], abs=1e-4)
    assert_pools_empty(core)


def test_abort_while_beams_are_swapped_out_frees_both_pools(beams_big_pool):
    path, prompts, _ = beams_big_pool
    llm = LLM(path, dtype="float32", max_model_len=48, seed=0, block_size=4, num_gpu_blocks_override=14,
              preemption_mode="swap", swap_space=0.01)
    core = llm.llm_engine
    for i, p in enumerate(prompts):
        core.add_beam_search_request(f"b{i}", p, BeamSearchParams(4, 12, ignore_eos=True))
    kv = core.kv_cache_manager
    for _ in range(200):
        core.step()
        if kv.cpu_block_tables:
            break
    assert kv.cpu_block_tables
    assert len(core.abort_request(["b0", "b1"])) == 2
    assert_pools_empty(core)
    assert not core.has_unfinished_requests()
    (out,) = llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4
    assert_pools_empty(core)
