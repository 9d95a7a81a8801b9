"""bfloat16 linear layers through kernels of our own (``csrc/bf16_gemm.cpp`` on AVX-512 BF16 CPUs;
``csrc/amx_gemm.cpp``, ``layers/amx_gemm.py`` on AMX CPUs; ``csrc/bf16_gemm_avx2.cpp`` on AVX2 + FMA
CPUs without either), and which kernel runs (``bf16_kernel_for``).

A bf16 model's linear layers and LM head run on one of four kernels, all with the weight packed
once after loading (the plain weight is not kept, except the tied embedding the token lookup reads):

- ``"amx_bf16"`` (CPUs with AMX, the default there): our AMX GEMM, ``Bf16Linear`` with the
  ``amx_gemm`` module: ``tdpbf16ps`` on 16-row tiles, the same packed weight. Measured on a 2-core
  Xeon with AMX (docs/benchmarks.md, "AMX: bf16 kernels per M"): at least as fast as the AVX-512
  GEMM at every M = 1..512 (the same at 1-4 rows, where the weights stream from memory; 2-4.7x
  faster from 16 rows); 1.1-1.4x faster than oneDNN's AMX kernels at 1-64 rows, 1.07-1.35x
  slower at 128-512; engine throughput 2.07x the AVX-512 GEMM's and 1.06x oneDNN's.
- ``"avx512_bf16"`` (CPUs with ``avx512f avx512bw avx512vl avx512_bf16`` and no AMX): ``Bf16Linear``,
  ``vdpbf16ps`` on 8 rows x 32 outputs of float32 accumulators per call, each weight block
  prefetched 4 KiB ahead into L2. At the 8-32 rows of a decode step oneDNN's kernel
  used about half of the machine's ``vdpbf16ps`` rate with the weights streaming from memory;
  this one takes less time there and ties oneDNN on prompt chunks (docs/performance.md;
  ``benchmarks/cpu_paths.py --parts linear``).
- ``"avx2_bf16"`` (CPUs with ``avx2 fma`` and neither ``avx512_bf16`` nor AMX, e.g. AMD EPYC
  before Zen 4, Intel before Cooper Lake): ``Bf16Linear`` on the same packed weight, each bf16 weight
  widened to float32 in registers (a shift or a mask) and two ``vfmadd231ps`` per column pair in
  ``vdpbf16ps``'s order, so it gives the AVX-512 kernel's bits (outside subnormals, see the C++
  header). A decode step streams half the float32 weights' bytes (docs/benchmarks.md, "bf16 on
  AVX2 CPUs"); oneDNN has no bf16 inner product there (torch's bf16 matmul is several times slower
  than float32).
- ``"onednn"``: oneDNN's packed inner product (``layers/linear.py``'s ``PackedLinear``; AVX-512
  bf16 or AMX tiles; on CPUs without native bf16, torch's ``F.linear``).

All accumulate in float32 and round the result to bfloat16 to nearest even; they differ only in
the order of the float32 additions, so a bf16 model's outputs can differ between them where a
logit or activation lies at a bf16 rounding boundary.

Batch invariance: the GEMMs sum each output in one fixed order (k ascending, no split-K; the row
groups and threads only decide *which* rows and outputs a call computes), so a row's result is
the same bits at any row count and beside any other rows: a greedy bf16 request gives the same
tokens alone, in any batch, with prefix caching on or off, across chunked-prefill boundaries
(``tests/layers/test_linear_batch_invariance.py``, ``tests/layers/test_amx_gemm.py``,
``tests/models/test_default_model_greedy.py``). A model runs one kernel for every M (never one
by row count). oneDNN does not promise that (its float32 one-row call rounds differently at
large K, see ``PackedLinear``; on AMX its bf16 tile kernels change with the row count:
docs/benchmarks.md, "Batch-invariant bf16"), so it runs bf16 only where neither GEMM can, with
``bf16_kernel_for(batch_invariant=False)`` on AMX, or when forced.

``cpu_isa`` (``KernelConfig.cpu_isa``, ``$PAGEDLLM_CPU_ISA``) ``avx2`` / ``avx512`` forces the AVX2
GEMM, ``portable`` oneDNN; ``cpu_bf16_gemm`` (``KernelConfig.cpu_bf16_gemm``,
``$PAGEDLLM_CPU_BF16_GEMM``: ``amx_bf16``, ``avx512_bf16``, ``avx2_bf16``, ``onednn``) forces one
kernel (how benchmarks and tests compare them).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

import torch

from pagedllm import envs
from pagedllm.layers.amx_gemm import AMX_GEMM_FLAGS, AMX_K_MULTIPLE, AMX_KERNEL, load_amx_gemm
from pagedllm.layers.amx_gemm import EXTENSION as AMX_EXTENSION
from pagedllm.layers.kernel_linear import KernelLinear
from pagedllm.platforms.cpu import CpuIsa, cpu_flags, resolve_cpu_isa
from pagedllm.platforms.cpu_extension import CpuExtension, kernel_unavailable, load_extension

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "bf16_gemm.cpp"
PACK_HEADER = SOURCE.parent / "bf16_pack.h"   # the packed layout, shared with csrc/amx_gemm.cpp
EXTENSION = CpuExtension("bf16_gemm", SOURCE, "bfloat16 GEMM (AVX-512 BF16)", "oneDNN's bf16 inner product",
                         headers=(PACK_HEADER, PACK_HEADER.parent / "linear_bias.h"))
AVX2_SOURCE = SOURCE.parent / "bf16_gemm_avx2.cpp"
AVX2_EXTENSION = CpuExtension("bf16_avx2_gemm", AVX2_SOURCE, "bfloat16 GEMM (AVX2 + FMA)", "torch's bf16 F.linear",
                              headers=(PACK_HEADER, PACK_HEADER.parent / "linear_bias.h"))
# /proc/cpuinfo flags the kernel needs (the C++ guards on the same set).
BF16_GEMM_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")
AVX2_BF16_FLAGS = ("avx2", "fma")
# The ``cpu_isa`` paths the AVX2 GEMM runs on (``portable`` forces oneDNN).
AVX2_BF16_PATHS = (CpuIsa.AVX2, CpuIsa.AVX512, CpuIsa.AVX512_BF16)
ONEDNN_KERNEL = "onednn"
BF16_KERNEL = "avx512_bf16"
AVX2_KERNEL = "avx2_bf16"
# ``KernelConfig.cpu_bf16_gemm``'s values besides "auto" (config.py keeps the same names).
BF16_KERNELS = (AMX_KERNEL, BF16_KERNEL, AVX2_KERNEL, ONEDNN_KERNEL)


@functools.cache
def load_bf16_gemm() -> ModuleType | None:
    """The C++ kernel (``pack_bf16_weight``, ``bf16_linear``, ``compiled_isas``), compiled first on a
    machine that has not yet; None (one WARNING) if that fails."""
    return load_extension(EXTENSION)


@functools.cache
def load_avx2_bf16_gemm() -> ModuleType | None:
    """The AVX2 + FMA kernel (``csrc/bf16_gemm_avx2.cpp``: the same ``pack_bf16_weight``,
    ``bf16_linear`` and ``compiled_isas`` as ``load_bf16_gemm()``'s), compiled first on a machine that
    has not yet; None (one WARNING) if that fails."""
    return load_extension(AVX2_EXTENSION)


def _amx_unavailable(isa: CpuIsa, flags: frozenset[str]) -> str | None:
    """Why the AMX GEMM cannot run here (path, flags, build, Linux's tile permission); None if it can."""
    why = kernel_unavailable(AMX_EXTENSION, AMX_KERNEL, isa, (CpuIsa.AVX512_BF16,), AMX_GEMM_FLAGS, flags)
    if why:
        return why
    refused = load_amx_gemm().amx_unavailable()
    return refused or None


def bf16_kernel_for(cpu_isa: str = "auto", flags: frozenset[str] | None = None,
                    batch_invariant: bool = True, kernel: str = "auto") -> tuple[str, str]:
    """Which kernel runs a bf16 model's linear layers here, and why.

    Default (``kernel="auto"``): AMX CPUs run the AMX GEMM (``layers/amx_gemm.py``), other
    ``avx512_bf16`` CPUs the AVX-512 GEMM, CPUs with ``avx2 fma`` the AVX2 GEMM, the rest oneDNN;
    each falls back to the next with the reason. One kernel for every row count of a model, never
    one by M: the GEMMs are batch-invariant.

    Args:
        cpu_isa: ``KernelConfig.cpu_isa``: "auto", or a ``CpuIsa`` name (``avx2`` / ``avx512``: the
            AVX2 GEMM at most; ``portable`` forces oneDNN).
        flags: the CPU's flags (default: this machine's).
        batch_invariant: False lets a CPU with AMX keep oneDNN's tile kernels (a row's result
            may then depend on the batch); the default runs a GEMM of ours wherever it can.
        kernel: ``KernelConfig.cpu_bf16_gemm``: "auto", or one of ``BF16_KERNELS`` to force it
            (for comparisons; a forced GEMM that cannot run falls back as above, naming why).
    Returns:
        (``"amx_bf16"``, ``"avx512_bf16"``, ``"avx2_bf16"`` or ``"onednn"``, the reason in words,
        for the log).
    Raises:
        ValueError: as ``platforms.cpu.resolve_cpu_isa`` for a path the CPU cannot run; for a
            ``kernel`` not in ``("auto",) + BF16_KERNELS``.
    """
    if kernel not in ("auto",) + BF16_KERNELS:
        raise ValueError(f"cpu_bf16_gemm (${envs.PAGEDLLM_CPU_BF16_GEMM}) must be one of "
                         f"{('auto',) + BF16_KERNELS}, got {kernel!r}")
    flags = cpu_flags() if flags is None else flags
    isa = resolve_cpu_isa(cpu_isa, flags)
    forced = f"cpu_bf16_gemm {kernel!r}" if kernel != "auto" else ""
    if kernel == ONEDNN_KERNEL:
        return ONEDNN_KERNEL, f"{forced} (oneDNN's inner product; not batch-invariant on AMX)"
    amx = "amx_bf16" in flags
    if amx and not batch_invariant and kernel == "auto":
        return ONEDNN_KERNEL, "the CPU has AMX and batch invariance is off (oneDNN's tile kernels)"
    amx_why = None
    if kernel in ("auto", AMX_KERNEL):
        amx_why = _amx_unavailable(isa, flags)
        if amx_why is None:
            return AMX_KERNEL, (forced or "AMX") + (
                ", batch-invariant (at least as fast as the AVX-512 GEMM at every row count measured, "
                "docs/benchmarks.md)")
    not_amx = f"; not the AMX GEMM: {amx_why}" if amx_why and (amx or kernel == AMX_KERNEL) else ""
    avx512_why = None
    if kernel != AVX2_KERNEL:
        avx512_why = kernel_unavailable(EXTENSION, BF16_KERNEL, isa, (CpuIsa.AVX512_BF16,), BF16_GEMM_FLAGS, flags)
        if avx512_why is None:
            return BF16_KERNEL, (forced or "avx512_bf16") + ", batch-invariant" + not_amx
    avx2_why = kernel_unavailable(AVX2_EXTENSION, AVX2_KERNEL, isa, AVX2_BF16_PATHS, AVX2_BF16_FLAGS, flags)
    not_avx512 = f"; not the AVX-512 GEMM: {avx512_why}" if avx512_why else ""
    if avx2_why:
        return ONEDNN_KERNEL, (f"{avx512_why}; not the AVX2 GEMM: {avx2_why}" if avx512_why
                               else f"not the AVX2 GEMM: {avx2_why}") + not_amx
    return AVX2_KERNEL, (forced if kernel == AVX2_KERNEL else "avx2_bf16") + (
        ", batch-invariant (bf16 weights widened to float32 FMA in vdpbf16ps's order)") + not_avx512 + not_amx


def bf16_module(kernel: str) -> ModuleType | None:
    """The loaded extension of ``kernel`` (``"amx_bf16"``, ``"avx512_bf16"`` or ``"avx2_bf16"``, from
    ``bf16_kernel_for``), for ``Bf16Linear``; None for oneDNN or one that failed to build."""
    if kernel == AMX_KERNEL:
        return load_amx_gemm()
    if kernel == BF16_KERNEL:
        return load_bf16_gemm()
    if kernel == AVX2_KERNEL:
        return load_avx2_bf16_gemm()
    return None


def k_multiple(module: ModuleType) -> int:
    """What ``in_features`` must be a multiple of for ``module``'s kernel: 32 (AMX tile rows) or 2."""
    return AMX_K_MULTIPLE if AMX_KERNEL in module.compiled_isas() else 2


class Bf16Linear(KernelLinear):
    """``y = x @ W^T + b`` in bfloat16 through ``csrc/bf16_gemm.cpp``, ``csrc/amx_gemm.cpp`` or
    ``csrc/bf16_gemm_avx2.cpp`` (module docstring; all take the same packed weight).

    Args:
        weight: [out_features, in_features] bfloat16 (or castable) on the CPU; ``in_features`` even.
            Copied into the packed layout (``[ceil(N / 16), K / 2, 32]`` bfloat16, the same bytes
            as the weight plus the padding of the last 16 outputs).
        bias: [out_features] or None (kept in float32, added before the bf16 rounding).
        module: the loaded extension (``load_bf16_gemm()``, ``load_avx2_bf16_gemm()`` or
            ``amx_gemm.load_amx_gemm()``).
    Shapes:
        x: [..., in_features] bfloat16 -> [..., out_features] bfloat16.
    Raises:
        ValueError: for an odd ``in_features``, or one not a multiple of 32 with the AMX module
            (``k_multiple``).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, module: ModuleType) -> None:
        super().__init__()
        self.out_features, self.in_features = int(weight.shape[0]), int(weight.shape[1])
        need = k_multiple(module)
        if self.in_features % need:
            raise ValueError(f"Bf16Linear ({module.compiled_isas()}) needs in_features a multiple of {need}, "
                             f"got {self.in_features}")
        self._ext = module
        self.packed_weight = module.pack_bf16_weight(weight.detach().to(torch.bfloat16).contiguous())
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()
        y = self._ext.bf16_linear(x2, self.packed_weight, self.bias, self.out_features)
        return y.view(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
