"""vLLM's ``vllm.v1.worker`` import paths (only ``gpu.sample.logits_processor``)."""
