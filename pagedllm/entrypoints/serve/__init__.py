"""vLLM's ``vllm.entrypoints.serve`` import paths (``utils.api_utils.with_cancellation``)."""
