"""KV cache sizing: from a byte budget to a number of blocks (vLLM's memory model)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

logger = logging.getLogger(__name__)

_GIB = 1 << 30


@dataclass(frozen=True)
class KVCacheShape:
    """Geometry of the paged KV cache.

    Attributes:
        num_layers: K/V tensor pairs: decoder layers (each has its own K and V pool), or the
            layers per group of a hybrid KV cache (a block is one page of that many layers).
        num_kv_heads: key/value heads per layer.
        head_dim: elements per head.
        block_size: tokens per block.
        dtype_bytes: bytes per element (4 float32, 2 bfloat16/float16).
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype_bytes: int

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block across all layers, K and V: L * 2 * block_size * Hkv * D * itemsize."""
        return self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_block // self.block_size


def default_cpu_kv_cache_bytes(cpu_kvcache_space_bytes: int | None = None,
                               available_bytes: int | None = None) -> int:
    """The CPU KV budget in bytes when ``kv_cache_memory_bytes`` is not given.

    Args:
        cpu_kvcache_space_bytes: ``CacheConfig.cpu_kvcache_space_bytes`` (from
            ``PAGEDLLM_CPU_KVCACHE_SPACE``, read by ``EngineArgs``), used when set.
        available_bytes: available RAM (bytes); None reads it with psutil.
    Returns:
        ``cpu_kvcache_space_bytes`` if set, else min(25% of available RAM, 4 GiB).
    """
    if cpu_kvcache_space_bytes is not None:
        return int(cpu_kvcache_space_bytes)
    if available_bytes is None:
        import psutil
        available_bytes = int(psutil.virtual_memory().available)
    return min(available_bytes // 4, 4 * _GIB)


def kv_bytes_from_utilization(total_device_bytes: int, gpu_memory_utilization: float,
                              peak_non_kv_bytes: int) -> int:
    """KV budget on an accelerator: ``total * gpu_memory_utilization - peak``, where peak is the
    memory held after loading weights and running a profiling forward of
    ``max_num_batched_tokens`` tokens (vLLM's ``determine_num_available_blocks``).

    Raises:
        ValueError: if nothing is left for the KV cache (says how much is missing, in GiB).
    """
    budget = int(total_device_bytes * gpu_memory_utilization) - int(peak_non_kv_bytes)
    if budget <= 0:
        raise ValueError(
            f"no memory left for the KV cache: weights and activations take "
            f"{peak_non_kv_bytes / _GIB:.2f} GiB of the {total_device_bytes * gpu_memory_utilization / _GIB:.2f} GiB "
            f"allowed by gpu_memory_utilization={gpu_memory_utilization}; raise it or shorten max_num_batched_tokens")
    return budget


def num_blocks_for_budget(budget_bytes: int, shape: KVCacheShape, max_model_len: int,
                          blocks_per_request: Callable[[int], int] | None = None) -> int:
    """Blocks that fit in ``budget_bytes``; at least one request of ``max_model_len`` must fit.

    Args:
        blocks_per_request: blocks one request of a given number of tokens needs (the hybrid KV
            cache passes its per-group sum); default ``cdiv(num_tokens, block_size)``.
    Raises:
        ValueError: if fewer blocks fit than one request of ``max_model_len`` tokens needs; the
            message gives the largest max_model_len that would fit and the bytes needed.
    """
    if blocks_per_request is None:
        def blocks_per_request(num_tokens: int) -> int:
            return -(-num_tokens // shape.block_size)
    num_blocks = budget_bytes // shape.bytes_per_block
    needed = blocks_per_request(max_model_len)
    if num_blocks < needed:
        lo, hi = 0, max_model_len   # largest length that fits: blocks_per_request is non-decreasing
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if blocks_per_request(mid) <= num_blocks else (lo, mid - 1)
        largest = lo
        raise ValueError(
            f"the KV cache budget of {budget_bytes / _GIB:.3f} GiB holds {num_blocks} blocks "
            f"({largest} tokens), fewer than one request of max_model_len={max_model_len} needs "
            f"({needed} blocks, {needed * shape.bytes_per_block / _GIB:.3f} GiB); set max_model_len <= {largest} "
            "or raise kv_cache_memory_bytes / PAGEDLLM_CPU_KVCACHE_SPACE")
    return int(num_blocks)
