"""``vllm.v1.core`` paths."""
