"""RMSNorm variants (Zhang & Sennrich 2019), matching Hugging Face numerics bit for bit."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.to(torch.float32)
        variance = x32.pow(2).mean(-1, keepdim=True)
        x32 = x32 * torch.rsqrt(variance + self.eps)
        return self.weight * x32.to(dtype)


class GemmaRMSNorm(nn.Module):
    """Gemma-style RMSNorm: ``(x / rms(x)) * (1 + weight)`` computed in float32, then cast
    (``Gemma3RMSNorm``; the checkpoint stores ``weight`` as an offset from 1).

    Shapes:
        x: [..., hidden_size] any float dtype -> same shape and dtype.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= FUSED_MAX_ROWS * x.shape[-1]:
            # One fused op, bitwise equal to the three steps below (tests/layers/test_norm.py), and
            # faster at decode sizes; slower on prompt chunks (docs/performance.md, session 6).
            return F.rms_norm(x.float(), (x.shape[-1],), 1.0 + self.weight.float(), self.eps).type_as(x)
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).type_as(x)
