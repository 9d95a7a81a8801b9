"""float32 greedy output with LoRA adapters equals transformers + PEFT (``PeftModel.from_pretrained``,
unmerged) on tiny random Llama / Qwen2 / Gemma 3 checkpoints (token ids, and the sampled tokens'
logprobs: the tiny Gemma 3 repeats its last token whatever the adapter, its logprobs do not); a
mixed batch of three adapters and the base model gives each request what it gets alone."""

import pytest

from pagedllm import LLM, LoRARequest, SamplingParams

PROMPTS = [[5, 17, 42, 9, 33, 71, 8], [100, 3, 3, 250, 61], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
NEW = 8
PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW, ignore_eos=True, logprobs=0)


def _llm(path, **kw):
    return LLM(path, dtype="float32", enable_lora=True, max_lora_rank=16, enable_prefix_caching=False,
               kv_cache_memory_bytes=8 << 20, **kw)


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _logprobs(outs):
    return [[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]


def _close(a, b, tol=1e-3):
    return all(abs(x - y) <= tol for ra, rb in zip(a, b) for x, y in zip(ra, rb))


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_greedy_equals_peft(arch, make_tiny_checkpoint, make_adapter, peft_greedy):
    base = make_tiny_checkpoint(arch)
    adapter = make_adapter(base, 1, r=8, scale=0.5)
    ref_ids, ref_lps = peft_greedy(base, adapter, PROMPTS, NEW)
    _, base_lps = peft_greedy(base, None, PROMPTS, NEW)
    assert not _close(ref_lps, base_lps, 1e-2)   # the adapter changes the output
    outs = _llm(base).generate(PROMPTS, PARAMS, lora_request=LoRARequest("a", 1, adapter), use_tqdm=False)
    assert _ids(outs) == ref_ids
    assert _close(_logprobs(outs), ref_lps)


def test_three_adapters_equal_peft_and_mixed_batch_equals_alone(make_tiny_checkpoint, make_adapter, peft_greedy):
    """Ranks 8 / 4 / 16, all seven targets / q,v,down / k,o,gate,up with rsLoRA; then every
    prompt with every adapter and with none, in one batch."""
    base = make_tiny_checkpoint("llama")
    adapters = [make_adapter(base, 1, r=8), make_adapter(base, 2, r=4, targets=["q_proj", "v_proj", "down_proj"]),
                make_adapter(base, 3, r=16, alpha=8.0, use_rslora=True,
                             targets=["k_proj", "o_proj", "up_proj", "gate_proj"])]
    refs = [peft_greedy(base, a, PROMPTS, NEW)[0] for a in adapters]
    base_ref = peft_greedy(base, None, PROMPTS, NEW)[0]
    assert all(ref != base_ref for ref in refs)
    llm = _llm(base, max_loras=3)
    loras = [LoRARequest(f"a{i}", i + 1, a) for i, a in enumerate(adapters)]
    for lora, ref in zip(loras, refs):
        assert _ids(llm.generate(PROMPTS, PARAMS, lora_request=lora, use_tqdm=False)) == ref
    mixed = [(p, lo) for lo in [*loras, None] for p in PROMPTS]
    outs = llm.generate([p for p, _ in mixed], PARAMS, lora_request=[lo for _, lo in mixed], use_tqdm=False)
    assert _ids(outs) == [t for ref in [*refs, base_ref] for t in ref]
