"""The real default model (Gemma 3 270M GGUF) in float32: beam search with W in {2, 4} equals
transformers' ``generate(num_beams=W, num_return_sequences=W, do_sample=False, max_new_tokens=8,
length_penalty=1.0)`` with EOS disabled, recorded in tests/golden/default_model.json by the script
beside it: the same W sequences in the same order, and scores equal to ``sequences_scores``
rescaled to vLLM's length convention (prompt included), to 1e-4."""

from __future__ import annotations

import pytest

from pagedllm import LLM
from pagedllm.engine.beam_search import BeamSearchParams, get_beam_search_score

pytestmark = pytest.mark.slow


def test_beam_search_matches_transformers_float32(default_model_reference):
    refs = default_model_reference["beam_search_float32"]
    assert {r["beam_width"] for r in refs} == {2, 4}
    llm = LLM(None, dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20, seed=0)
    for ref in refs:
        width, n = ref["beam_width"], ref["max_new_tokens"]
        prompt = ref["prompt_token_ids"]
        (out,) = llm.beam_search({"prompt_token_ids": prompt}, BeamSearchParams(width, n, ignore_eos=True))
        assert [s.tokens[len(prompt):] for s in out.sequences] == ref["sequences"], ref["prompt"]
        for seq, hf_score in zip(out.sequences, ref["sequences_scores"]):
            # transformers divides the sum of logprobs by the generated length; vLLM by the whole length.
            assert get_beam_search_score(seq.tokens, seq.cum_logprob, None) == pytest.approx(
                hf_score * n / (len(prompt) + n), abs=1e-4)
            assert seq.cum_logprob == pytest.approx(hf_score * n, abs=1e-3)
    kv = llm.llm_engine.kv_cache_manager
    kv.check_integrity(llm.llm_engine.scheduler.requests)
    assert kv.num_free_blocks == kv.num_blocks
