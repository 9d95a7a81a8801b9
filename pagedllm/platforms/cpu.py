"""The CPU's instruction sets, and the code paths and dtype they allow.

The engine picks its fastest path from the CPU's flags at run time: the paged-attention kernel's
micro-kernels (``attention/csrc``: portable C++, AVX2, AVX-512, AVX-512 with bf16 dot products)
and what ``dtype="auto"`` means on the CPU (bfloat16 where the CPU multiplies it natively:
``avx512_bf16`` or AMX, else float32). Flags come from ``/proc/cpuinfo`` (Linux), and torch's
own probes (``torch.cpu._is_avx512_bf16_supported`` / ``_is_amx_tile_supported``) where that
file is missing.

``KernelConfig.cpu_isa`` ("auto" or a :class:`CpuIsa` name; ``EngineArgs`` defaults it to
``$PAGEDLLM_CPU_ISA``) forces a path, e.g. ``avx2`` on an AVX-512 machine to run (and test) the
AVX2 code; forcing a path the CPU cannot run is a ``ValueError`` naming the missing flag.
"""

from __future__ import annotations

import enum
import functools

from pagedllm import envs

CPU_ISA_ENV = envs.PAGEDLLM_CPU_ISA
CPU_GEMM_ENV = envs.PAGEDLLM_CPU_GEMM


class CpuGemm(enum.Enum):
    """Which library multiplies linear layers on the CPU (``KernelConfig.cpu_gemm``, ``layers/linear.py``)."""

    ONEDNN = "onednn"
    TORCH = "torch"


def parse_cpu_gemm(name: str) -> CpuGemm:
    """The kernel named ``name`` (``KernelConfig.cpu_gemm``; the one check of that setting).

    Raises:
        ValueError: for a name other than ``onednn`` / ``torch`` (naming ``$PAGEDLLM_CPU_GEMM``,
            where the value usually comes from).
    """
    try:
        return CpuGemm(str(name).strip().lower())
    except ValueError:
        raise ValueError(f"cpu_gemm (${CPU_GEMM_ENV}) must be one of {[g.value for g in CpuGemm]}, "
                         f"got {name!r}") from None


class CpuIsa(enum.Enum):
    """A CPU code path, from the most portable to the fastest. The value is the name used in
    ``KernelConfig.cpu_isa`` and in the kernel's ``compiled_isas()``."""

    PORTABLE = "portable"
    AVX2 = "avx2"
    AVX512 = "avx512"
    AVX512_BF16 = "avx512_bf16"


# /proc/cpuinfo flags each path needs.
REQUIRED_FLAGS: dict[CpuIsa, tuple[str, ...]] = {
    CpuIsa.PORTABLE: (),
    CpuIsa.AVX2: ("avx2", "fma"),
    CpuIsa.AVX512: ("avx2", "fma", "avx512f", "avx512bw"),
    CpuIsa.AVX512_BF16: ("avx2", "fma", "avx512f", "avx512bw", "avx512_bf16"),
}
# Flags that make bfloat16 matmuls native (oneDNN runs them on AVX-512 bf16 or AMX tiles).
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def read_cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> frozenset[str]:
    """The ``flags`` of the first processor in ``cpuinfo``; where the file cannot be read, the
    flags torch can probe (``avx512_bf16``, ``amx_bf16``/``amx_tile``, and ``avx2`` + ``fma`` /
    ``avx512f`` + ``avx512bw`` from ``torch.backends.cpu.get_cpu_capability()``)."""
    try:
        with open(cpuinfo, encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    import torch

    flags: set[str] = set()
    capability = torch.backends.cpu.get_cpu_capability()
    if capability in ("AVX2", "AVX512"):
        flags |= {"avx2", "fma"}
    if capability == "AVX512":
        flags |= {"avx512f", "avx512bw"}
    if getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)():
        flags.add("avx512_bf16")
    if getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        flags |= {"amx_tile", "amx_bf16"}
    return frozenset(flags)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This machine's CPU flags (read once per process)."""
    return read_cpu_flags()


def parse_cpu_isa(name: str) -> CpuIsa | None:
    """``"auto"`` -> None, else the :class:`CpuIsa` of that name (the one check of
    ``KernelConfig.cpu_isa``).

    Raises:
        ValueError: for another name (naming ``$PAGEDLLM_CPU_ISA``, where it usually comes from).
    """
    name = str(name).strip().lower()
    if name == "auto":
        return None
    try:
        return CpuIsa(name)
    except ValueError:
        raise ValueError(f"cpu_isa (${CPU_ISA_ENV}) must be 'auto' or one of {[i.value for i in CpuIsa]}, "
                         f"got {name!r}") from None


def missing_flags(isa: CpuIsa, flags: frozenset[str]) -> list[str]:
    """The flags ``isa`` needs that ``flags`` lacks (empty: the CPU can run it)."""
    return [f for f in REQUIRED_FLAGS[isa] if f not in flags]


def best_cpu_isa(flags: frozenset[str]) -> CpuIsa:
    """The fastest :class:`CpuIsa` whose flags are all in ``flags``."""
    for isa in reversed(CpuIsa):
        if not missing_flags(isa, flags):
            return isa
    return CpuIsa.PORTABLE


def resolve_cpu_isa(name: str, flags: frozenset[str] | None = None) -> CpuIsa:
    """The path to run: the best the CPU allows for ``"auto"``, else the one named.

    Args:
        name: ``KernelConfig.cpu_isa``.
        flags: the CPU's flags (default: this machine's).
    Raises:
        ValueError: for an unknown name, or a named path whose flags the CPU lacks (they are named).
    """
    flags = cpu_flags() if flags is None else flags
    isa = parse_cpu_isa(name)
    if isa is None:
        return best_cpu_isa(flags)
    missing = missing_flags(isa, flags)
    if missing:
        raise ValueError(f"cpu_isa (${CPU_ISA_ENV})={isa.value!r} needs the CPU flags {missing}, "
                         "which this CPU lacks")
    return isa


def native_bf16(cpu_isa: str = "auto", flags: frozenset[str] | None = None) -> tuple[bool, str]:
    """Whether bfloat16 is this CPU's fast dtype, and why (for the log).

    bfloat16 is native when the CPU has ``avx512_bf16`` or ``amx_bf16`` (its linear layers then run bf16
    inner products on them) and ``cpu_isa`` does not force a path without bf16 (``avx2``,
    ``avx512``, ``portable``: there bf16 runs on emulation, several times slower than float32).

    Raises:
        ValueError: as :func:`resolve_cpu_isa`.
    """
    flags = cpu_flags() if flags is None else flags
    isa = resolve_cpu_isa(cpu_isa, flags)
    present = [f for f in NATIVE_BF16_FLAGS if f in flags]
    if parse_cpu_isa(cpu_isa) is not None and isa is not CpuIsa.AVX512_BF16:
        return False, f"cpu_isa={isa.value!r} (${CPU_ISA_ENV}) forces a path without bf16 instructions"
    if not present:
        return False, f"the CPU has none of {list(NATIVE_BF16_FLAGS)}, so bfloat16 matmuls would be emulated"
    return True, f"the CPU has {present}: bfloat16 matmuls run natively"
