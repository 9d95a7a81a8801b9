"""The int8 weight-only GEMM for AVX-512 VNNI CPUs (``csrc/int8_gemm.cpp``) and when it runs.

``int8_weight_only`` layers (``layers/weight_only.py``) have two kernels:

- ``"torch"`` (portable, every CPU): torch's ``aten._weight_int8pack_mm`` on a bfloat16 input row,
  bfloat16 output.
- ``"vnni"`` (CPUs with ``avx512f avx512bw avx512vl avx512_vnni``): the weights stay int8 and are
  multiplied by the activation row written in 16-bit fixed point (per row: ``X = round(x * 32767 /
  max|x|)``) with exact integer sums (``vpdpbusd``), then scaled in float32; the result comes out in
  the input's dtype. Each element of the row errs by at most ``max|x| / 65534`` (bfloat16 rounding,
  what the torch kernel does first, errs by up to ``|x| / 512``), and a row's result does not depend
  on the other rows of the batch. The arithmetic and the packed layout are derived in the C++
  file's header.

Why a kernel of our own: at one to eight rows both torch's kernel and a bfloat16-dot-product
kernel spend more time widening int8 weights to floats than the memory takes to deliver
them; this one reads the weights near the memory's rate at one row and keeps up with oneDNN's
bfloat16 GEMM at prompt-chunk sizes (docs/performance.md; ``pagedllm bench kernels --backends
int8_wo,int8_wo_torch``).

``cpu_isa`` (``KernelConfig.cpu_isa``, ``$PAGEDLLM_CPU_ISA``) = ``avx2`` or ``portable`` forces the torch
kernel on any CPU (how tests compare the two).

On CPUs with AVX2 and FMA but no VNNI the extension compiles ``int8_weight_only_mm`` with the same
arithmetic through ``vpmaddwd`` (int16 pairs into int32; ``compiled_isas()`` = ``["avx2"]``). The
exact greedy head's cheap pass uses it (``sample/greedy_head.py``, kind ``"int8_avx2"``;
``int8_avx2_unavailable``); ``int8_weight_only`` layers do not (torch's kernel runs there).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

from pagedllm.platforms.cpu import CpuIsa, cpu_flags, resolve_cpu_isa
from pagedllm.platforms.cpu_extension import CpuExtension, kernel_unavailable, load_extension

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent / "csrc" / "int8_gemm.cpp"
EXTENSION = CpuExtension("int8_gemm", SOURCE, "int8 weight-only GEMM (AVX-512 VNNI / AVX2)",
                         "torch's _weight_int8pack_mm")
# /proc/cpuinfo flags the kernel needs (the C++ guards on the same set).
VNNI_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_vnni")
# The AVX2 code's flags (compiled where the CPU has these and not VNNI_FLAGS).
AVX2_FLAGS = ("avx2", "fma")
TORCH_KERNEL = "torch"
VNNI_KERNEL = "vnni"
# The kernel sums at most this many columns in int32 (and reads rows 16 columns at a time).
VNNI_MAX_COLUMNS = 65536


@functools.cache
def load_int8_gemm() -> ModuleType | None:
    """The C++ kernel (``pack_int8_weight``, ``unpack_int8_weight``, ``int8_weight_only_mm``,
    ``compiled_isas``), compiled first on a machine that has not yet; None (one WARNING) if that fails."""
    return load_extension(EXTENSION)


def missing_vnni_flags(flags: frozenset[str] | None = None) -> list[str]:
    """The ``VNNI_FLAGS`` this CPU (or ``flags``) lacks; empty where the kernel can run."""
    flags = cpu_flags() if flags is None else flags
    return [f for f in VNNI_FLAGS if f not in flags]


def int8_kernel_for(cpu_isa: str = "auto", flags: frozenset[str] | None = None) -> tuple[str, str]:
    """Which int8 weight-only kernel runs here, and why.

    Args:
        cpu_isa: ``KernelConfig.cpu_isa``: "auto", or a ``CpuIsa`` name (below ``avx512`` forces "torch").
        flags: the CPU's flags (default: this machine's).
    Returns:
        (``"vnni"`` or ``"torch"``, the reason in words, for the log).
    Raises:
        ValueError: as ``platforms.cpu.resolve_cpu_isa`` for a path the CPU cannot run.
    """
    flags = cpu_flags() if flags is None else flags
    why = kernel_unavailable(EXTENSION, "avx512_vnni", resolve_cpu_isa(cpu_isa, flags),
                             (CpuIsa.AVX512, CpuIsa.AVX512_BF16), VNNI_FLAGS, flags)
    return (TORCH_KERNEL, why) if why else (VNNI_KERNEL, "avx512_vnni")


def int8_avx2_unavailable(cpu_isa: str = "auto", flags: frozenset[str] | None = None) -> str | None:
    """Why the kernel's AVX2 code cannot run here, in words; None when it can (then it is loaded).

    It is compiled only where the CPU has AVX2 and FMA but not ``VNNI_FLAGS`` (``-march=native``),
    and runs on the ``avx2`` and ``avx512`` paths of ``cpu_isa``.

    Raises:
        ValueError: as ``platforms.cpu.resolve_cpu_isa`` for a path the CPU cannot run.
    """
    flags = cpu_flags() if flags is None else flags
    if not missing_vnni_flags(flags):
        return "the CPU has AVX-512 VNNI (the kernel's VNNI code is compiled instead)"
    return kernel_unavailable(EXTENSION, "avx2", resolve_cpu_isa(cpu_isa, flags), (CpuIsa.AVX2, CpuIsa.AVX512),
                              AVX2_FLAGS, flags)

