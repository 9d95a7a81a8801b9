"""Prompt embeddings (vLLM's ``{"prompt_embeds": tensor}``) offline, on tiny random checkpoints in
float32: greedy tokens from transformers' ``get_input_embeddings()(ids)`` equal the tokens from the
ids themselves, whole, in prefill chunks, after recompute preemptions and with prefix caching (where
another request's equal placeholder ids must not hit its blocks); bad inputs raise ``ValueError``."""

from __future__ import annotations

import pytest
import torch

from pagedllm import LLM, SamplingParams

PROMPTS = [list(range(30, 49)), [5, 9, 13, 200, 17, 3, 3, 40, 41], list(range(100, 137))]


def greedy(max_tokens: int = 24) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def hf_embeds(path: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    """What vLLM's example feeds: the transformers model's input-embedding output per prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    layer = model.get_input_embeddings()
    with torch.no_grad():
        return [layer(torch.tensor([p])).squeeze(0) for p in prompts]


def make_llm(path: str, **kw) -> LLM:
    args = dict(dtype="float32", max_model_len=128, seed=0, block_size=8, kv_cache_memory_bytes=16 << 20,
                enable_prompt_embeds=True)
    args.update(kw)
    return LLM(path, **args)


def token_ids(outputs) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module", params=[("llama", None), ("gemma3", False)], ids=["llama", "gemma3"])
def checkpoint(request, make_tiny_checkpoint):
    arch, tied = request.param
    path = make_tiny_checkpoint(arch, tie_word_embeddings=tied)
    want = token_ids(make_llm(path).generate([{"prompt_token_ids": p} for p in PROMPTS], greedy(),
                                             use_tqdm=False))
    return path, hf_embeds(path, PROMPTS), want


@pytest.mark.parametrize("kw", [{}, {"max_num_batched_tokens": 8, "enable_chunked_prefill": True},
                                {"num_gpu_blocks_override": 9, "max_model_len": 64,
                                 "disable_hybrid_kv_cache_manager": True}],
                         ids=["whole", "chunked", "preempted"])
def test_embeds_generate_the_ids_tokens(checkpoint, kw):
    path, embeds, want = checkpoint
    llm = make_llm(path, **kw)
    # [L, H] and vLLM's batch-of-one [1, L, H] alike.
    prompts = [{"prompt_embeds": e if i % 2 else e.unsqueeze(0)} for i, e in enumerate(embeds)]
    outs = llm.generate(prompts, greedy(), use_tqdm=False)
    assert token_ids(outs) == want
    sched = llm.llm_engine.scheduler
    if "num_gpu_blocks_override" in kw:
        assert sched.num_preemptions_total > 0
    assert outs[0].prompt_token_ids == [0] * len(PROMPTS[0])   # the placeholders


def test_prefix_caching_keys_on_the_embeddings(checkpoint):
    path, embeds, want = checkpoint
    llm = make_llm(path, enable_prefix_caching=True)
    first = llm.generate({"prompt_embeds": embeds[2]}, greedy(), use_tqdm=False)
    assert token_ids(first) == [want[2]]
    again = llm.generate({"prompt_embeds": embeds[2].clone()}, greedy(), use_tqdm=False)
    assert token_ids(again) == [want[2]] and again[0].num_cached_tokens == 32   # equal embeddings: 4 full blocks
    # The same placeholder ids (37 zeros) with other embeddings: nothing cached, its own tokens.
    other_ids = list(range(200, 237))
    other = hf_embeds(path, [other_ids])[0]
    want_other = token_ids(make_llm(path).generate({"prompt_token_ids": other_ids}, greedy(), use_tqdm=False))
    got = llm.generate({"prompt_embeds": other}, greedy(), use_tqdm=False)
    assert got[0].num_cached_tokens == 0 and token_ids(got) == want_other
    # A token prompt of zeros does not match the embeddings' blocks either.
    zeros = llm.generate({"prompt_token_ids": [0] * 37}, greedy(), use_tqdm=False)
    assert zeros[0].num_cached_tokens == 0


def test_mixed_prompt_uses_ids_where_flagged(checkpoint):
    """A chat prompt with ``prompt_embeds`` parts: real ids where ``prompt_is_token_ids``."""
    path, embeds, want = checkpoint
    ids = PROMPTS[0]
    mask = [i % 3 != 1 for i in range(len(ids))]
    full = embeds[0].clone()
    full[torch.tensor(mask)] = 0.0   # rows at token positions are ignored
    llm = make_llm(path)
    prompt = {"prompt_embeds": full, "prompt_token_ids": [t if m else 0 for t, m in zip(ids, mask)],
              "prompt_is_token_ids": mask}
    assert token_ids(llm.generate(prompt, greedy(), use_tqdm=False)) == [want[0]]


def test_bad_prompt_embeds(make_tiny_checkpoint):
    path = make_tiny_checkpoint("llama")
    good = torch.zeros(4, 64)
    off = make_llm(path, enable_prompt_embeds=False)
    with pytest.raises(ValueError, match="enable_prompt_embeds"):
        off.generate({"prompt_embeds": good}, use_tqdm=False)
    on = make_llm(path)
    for bad, what in [(torch.zeros(4, 63), "hidden size 63"), (torch.zeros(2, 4, 64), r"\(2, 4, 64\)"),
                      (torch.zeros(4, 64, dtype=torch.int64), "floating-point"), (torch.zeros(0, 64), "empty"),
                      ([[0.0] * 64], "torch.Tensor")]:
        with pytest.raises(ValueError, match=f"prompt_embeds.*{what}|{what}.*prompt_embeds"):
            on.generate({"prompt_embeds": bad}, use_tqdm=False)
    with pytest.raises(ValueError, match="prompt_logprobs.*prompt_embeds"):
        on.generate({"prompt_embeds": good}, SamplingParams(prompt_logprobs=1), use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        on.generate({"prompt_embeds": torch.zeros(129, 64)}, use_tqdm=False)
    from pagedllm.sampling_params import BeamSearchParams
    with pytest.raises(ValueError, match="prompt_embeds"):
        on.beam_search([{"prompt_embeds": good}], BeamSearchParams(beam_width=2, max_tokens=2))


def test_speculation_skips_embedded_prompts(make_tiny_checkpoint):
    """ngram drafts come from the token ids: a prompt of placeholders drafts nothing."""
    path = make_tiny_checkpoint("llama")
    embeds = hf_embeds(path, [PROMPTS[1] * 3])[0]
    want = token_ids(make_llm(path).generate({"prompt_token_ids": PROMPTS[1] * 3}, greedy(), use_tqdm=False))
    llm = make_llm(path, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                             "prompt_lookup_max": 3, "prompt_lookup_min": 1})
    outs = llm.generate({"prompt_embeds": embeds}, greedy(), use_tqdm=False)
    assert token_ids(outs) == want
    assert llm.llm_engine.spec_decoder.stats.num_drafts == 0
