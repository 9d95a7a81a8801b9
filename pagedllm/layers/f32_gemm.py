"""float32 linear layers through a GEMM of our own (``csrc/f32_gemm.cpp``; AVX-512, or AVX2 + FMA),
and which kernel runs a float32 model's linear layers (``f32_kernel_for``).

Why: at a decode step's 1-16 rows a layer is bound by reading its weight once, and oneDNN's packed
float32 inner product (``layers/linear.py``'s ``PackedLinear``) reads it well below the memory's
rate there; this kernel streams the weight once per 12 rows (AVX-512; 6 on AVX2) with each block
prefetched 4 KiB ahead into L2, and from 24 rows runs 6-row x 64-output tiles bound by the FMA
units (docs/benchmarks.md, "float32 GEMM": per-M timings against oneDNN;
``benchmarks/cpu_paths.py --parts linear``).

Arithmetic (the C++ header): each output is one chain of fused multiply-adds in k order, then the
bias, so a row's result is the same bits at any row count, beside any other rows, with any thread
count, and on the AVX-512 and the AVX2 code alike (batch-invariant by construction; oneDNN is not:
its one-row call rounds differently at some shapes, see ``PackedLinear``). It differs from oneDNN
and from ``torch.nn.functional.linear`` in the order of the float32 additions only (rounding).

``cpu_isa`` (``KernelConfig.cpu_isa``) = ``portable`` forces oneDNN; ``cpu_f32_gemm``
(``KernelConfig.cpu_f32_gemm``: ``auto``, ``f32_gemm``, ``onednn``) forces one kernel (how
benchmarks and tests compare them).
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

import torch

from pagedllm import envs
from pagedllm.layers.kernel_linear import KernelLinear
from pagedllm.platforms.cpu import CpuIsa, cpu_flags, resolve_cpu_isa
from pagedllm.platforms.cpu_extension import CpuExtension, kernel_unavailable, load_extension

SOURCE = Path(__file__).resolve().parent / "csrc" / "f32_gemm.cpp"
EXTENSION = CpuExtension("f32_gemm", SOURCE, "float32 GEMM (AVX-512 / AVX2)", "oneDNN's float32 inner product",
                         headers=(SOURCE.parent / "linear_bias.h", SOURCE.parent / "f32_gemm.h"))
# /proc/cpuinfo flags the AVX2 code needs (the AVX-512 code also needs avx512f; the C++ guards alike).
F32_GEMM_FLAGS = ("avx2", "fma")
F32_KERNEL = "f32_gemm"
ONEDNN_KERNEL = "onednn"
# ``KernelConfig.cpu_f32_gemm``'s values besides "auto".
F32_KERNELS = (F32_KERNEL, ONEDNN_KERNEL)


@functools.cache
def load_f32_gemm() -> ModuleType | None:
    """The C++ kernel (``pack_f32_weight``, ``f32_linear``, ``compiled_isas``), compiled first on a
    machine that has not yet; None (one WARNING) if that fails."""
    return load_extension(EXTENSION)


def compiled_isa() -> str:
    """The code the extension compiles on this machine's CPU (``-march=native``, so its own flags,
    never a caller's): ``"avx512"`` where it has ``avx512f``, else ``"avx2"``."""
    return "avx512" if "avx512f" in cpu_flags() else "avx2"


def f32_kernel_for(cpu_isa: str = "auto", flags: frozenset[str] | None = None, kernel: str = "auto") -> tuple[str, str]:
    """Which kernel runs a float32 model's linear layers here, and why.

    Args:
        cpu_isa: ``KernelConfig.cpu_isa``: "auto", or a ``CpuIsa`` name (``portable`` forces oneDNN).
        flags: the CPU's flags (default: this machine's).
        kernel: ``KernelConfig.cpu_f32_gemm``: "auto", or one of ``F32_KERNELS`` to force it.
    Returns:
        (``"f32_gemm"`` or ``"onednn"``, the reason in words, for the log).
    Raises:
        ValueError: for a ``kernel`` not in ``("auto",) + F32_KERNELS``; as
            ``platforms.cpu.resolve_cpu_isa`` for a path the CPU cannot run.
    """
    if kernel not in ("auto",) + F32_KERNELS:
        raise ValueError(f"cpu_f32_gemm (${envs.PAGEDLLM_CPU_F32_GEMM}) must be one of {('auto',) + F32_KERNELS}, "
                         f"got {kernel!r}")
    if kernel == ONEDNN_KERNEL:
        return ONEDNN_KERNEL, "cpu_f32_gemm 'onednn' (oneDNN's packed inner product)"
    flags = cpu_flags() if flags is None else flags
    isa = resolve_cpu_isa(cpu_isa, flags)
    paths = (CpuIsa.AVX2, CpuIsa.AVX512, CpuIsa.AVX512_BF16)
    compiled = compiled_isa()
    why = kernel_unavailable(EXTENSION, compiled, isa, paths, F32_GEMM_FLAGS, flags)
    if why:
        return ONEDNN_KERNEL, f"not the float32 GEMM: {why}"
    forced = "cpu_f32_gemm 'f32_gemm', " if kernel == F32_KERNEL else ""
    return F32_KERNEL, f"{forced}{compiled} float32 GEMM, batch-invariant"


class F32Linear(KernelLinear):
    """``y = x @ W^T + b`` in float32 through ``csrc/f32_gemm.cpp`` (module docstring).

    Args:
        weight: [out_features, in_features] float32 on the CPU; copied into the packed layout
            (``[ceil(N / 16), K, 16]`` float32: the weight's bytes plus the padding of the last 16 outputs).
        bias: [out_features] or None (float32, added after the sum).
        module: the loaded extension (``load_f32_gemm()``).
    Shapes:
        x: [..., in_features] float32 -> [..., out_features] float32.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, module: ModuleType) -> None:
        super().__init__()
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        self._ext = module
        self.packed_weight = module.pack_f32_weight(weight.detach().float().contiguous())
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float().contiguous()
        y = self._ext.f32_linear(x2, self.packed_weight, self.bias, self.out_features)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
