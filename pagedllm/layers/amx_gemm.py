"""bfloat16 linear layers on Intel AMX tiles through a kernel of our own (``csrc/amx_gemm.cpp``).

The kernel takes the weight packed as the AVX-512 BF16 GEMM packs it (``csrc/bf16_pack.h``:
``[N / 16, K / 2, 32]`` bfloat16, which is AMX's B-tile layout), so ``bf16_gemm.Bf16Linear`` runs
it unchanged with this module in place of that one. It sums every output in one order at any row
count (a C tile takes the K / 32 chunks in ascending order; x is read in zero-padded 16-row
tiles; no split-K), so a row's result never depends on the other rows of the batch: the property
the AVX-512 GEMM has and oneDNN's AMX kernels lack. ``bf16_gemm.bf16_kernel_for``
decides where it runs (docs/benchmarks.md, "AMX: bf16 kernels per M").

Needs the CPU flags ``AMX_GEMM_FLAGS``, Linux's permission for the tile state (asked once per
process, ``arch_prctl(ARCH_REQ_XCOMP_PERM)``) and K a multiple of 32.
"""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType

from pagedllm.platforms.cpu_extension import CpuExtension, load_extension

SOURCE = Path(__file__).resolve().parent / "csrc" / "amx_gemm.cpp"
PACK_HEADER = SOURCE.parent / "bf16_pack.h"
# -mamx-* for this source only (-march=native has them on an AMX CPU; a compiler that does not
# know them fails this build alone, and the AVX-512 GEMM runs).
EXTENSION = CpuExtension("amx_gemm", SOURCE, "bfloat16 GEMM (AMX)", "the AVX-512 BF16 GEMM",
                         extra_cflags=("-O3", "-march=native", "-fopenmp", "-mamx-tile", "-mamx-bf16"),
                         headers=(PACK_HEADER, PACK_HEADER.parent / "linear_bias.h"))
# /proc/cpuinfo flags the kernel needs (tiles, and AVX-512 BF16 for the bias and the bf16 rounding).
AMX_GEMM_FLAGS = ("amx_tile", "amx_bf16", "avx512f", "avx512bw", "avx512vl", "avx512_bf16")
AMX_KERNEL = "amx_bf16"
# K granularity: one A-tile row is 32 bfloat16 columns.
AMX_K_MULTIPLE = 32


@functools.cache
def load_amx_gemm() -> ModuleType | None:
    """The C++ kernel (``pack_bf16_weight``, ``bf16_linear``, ``amx_unavailable``, ``compiled_isas``),
    compiled first on a machine that has not yet; None (one WARNING) if that fails."""
    return load_extension(EXTENSION)
