"""``vllm.v1.metrics`` paths: ``reader`` (``LLM.get_metrics``' metric objects), ``loggers`` (stat loggers)."""
