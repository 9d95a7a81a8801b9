"""vLLM V1's import paths (``vllm.v1.*``) for what pagedllm implements: ``v1.engine.async_llm``
(``AsyncLLM``), ``v1.sample.logits_processor`` (class-based logits processors),
``v1.core.kv_cache_utils`` (block hashes; ``ExternalBlockHash`` for KV-cache event subscribers) and
``v1.watermarking`` (the text watermark's detector and sampler)."""
