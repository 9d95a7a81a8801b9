"""``vllm.v1.sample`` paths."""
