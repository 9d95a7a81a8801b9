"""Paged attention for a flattened batch mixing prefill chunks and decodes.

Source: PagedAttention (Kwon et al., SOSP 2023). Sliding windows follow Hugging Face / Mistral
(the query at position p sees keys p - sliding_window < k <= p); the soft cap follows Gemma 2.

Backends (``pagedllm.attention.backends``): ``cpu_paged`` (C++ kernel reading K/V in place through
the block table), ``cpu_sdpa`` (gather + ``F.scaled_dot_product_attention``), ``torch_ref`` (the
readable oracle). Models pass ``KernelConfig.attention_backend`` (``EngineArgs`` defaults it to
``$PAGEDLLM_ATTENTION_BACKEND``, e.g. ``cpu_sdpa`` to run a whole model on the gather path).

Usage (per layer)::

    attn = Attention(num_heads, head_dim, num_kv_heads, scale=head_dim ** -0.5)
    out = attn(q, k, v, k_cache, v_cache, metadata)   # [num_tokens, num_heads, head_dim]
"""

from __future__ import annotations

import functools

import torch

from pagedllm.attention.backends import (
    BACKEND_ENV, AttentionSpec, get_backend, resolve_backend_name)
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.attention.ops import build_attention_metadata, write_kv

__all__ = ["BACKEND_ENV", "Attention", "AttentionMetadata", "AttentionSpec",
           "build_attention_metadata", "write_kv"]


class Attention:
    """One layer's paged attention: write this step's K/V into the cache, then attend.

    Not an ``nn.Module``: it holds no parameters, only the layer's head layout and options.

    Args:
        num_heads: query heads.
        head_dim: channels per head.
        num_kv_heads: key/value heads; must divide ``num_heads`` (grouped-query attention).
        scale: multiplier of ``q . k`` (usually ``head_dim ** -0.5``; Gemma uses
            ``query_pre_attn_scalar ** -0.5``).
        sliding_window: tokens; ``None`` for full causal attention.
        logits_soft_cap: ``cap * tanh(scores / cap)`` before the softmax when set (Gemma 2).
        backend: ``"auto"``, ``"cpu_paged"``, ``"cpu_sdpa"`` or ``"torch_ref"``. ``"auto"`` is
            ``"cpu_paged"`` (the C++ kernel on CPU tensors; it hands other devices, and every
            call when the kernel cannot be built, to ``"cpu_sdpa"``). See docs/performance.md for the measurements.
        cpu_isa: the C++ kernel's code path, "auto" (the best the CPU's flags allow) or a
            ``platforms.cpu.CpuIsa`` name (``KernelConfig.cpu_isa``).
    Raises:
        ValueError: on a non-positive size, ``num_heads % num_kv_heads != 0``, a non-positive
            window or soft cap, or an unknown backend.
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        num_kv_heads: int,
        scale: float,
        sliding_window: int | None = None,
        logits_soft_cap: float | None = None,
        backend: str = "auto",
        cpu_isa: str = "auto",
    ) -> None:
        self.spec = AttentionSpec(num_heads, head_dim, num_kv_heads, float(scale),
                                  sliding_window, logits_soft_cap)
        self.backend = resolve_backend_name(backend)
        self._forward = get_backend(self.backend, cpu_isa)
        # cpu_paged writes this step's K/V inside its kernel call (``write_kv=True``).
        self._write_and_forward = functools.partial(self._forward, write_kv=True) \
            if self.backend == "cpu_paged" else None

    def __repr__(self) -> str:
        return f"Attention({self.spec}, backend={self.backend!r})"

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Write ``key``/``value`` into the cache through ``metadata.slot_mapping``, then attend.

        Token ``i`` of sequence ``s`` sits at position ``p = context_lens[s] + i`` and attends
        to the cached positions ``k`` of ``s`` with ``k <= p`` (and ``p - sliding_window < k``).

        Args:
            query: [num_tokens, num_heads, head_dim], model dtype (float32 / bfloat16), RoPE'd.
            key, value: [num_tokens, num_kv_heads, head_dim], same dtype, this step's new tokens.
            k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], same dtype;
                updated in place.
            metadata: this step's AttentionMetadata (shared by all layers of the forward).
        Returns:
            [num_tokens, num_heads, head_dim] in query dtype. Rows of padding tokens (beyond
            ``query_start_loc[-1]``) are zero.
        Raises:
            ValueError: if a tensor's shape disagrees with the layer or the metadata.
        """
        spec = self.spec
        num_tokens = metadata.num_tokens
        if query.dim() != 3 or query.shape != (num_tokens, spec.num_heads, spec.head_dim):
            raise ValueError(
                f"query must be [{num_tokens}, {spec.num_heads}, {spec.head_dim}] (num_tokens, "
                f"num_heads, head_dim), got {tuple(query.shape)}")
        kv_shape = (num_tokens, spec.num_kv_heads, spec.head_dim)
        if key.shape != kv_shape or value.shape != kv_shape:
            raise ValueError(
                f"key and value must be {list(kv_shape)} (num_tokens, num_kv_heads, head_dim), "
                f"got {tuple(key.shape)} and {tuple(value.shape)}")
        if k_cache.shape[1] != metadata.block_size:
            raise ValueError(
                f"cache block_size {k_cache.shape[1]} != metadata.block_size "
                f"{metadata.block_size}")
        if (self._write_and_forward is not None and not metadata.slot_mapping_has_padding
                and metadata.slot_mapping.dtype == torch.int64):
            return self._write_and_forward(spec, query, key, value, k_cache, v_cache, metadata)
        write_kv(key, value, k_cache, v_cache, metadata.slot_mapping, metadata.slot_mapping_has_padding)
        return self._forward(spec, query, key, value, k_cache, v_cache, metadata)
