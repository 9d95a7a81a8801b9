"""Greedy output of the engine equals transformers' on tiny random checkpoints (float32).

Each prompt's reference comes from ``transformers`` ``generate`` on that prompt alone; the engine
gets all prompts at once (continuous batching, chunked prefill, preemption).
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedllm import LLM, SamplingParams

MAX_NEW = 12


def _prompts(vocab: int, n: int = 8, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [3, 40, 7, 17, 1, 29, 64, 11][:n]
    return [[rng.randrange(3, vocab) for _ in range(L)] for L in lengths]


@pytest.fixture(scope="module")
def references(make_tiny_checkpoint, hf_greedy):
    cache = {}

    def get(arch):
        if arch not in cache:
            path = make_tiny_checkpoint(arch)
            from pagedllm.loaders import load_config
            vocab = load_config(path)["vocab_size"]
            prompts = _prompts(vocab)
            cache[arch] = (path, prompts, hf_greedy(path, prompts, MAX_NEW))
        return cache[arch]

    return get


def _run(path, prompts, **engine_kwargs):
    llm = LLM(path, dtype="float32", max_model_len=128, seed=0, **engine_kwargs)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    manager = llm.llm_engine.kv_cache_manager
    assert manager.num_free_blocks == manager.num_blocks, "blocks leaked after generate"
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "gemma3", "mistral"])
def test_batched_greedy_equals_transformers(arch, references):
    path, prompts, expected = references(arch)
    assert all(len(e) == MAX_NEW for e in expected)
    got, _ = _run(path, prompts, kv_cache_memory_bytes=64 << 20)
    assert got == expected


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_block_sizes(block_size, references):
    path, prompts, expected = references("gemma3")
    got, _ = _run(path, prompts, block_size=block_size, kv_cache_memory_bytes=64 << 20)
    assert got == expected


def test_chunked_prefill_equals_whole(references):
    path, prompts, expected = references("gemma3")
    got, _ = _run(path, prompts, max_num_batched_tokens=16, kv_cache_memory_bytes=64 << 20)
    assert got == expected


def test_preemption_keeps_greedy_output(references):
    path, prompts, expected = references("llama")
    # 128-token requests need 8 blocks of 16; 12 blocks cannot hold all 8 prompts at once.
    got, llm = _run(path, prompts, num_gpu_blocks_override=12, max_num_seqs=8)
    assert llm.llm_engine.scheduler.num_preemptions_total > 0
    assert got == expected


def test_prefill_logits_match_transformers(make_tiny_checkpoint):
    """The last-position logits of a prefill are allclose to transformers' (float32)."""
    from transformers import AutoModelForCausalLM
    path = make_tiny_checkpoint("gemma3")
    ids = _prompts(300, 1, seed=3)[0] + list(range(3, 40))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0, -1]
    llm = LLM(path, dtype="float32", max_model_len=128, kv_cache_memory_bytes=16 << 20)
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=1, logprobs=5),
                       use_tqdm=False)[0]
    top = out.outputs[0].logprobs[0]
    ref_lp = torch.log_softmax(ref.float(), -1)
    for tok, lp in top.items():
        assert lp.logprob == pytest.approx(ref_lp[tok].item(), abs=1e-4)
    assert out.outputs[0].token_ids[0] == int(ref.argmax())
