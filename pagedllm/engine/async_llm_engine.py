"""vLLM's ``vllm.engine.async_llm_engine.AsyncLLMEngine`` path: ``AsyncLLM`` under its older name."""

from pagedllm.engine.async_engine import AsyncLLM

AsyncLLMEngine = AsyncLLM

__all__ = ["AsyncLLMEngine"]
