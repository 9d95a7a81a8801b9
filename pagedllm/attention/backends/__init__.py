"""Attention backends: each turns (query, paged K/V cache, metadata) into the attention output.

A backend is a function ``forward(spec, query, key, value, k_cache, v_cache, metadata)`` called
after this step's K/V have been written into the cache. ``key``/``value`` are this step's new K/V
(some backends read fresh prefills straight from them instead of the cache).

- ``torch_ref``: per sequence, gather K/V through the block table and do explicit float32
  attention. The readable reference.
- ``cpu_sdpa``: device-agnostic fast path built on ``F.scaled_dot_product_attention``; batched
  decodes (blocks gathered into a padded copy), direct SDPA for fresh prefills.
- ``cpu_paged``: a C++ kernel (``attention/csrc``, built once per machine with
  ``torch.utils.cpp_extension``) that reads K/V in place through the block table for decodes
  and chunked prefills; SDPA for fresh prefills. Delegates to ``cpu_sdpa`` on other devices or
  when the kernel cannot be built. What ``"auto"`` picks (measured in docs/performance.md).

The engine's choice comes through ``KernelConfig.attention_backend`` (whose default
``EngineArgs`` reads once from ``PAGEDLLM_ATTENTION_BACKEND``, e.g. to time a whole model on each
backend); this module reads no environment variable.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedllm import envs
from pagedllm.attention.metadata import AttentionMetadata


@dataclass(frozen=True)
class AttentionSpec:
    """Per-layer attention hyper-parameters.

    Attributes:
        num_heads: query heads.
        head_dim: channels per head.
        num_kv_heads: key/value heads; ``num_heads % num_kv_heads == 0`` (grouped-query attention,
            query head ``h`` reads kv head ``h // (num_heads // num_kv_heads)``).
        scale: multiplier of ``q . k`` (usually ``head_dim ** -0.5``).
        sliding_window: tokens; the query at position p sees keys at p - sliding_window < k <= p
            (Hugging Face / Mistral semantics). ``None`` means full causal attention.
        logits_soft_cap: if set, scores become ``cap * tanh(scores / cap)`` before the softmax
            (Gemma 2). ``None`` means no cap.
    """

    num_heads: int
    head_dim: int
    num_kv_heads: int
    scale: float
    sliding_window: int | None = None
    logits_soft_cap: float | None = None

    def __post_init__(self) -> None:
        for name in ("num_heads", "head_dim", "num_kv_heads"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads})")
        if self.sliding_window is not None and (
                not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(
                f"sliding_window must be a positive int or None, got {self.sliding_window!r}")
        if self.logits_soft_cap is not None and not self.logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap must be > 0 or None, got {self.logits_soft_cap!r}")

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads


BackendForward = Callable[
    [AttentionSpec, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
     AttentionMetadata],
    torch.Tensor,
]

BACKEND_NAMES = ("torch_ref", "cpu_sdpa", "cpu_paged")

# The environment variable ``EngineArgs.attention_backend`` defaults to.
BACKEND_ENV = envs.PAGEDLLM_ATTENTION_BACKEND
# "auto": the kernel, measured faster than cpu_sdpa for decode
# (docs/performance.md); it falls back to cpu_sdpa by itself off CPU or without a compiler.
AUTO_BACKEND = "cpu_paged"


def resolve_backend_name(name: str) -> str:
    """Map ``"auto"`` to ``AUTO_BACKEND`` and validate; an explicit name is returned as is.

    Raises:
        ValueError: if ``name`` is not ``"auto"`` or one of ``BACKEND_NAMES``.
    """
    if name == "auto":
        return AUTO_BACKEND
    if name not in BACKEND_NAMES:
        raise ValueError(
            f"attention backend must be 'auto' or one of {BACKEND_NAMES}, got {name!r}")
    return name


def get_backend(name: str, cpu_isa: str = "auto") -> BackendForward:
    """Return the ``forward`` function of backend ``name`` (``"auto"`` allowed).

    Args:
        name: the backend.
        cpu_isa: the C++ kernel's code path (``cpu_paged``): "auto" = the best this CPU's flags
            allow, or a ``platforms.cpu.CpuIsa`` name.
    Raises:
        ValueError: if the name is unknown, or as ``platforms.cpu.resolve_cpu_isa``.
    """
    name = resolve_backend_name(name)
    if name == "torch_ref":
        from pagedllm.attention.backends import torch_ref
        return torch_ref.forward
    if name == "cpu_paged":
        import functools

        from pagedllm.attention.backends import cpu_paged
        from pagedllm.platforms.cpu import resolve_cpu_isa
        return functools.partial(cpu_paged.forward, isa=resolve_cpu_isa(cpu_isa))
    from pagedllm.attention.backends import cpu_sdpa
    return cpu_sdpa.forward


def prepare_backend(name: str, device: torch.device, dtype: torch.dtype, cpu_isa: str = "auto",
                    flags: frozenset[str] | None = None) -> tuple[str, str]:
    """Get backend ``name`` (``"auto"`` allowed) ready to run on ``device`` in ``dtype``: which
    backend will run, and why (the kernel plan's row, ``worker/kernel_plan.py``; nothing is logged).

    For ``cpu_paged`` this loads the C++ kernel, compiling it first on a machine that has not yet
    (about 30 s, announced by its own log line), so that the cost falls at engine start and not
    inside the first forward; without a compiler, off the CPU, or in another dtype the layers
    run ``cpu_sdpa`` instead.

    Args:
        flags: the CPU's flags (default: this machine's), for ``cpu_isa`` "auto".
    Returns:
        (the backend that will run: ``torch_ref``, ``cpu_sdpa`` or ``cpu_paged``; the reason in words).
    Raises:
        ValueError: as :func:`resolve_backend_name`.
    """
    resolved = resolve_backend_name(name)
    forced = None if name == "auto" else f"attention_backend={name!r} / ${BACKEND_ENV}"
    if resolved != "cpu_paged":
        why = f"set by {forced}" if forced else "asked for by name"
    else:
        from pagedllm.attention.backends import cpu_paged
        if device.type != "cpu":
            resolved, why = "cpu_sdpa", f"the cpu_paged kernel runs on the CPU only, not {device.type}"
        elif dtype not in cpu_paged.SUPPORTED_DTYPES:
            resolved, why = "cpu_sdpa", f"the cpu_paged kernel takes float32 or bfloat16, not {dtype}"
        elif cpu_paged.load_kernel() is None:
            resolved, why = "cpu_sdpa", "the cpu_paged kernel could not be built (see the warning above)"
        else:
            from pagedllm.platforms.cpu import resolve_cpu_isa
            isa = resolve_cpu_isa(cpu_isa, flags)
            path = cpu_paged.kernel_path(cpu_paged.load_kernel(), isa, dtype)
            why = (f"set by {forced}" if forced else "the default on the CPU: the C++ paged-attention kernel") \
                + f"; {path} micro-kernels for {str(dtype).replace('torch.', '')} (cpu_isa {cpu_isa!r} -> {isa.value})"
    return resolved, why
