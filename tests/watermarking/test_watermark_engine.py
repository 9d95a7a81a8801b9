"""Watermarked generation through ``LLM`` on a tiny random Llama, checked by the detector.

The engines are seeded (``seed=0``), so every output below is the same on every run; the
detector's false-alarm rate on unwatermarked text is its threshold, 1% per text.
"""

from __future__ import annotations

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.v1.watermarking import GumbelWatermarkDetector

PROMPTS = [{"prompt_token_ids": [5, 6, 7]}, {"prompt_token_ids": [40, 41]}, {"prompt_token_ids": [300, 2, 9, 9]}]
SAMPLE = SamplingParams(temperature=1.0, max_tokens=100, ignore_eos=True)


def _llm(path, watermark_config=None):
    return LLM(path, dtype="float32", max_model_len=256, kv_cache_memory_bytes=32 << 20, seed=0,
               watermark_config=watermark_config)


@pytest.fixture(scope="module")
def marked(broad_llama_dir):
    return _llm(broad_llama_dir, {"key": 1234})


@pytest.fixture(scope="module")
def plain(broad_llama_dir):
    return _llm(broad_llama_dir)


def _ids(llm, prompts, params=SAMPLE):
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]


def test_watermarked_text_is_detected_and_plain_text_is_not(marked, plain):
    det = GumbelWatermarkDetector(1234)
    for ids in _ids(marked, PROMPTS):
        d = det.detect(ids)
        assert len(ids) == 100 and d.num_scored_tokens >= 90
        assert d.is_watermarked and d.p_value < 0.01
        assert not GumbelWatermarkDetector(4321).detect(ids).is_watermarked   # another key
    for ids in _ids(plain, PROMPTS):
        d = det.detect(ids)
        assert not d.is_watermarked and d.p_value >= 0.01


def test_deterministic_for_a_key_without_seed_and_batch_invariant(marked, broad_llama_dir):
    first = _ids(marked, PROMPTS)
    assert _ids(marked, PROMPTS) == first                  # no seed: the key decides
    assert [_ids(marked, [p])[0] for p in PROMPTS] == first   # batched = alone
    other = _llm(broad_llama_dir, {"key": 4321})
    assert _ids(other, PROMPTS) != first
    assert GumbelWatermarkDetector(4321).detect(_ids(other, PROMPTS[:1])[0]).is_watermarked


def test_opt_out_and_greedy_sample_as_without_watermark(marked, plain):
    opt_out = SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=7, watermarking=False)
    assert _ids(marked, PROMPTS, opt_out) == _ids(plain, PROMPTS, opt_out)
    greedy = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, watermarking=True)
    assert _ids(marked, PROMPTS, greedy) == _ids(plain, PROMPTS, greedy)
    # the caller's params are not changed by the engine's resolution
    params = SamplingParams(temperature=1.0, max_tokens=5)
    marked.generate(PROMPTS[:1], params, use_tqdm=False)
    assert params.watermarking is None


def test_top_k_stays_within_the_top_k(marked):
    params = SamplingParams(temperature=1.0, top_k=3, max_tokens=30, ignore_eos=True, logprobs=3)
    out = marked.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    for tok, lp in zip(out.token_ids, out.logprobs):
        assert lp[tok].rank <= 3


def test_bad_watermark_config_in_llm(broad_llama_dir):
    with pytest.raises(ValueError, match="key"):
        _llm(broad_llama_dir, {"key": -5})
    with pytest.raises(ValueError, match="context_width"):
        _llm(broad_llama_dir, {"key": 5, "context_width": 0})
