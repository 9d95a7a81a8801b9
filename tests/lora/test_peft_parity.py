"""float32 greedy output with LoRA adapters equals transformers + PEFT (``PeftModel.from_pretrained``,
unmerged) on tiny random Llama / Qwen2 / Gemma 3 checkpoints (token ids, and the sampled tokens'
logprobs: the tiny Gemma 3 repeats its last token whatever the adapter, its logprobs do not); a
mixed batch of three adapters and the base model gives each request what it gets alone."""

import pytest

from pagedllm import LLM, LoRARequest

from lora_utils import GREEDY as PARAMS, NEW_TOKENS as NEW, PROMPTS, lora_engine_args


def _llm(path, **kw):
    return LLM(**lora_engine_args(path, **kw))


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


def test_three_adapters_equal_peft_and_mixed_batch_equals_alone(llama_lora):
    """Each adapter alone equals PEFT; then every prompt with every adapter and with none, in one batch."""
    refs, base_ref = llama_lora["refs"], llama_lora["base_ref"]
    assert all(ref != base_ref for ref in refs)
    llm = _llm(llama_lora["base"], max_loras=3)
    loras = [LoRARequest(f"a{i}", i + 1, a) for i, a in enumerate(llama_lora["adapters"])]
    for lora, ref in zip(loras, refs):
        assert _ids(llm.generate(PROMPTS, PARAMS, lora_request=lora, use_tqdm=False)) == ref
    mixed = [(p, lo) for lo in [*loras, None] for p in PROMPTS]
    outs = llm.generate([p for p, _ in mixed], PARAMS, lora_request=[lo for _, lo in mixed], use_tqdm=False)
    assert _ids(outs) == [t for ref in [*refs, base_ref] for t in ref]
