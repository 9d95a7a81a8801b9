"""vLLM V1's ``vllm.v1.engine.async_llm.AsyncLLM`` path (``pagedllm.engine.async_engine``)."""

from pagedllm.engine.async_engine import AsyncLLM

__all__ = ["AsyncLLM"]
