"""``KernelLinear``: the base of the layers that replace ``nn.Linear`` after loading.

Its own module so that the kernels' layers (``bf16_gemm``, ``quantization``, ``weight_only``)
import it without importing ``linear.py``, which picks among them.
"""

from __future__ import annotations

from torch import nn


class KernelLinear(nn.Module):
    """Base of the layers that replace ``nn.Linear`` after loading with a kernel of their own
    (``linear.PackedLinear``, ``bf16_gemm.Bf16Linear``, ``quantization.Int8DynamicLinear``): code
    that looks for the model's linear layers matches ``(nn.Linear, KernelLinear)``. Subclasses set
    ``in_features`` and ``out_features``."""

    in_features: int
    out_features: int
