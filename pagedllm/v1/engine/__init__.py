"""``vllm.v1.engine`` paths."""
