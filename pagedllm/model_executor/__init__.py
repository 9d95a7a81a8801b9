"""vLLM's ``vllm.model_executor`` import paths (``model_loader.ShardedStateLoader``)."""
