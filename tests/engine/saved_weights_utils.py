"""Helpers shared by the saved-weights tests (``test_sharded_state.py``, ``test_tensorizer.py``):
the float32 engine settings and the greedy tokens a saved model must reproduce."""

from __future__ import annotations

from pagedllm import LLM, SamplingParams

ENGINE_KW = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=8 << 20, seed=0)
PROMPTS = ["The quick brown fox", "Once upon a time in a land"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def greedy_ids(llm: LLM) -> list[list[int]]:
    """``PROMPTS``' greedy token ids (8 each); the engine is shut down after."""
    try:
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]
    finally:
        llm.llm_engine.shutdown()
