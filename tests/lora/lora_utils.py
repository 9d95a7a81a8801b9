"""Shared by the LoRA tests: the prompts, and a tiny engine with LoRA on."""

from pagedllm import SamplingParams

# Prompts and length of the tiny-Llama LoRA tests (``conftest.llama_lora`` holds PEFT's outputs).
PROMPTS = [[5, 17, 42, 9, 33, 71, 8], [100, 3, 3, 250, 61], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
NEW_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)


def lora_engine_args(path: str, **kw) -> dict:
    """float32, LoRA on (rank up to 16), no prefix caching, an 8 MiB KV cache; kw override."""
    return {"model": path, "dtype": "float32", "enable_lora": True, "max_lora_rank": 16,
            "enable_prefix_caching": False, "kv_cache_memory_bytes": 8 << 20, **kw}
