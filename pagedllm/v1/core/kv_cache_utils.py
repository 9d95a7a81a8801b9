"""vLLM V1's ``vllm.v1.core.kv_cache_utils`` path for what KV-cache event subscribers import
(``ExternalBlockHash``, vLLM's ``kv_events_subscriber.py`` example) and the block hashing
(``pagedllm.core.kv_cache_utils``)."""

from pagedllm.core.kv_cache_utils import BlockHash, ExternalBlockHash, hash_block_tokens, hash_request_tokens

__all__ = ["BlockHash", "ExternalBlockHash", "hash_block_tokens", "hash_request_tokens"]
