"""LoRA on the real default model (Gemma 3 270M): float32 greedy tokens equal transformers + PEFT
(``PeftModel.from_pretrained``, unmerged) with adapters the test builds (random A / B, seeded,
saved by PEFT), each adapter alone and mixed with another adapter and the base model in one batch.

PEFT's runs come first and are freed before the engine loads, so one copy of the model is alive at
a time."""

from __future__ import annotations

import gc

import pytest

from pagedllm import LLM, LoRARequest, SamplingParams
from pagedllm.loaders import resolve_model

pytestmark = pytest.mark.slow

PROMPTS = [[2, 818, 5279, 529, 7001, 563], [2, 651, 1902, 236764, 1107, 4064, 506, 9465]]
NEW_TOKENS = 12


def test_default_model_adapters_equal_peft(make_adapter, peft_greedy):
    base = resolve_model(None).folder
    adapters = [make_adapter(base, 11, r=8, scale=0.02),
                make_adapter(base, 12, r=16, scale=0.02, targets=["q_proj", "v_proj", "gate_proj", "down_proj"])]
    refs = [peft_greedy(base, a, PROMPTS, NEW_TOKENS)[0] for a in (*adapters, None)]
    gc.collect()
    assert refs[0] != refs[2] and refs[1] != refs[2]   # the adapters change the tokens

    llm = LLM(None, dtype="float32", max_model_len=256, kv_cache_memory_bytes=64 << 20, seed=0, enable_lora=True,
              max_loras=2, max_lora_rank=16)
    loras = [LoRARequest("a", 1, adapters[0]), LoRARequest("b", 2, adapters[1]), None]
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for lora, ref in zip(loras, refs):   # each alone
        outs = llm.generate(PROMPTS, params, lora_request=lora, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == ref
    mixed = [(p, lora, ref[i]) for lora, ref in zip(loras, refs) for i, p in enumerate(PROMPTS)]
    outs = llm.generate([p for p, _, _ in mixed], params, lora_request=[lo for _, lo, _ in mixed], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [want for _, _, want in mixed]
