"""RMSNorm variants (Zhang & Sennrich 2019), matching Hugging Face numerics bit for bit."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.layers.fused_ops import fused_ops_for

# Rows up to which GemmaRMSNorm runs torch's fused ``F.rms_norm`` (decode steps; measured faster
# there and not on prompt chunks, docs/performance.md).
FUSED_MAX_ROWS = 64


class RMSNorm(nn.Module):
    """Llama-style RMSNorm: ``weight * (x / rms(x))``, normalised in float32, cast back before the
    weight multiply (as ``LlamaRMSNorm``).

    Args:
        hidden_size: last dimension of the input.
        eps: added to the mean square.
    Shapes:
        x: [..., hidden_size] any float dtype -> same shape and dtype.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps
        # The C++ op (layers/fused_ops.py) on CPU float32 / bfloat16; set by the model from
        # ``KernelConfig.cpu_fused_ops``.
        self.use_fused_ops = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = fused_ops_for(self.use_fused_ops, x, self.weight) if x.dtype == self.weight.dtype else None
        if fused is not None:
            return fused.rms_norm(x, self.weight, self.eps)
        dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        x32 = x32 * torch.rsqrt(variance + self.eps)
        return self.weight * x32.to(dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma-style RMSNorm: ``(x / rms(x)) * (1 + weight)`` computed in float32, then cast
    (``Gemma3RMSNorm``; the checkpoint stores ``weight`` as an offset from 1).

    ``1 + weight`` in float32 is computed once after loading (``process_weights_after_loading``,
    called by ``models.utils.load_named_weights``), not per call; bitwise the same values.

    Shapes:
        x: [..., hidden_size] any float dtype -> same shape and dtype.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps
        self.weight_plus_one: torch.Tensor | None = None   # [hidden] float32, after loading
        # The C++ op (layers/fused_ops.py) on CPU float32 / bfloat16; set by the model from
        # ``KernelConfig.cpu_fused_ops``.
        self.use_fused_ops = False

    def process_weights_after_loading(self) -> None:
        """Cache ``1 + weight`` in float32 (call again after changing ``weight``)."""
        with torch.no_grad():
            self.weight_plus_one = 1.0 + self.weight.detach().float()

    def _apply(self, fn, recurse=True):
        """``Module._apply`` (``to``, ``cuda``, ``half``, ``to_empty``, ...), then the cached
        ``1 + weight`` recomputed from the converted weight, so that ``scale`` need not check
        per call whether the module moved."""
        out = super()._apply(fn, recurse)
        if self.weight_plus_one is not None:
            self.process_weights_after_loading()
        return out

    def scale(self) -> torch.Tensor:
        """``1 + weight``, [hidden] float32: the cached copy (kept in step with ``weight``'s
        device by ``_apply``), or computed now before any load."""
        w1 = self.weight_plus_one
        if w1 is None:
            return 1.0 + self.weight.float()
        return w1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        fused = fused_ops_for(self.use_fused_ops, x)
        if fused is not None:
            return fused.gemma_rms_norm(x, self.scale(), self.eps)
        if x.numel() <= FUSED_MAX_ROWS * x.shape[-1]:
            # One fused op, bitwise equal to the three steps below (tests/layers/test_norm.py), and
            # faster at decode sizes; slower on prompt chunks (docs/performance.md).
            return F.rms_norm(x.float(), (x.shape[-1],), self.scale(), self.eps).type_as(x)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.scale()).type_as(x)


def gemma_add_rms_norm(h: torch.Tensor, residual: torch.Tensor, post_norm: GemmaRMSNorm, pre_norm: GemmaRMSNorm,
                       fused: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A Gemma 3 residual step: ``new_residual = residual + post_norm(h)``, then
    ``(new_residual, pre_norm(new_residual))``; in one C++ pass when ``fused`` and the tensors
    allow (``layers/fused_ops.py``), else the eager ops (the reference; same rounding points).

    Shapes:
        h, residual: [T, hidden], one dtype -> two [T, hidden] tensors of that dtype.
    """
    ops = fused_ops_for(fused, h, residual)
    if ops is not None:
        return ops.gemma_add_rms_norm(h, residual, post_norm.scale(), pre_norm.scale(), post_norm.eps, pre_norm.eps)
    new_residual = residual + post_norm(h)
    return new_residual, pre_norm(new_residual)


def add_rms_norm(h: torch.Tensor, residual: torch.Tensor, norm: RMSNorm, fused: bool
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """A Llama residual step: ``new_residual = residual + h``, then ``(new_residual,
    norm(new_residual))``; in one C++ pass when ``fused`` and the tensors allow
    (``layers/fused_ops.py``), else the eager ops (the reference; same rounding points).

    Shapes:
        h, residual: [T, hidden], one dtype (``norm.weight``'s) -> two [T, hidden] tensors of it.
    """
    ops = fused_ops_for(fused, h, residual, norm.weight)
    if ops is not None:
        return ops.add_rms_norm(h, residual, norm.weight, norm.eps)
    new_residual = residual + h
    return new_residual, norm(new_residual)
