"""Fused CPU ops for the elementwise work between a decoder layer's GEMMs (``csrc/fused_ops.cpp``).

At batch 1 a decode step of Gemma 3 runs about 40 small torch ops per layer between its four
linear layers (Llama / Qwen fewer, with the same kinds): RMSNorms (torch's is composite on the CPU: pow, mean, add, rsqrt, mul, mul and
casts), residual adds, per-head q/k norms, RoPE, GELU and the gate multiply. Each reads and writes
its whole tensor and pays torch's per-op dispatch. The C++ ops here do each group in one pass per
row, with float32 sums and bfloat16 rounded exactly where the eager code rounds (vLLM fuses the
same groups, on the CPU through torch.compile, which docs/performance.md measured and
rejected). The eager torch code stays the reference: it runs off the CPU, in other dtypes, when
the extension cannot be built (no compiler: one WARNING), and with ``cpu_fused_ops="off"``.

How close (tests/layers/test_fused_ops.py): float32 within a few ulp (the sum of squares is
added in another order than torch's reduction); bfloat16 at most one bfloat16 ulp, where a value
lies that close to a rounding boundary; the activations use torch's own formula and vector
tanh / exp, so they round as torch does.

The extension is built and loaded by the shared builder (``platforms.cpu_extension``); the
kernel plan (``worker/kernel_plan.py``) calls :func:`prepare_fused_ops` at engine start, before any
progress bar.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch

from pagedllm.platforms.cpu_extension import DEFAULT_CFLAGS, CpuExtension, load_extension

SOURCE = Path(__file__).resolve().parent / "csrc" / "fused_ops.cpp"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
# ``-ffp-contract=off``: products and sums are rounded separately, as in the eager code.
VEC_HEADER = SOURCE.parent / "vec_isa.h"   # ATen's vector code path, shared with lora/csrc/sgmv.cpp
EXTENSION = CpuExtension("fused_ops", SOURCE, "fused CPU ops", "the eager torch ops",
                         extra_cflags=DEFAULT_CFLAGS + ("-ffp-contract=off",), headers=(VEC_HEADER,))


@functools.cache
def load_fused_ops() -> ModuleType | None:
    """The C++ ops (Gemma: ``gemma_rms_norm``, ``gemma_add_rms_norm``, ``gemma_qk_norm_rope_``,
    ``gelu_tanh_and_mul``; Llama / Qwen: ``rms_norm``, ``add_rms_norm``, ``qk_norm_rope_``,
    ``silu_and_mul``; the sampler's ``greedy_argmax``; ``compiled_isas``), compiled first on a machine that has not yet; None
    (one WARNING) if that fails."""
    return load_extension(EXTENSION)


def fused_ops_for(enabled: bool, *tensors: torch.Tensor) -> ModuleType | None:
    """The extension if ``enabled`` and every tensor is a contiguous float32 / bfloat16 CPU tensor
    (all one dtype) and it loaded; else None (the caller runs its eager code).

    Args:
        enabled: the model's ``KernelConfig.cpu_fused_ops != "off"``.
        tensors: the activations the fused op would read.
    """
    if not enabled:
        return None
    dtype = tensors[0].dtype
    if dtype is not torch.float32 and dtype is not torch.bfloat16:   # SUPPORTED_DTYPES
        return None
    for t in tensors:   # ``is_cpu``: a flag read (``device.type`` builds a device object per call)
        if not t.is_cpu or t.dtype is not dtype or not t.is_contiguous():
            return None
    return load_fused_ops()


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor | None:
    """Each row's greedy token through the C++ op (the sampler's plain greedy rows, handed to
    ``sample.Sampler`` by the model runner when the model runs the fused ops): torch's
    ``max(dim=-1).indices`` exactly (first maximum; first NaN; it only compares), in a quarter of
    its time on a 262,144-token row (docs/performance.md).

    Args:
        logits: [N, V] float32 / bfloat16, contiguous, on the CPU.
    Returns:
        [N] int64, or None (the caller runs torch) for other tensors or without the extension.
    """
    ops = fused_ops_for(True, logits)
    if ops is None or logits.dim() != 2 or logits.shape[1] == 0:
        return None
    return ops.greedy_argmax(logits)


def prepare_fused_ops(mode: str, device: torch.device, dtype: torch.dtype) -> tuple[bool, str]:
    """Load (building on a first start) the fused ops the model will run: whether they run, and why
    (the kernel plan's row, ``worker/kernel_plan.py``; nothing is logged).

    Args:
        mode: ``KernelConfig.cpu_fused_ops``, "auto" or "off".
        device, dtype: where and in what the model runs.
    Returns:
        (True if the layers will run the fused ops; the reason in words).
    """
    if mode == "off":
        return False, "cpu_fused_ops='off'"
    if device.type != "cpu":
        return False, f"they run on the CPU only, not {device.type}"
    if dtype not in SUPPORTED_DTYPES:
        return False, f"they take float32 or bfloat16, not {dtype}"
    if load_fused_ops() is None:
        return False, "the extension could not be built (see the warning above)"
    return True, f"{', '.join(load_fused_ops().compiled_isas())} code for {str(dtype).replace('torch.', '')}"
