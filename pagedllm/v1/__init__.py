"""vLLM V1's import paths (``vllm.v1.*``) for what pagedllm implements: ``v1.engine.async_llm``
(``AsyncLLM``) and ``v1.sample.logits_processor`` (class-based logits processors)."""
