"""The C++ LoRA kernel (``csrc/sgmv.cpp``): a layer's deltas for a batch mixing adapters in one call,
Punica's SGMV (Chen et al. 2023, "Punica: Multi-Tenant LoRA Serving") on the CPU.

``LoRALinear`` (``layers.py``) runs it when ``choose_lora_kernel`` picked it at wrap time (a CPU
model in float32 or bfloat16 whose extension built); the torch shrink / expand stays the
reference and the fallback (other devices and dtypes, no compiler: one WARNING).
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch

from pagedllm.layers.fused_ops import VEC_HEADER
from pagedllm.platforms.cpu_extension import CpuExtension, load_extension

SOURCE = Path(__file__).resolve().parent / "csrc" / "sgmv.cpp"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
EXTENSION = CpuExtension("lora_sgmv", SOURCE, "LoRA SGMV kernel", "the torch LoRA shrink / expand",
                         headers=(VEC_HEADER,))


@functools.cache
def load_lora_kernel() -> ModuleType | None:
    """The C++ kernel (``sgmv_add_``, ``compiled_isas``), compiled first on a machine that has not
    yet; None (one WARNING) if that fails."""
    return load_extension(EXTENSION)


def choose_lora_kernel(device: torch.device, dtype: torch.dtype) -> tuple[ModuleType | None, str]:
    """The kernel the adapted layers run, and why (None: the torch shrink / expand).

    Args:
        device: the model's device (only a CPU model runs the C++ kernel).
        dtype: the adapters' dtype (the activations').
    """
    if device.type != "cpu":
        return None, f"the C++ kernel runs on the CPU only, not {device.type}"
    if dtype not in SUPPORTED_DTYPES:
        return None, f"the C++ kernel takes float32 or bfloat16, not {dtype}"
    kernel = load_lora_kernel()
    if kernel is None:
        return None, "the C++ kernel could not be built (see the warning above)"
    return kernel, f"C++ SGMV kernel ({', '.join(kernel.compiled_isas())} code)"
