"""RMSNorm variants (Zhang & Sennrich 2019), matching Hugging Face numerics bit for bit."""

from __future__ import annotations

import torch
from torch import nn


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
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).type_as(x)
