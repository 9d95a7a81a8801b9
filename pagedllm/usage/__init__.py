"""vLLM's ``vllm.usage`` import path (``usage_lib.UsageContext``)."""
