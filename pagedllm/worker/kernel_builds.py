"""Build the C++ kernels this CPU can run ahead of their first use, several compilers at once.

Left alone, each kernel is compiled by the first process that loads it (``platforms.cpu_extension``:
one g++, 10-30 s), and a process that needs a kernel another one is compiling waits on torch's
lock file meanwhile. On a machine with an empty kernel cache that serializes: two test workers
starting engines wait kernel by kernel, each using one core. ``prebuild`` compiles every kernel of
``KERNELS`` whose CPU flags this machine has, ``jobs`` at a time (one g++ each, in a pool of
processes), so later processes only load them. The test suite's parallel tier runs it before its
workers start (``tests/conftest.py``); ``python -m pagedllm.worker.kernel_builds`` runs it by hand.

Checking the cache imports torch and the kernels' modules here (about a second) and hashes each
source; a kernel already built costs nothing more. One that fails to build is reported and left to
its fallback, as a first load would (a later call tries it again).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import importlib
import multiprocessing
import os
import sys
import time
from dataclasses import dataclass

from pagedllm.platforms.cpu import cpu_flags


@dataclass(frozen=True)
class KernelEntry:
    """Where one kernel's ``CpuExtension`` lives, and the CPU flags without which it compiles no
    code path the engine would run (its chooser's own requirement, read from its module).

    Attributes:
        module: the module that defines it ("pagedllm.layers.f32_gemm").
        attribute: the module attribute holding the ``CpuExtension``.
        flags_attribute: the attribute holding the flags it needs (a tuple of ``/proc/cpuinfo``
            names, all required), or None: every CPU.
        flags_module: the module of ``flags_attribute`` (default: ``module``).
    """

    module: str
    attribute: str = "EXTENSION"
    flags_attribute: str | None = None
    flags_module: str | None = None

    def extension(self):
        """The ``CpuExtension`` (imports ``module``)."""
        return getattr(importlib.import_module(self.module), self.attribute)

    def flags(self) -> tuple[str, ...]:
        """The CPU flags it needs (imports ``module``)."""
        if self.flags_attribute is None:
            return ()
        return tuple(getattr(importlib.import_module(self.flags_module or self.module), self.flags_attribute))


# Every kernel of the project, the longest build first (paged attention, ~2x the others).
KERNELS: tuple[KernelEntry, ...] = (
    KernelEntry("pagedllm.attention.backends.cpu_paged"),
    KernelEntry("pagedllm.layers.fused_ops"),
    KernelEntry("pagedllm.layers.int8_gemm", flags_attribute="AVX2_FLAGS"),
    KernelEntry("pagedllm.lora.punica"),
    # Its code is the float32 GEMM's micro-kernel (f32_gemm.h), and it runs F32Linear experts only.
    KernelEntry("pagedllm.layers.f32_moe", flags_attribute="F32_GEMM_FLAGS", flags_module="pagedllm.layers.f32_gemm"),
    KernelEntry("pagedllm.layers.f32_gemm", flags_attribute="F32_GEMM_FLAGS"),
    KernelEntry("pagedllm.layers.bf16_gemm", "AVX2_EXTENSION", "AVX2_BF16_FLAGS"),
    KernelEntry("pagedllm.layers.bf16_gemm", "EXTENSION", "BF16_GEMM_FLAGS"),
    KernelEntry("pagedllm.layers.amx_gemm", "EXTENSION", "AMX_GEMM_FLAGS"),
    KernelEntry("pagedllm.watermarking.philox"),
)


def kernels_for(flags: frozenset[str] | None = None) -> list[KernelEntry]:
    """The entries of ``KERNELS`` whose flags are all in ``flags`` (default: this CPU's)."""
    flags = cpu_flags() if flags is None else flags
    return [k for k in KERNELS if all(f in flags for f in k.flags())]


def _build(ext) -> tuple[str, bool]:
    """Load (compiling if needed) one ``CpuExtension`` in this process: (label, loaded)."""
    from pagedllm.platforms.cpu_extension import load_extension

    return ext.label, load_extension(ext) is not None


@dataclass(frozen=True)
class PrebuildResult:
    """What ``prebuild`` did.

    Attributes:
        cached: labels of the kernels already in the cache.
        built: labels compiled now.
        failed: labels that could not be built (their fallback runs; the warning names why).
        seconds: wall time of the whole call.
    """

    cached: tuple[str, ...]
    built: tuple[str, ...]
    failed: tuple[str, ...]
    seconds: float

    def summary(self) -> str:
        """One line: "kernels: 2 built (a, b), 7 already built, 0 failed (-) in 30.1 s"."""
        return (f"kernels: {len(self.built)} built ({', '.join(self.built) or '-'}), {len(self.cached)} already "
                f"built, {len(self.failed)} failed ({', '.join(self.failed) or '-'}) in {self.seconds:.1f} s")


def prebuild(entries: list[KernelEntry] | None = None, jobs: int | None = None) -> PrebuildResult:
    """Compile every kernel of ``entries`` (default ``kernels_for()``) not yet in the cache,
    ``jobs`` compilers at once (default: the cores this process may run on).

    The builds run in a pool of ``spawn``ed processes (each imports torch once and takes the next
    kernel when one is done); this process checks the cache. Process-safe like
    ``load_extension``: a kernel another process is compiling is waited for, not built twice.

    Returns:
        A ``PrebuildResult``.
    """
    start = time.perf_counter()
    extensions = [e.extension() for e in (kernels_for() if entries is None else entries)]
    todo = [ext for ext in extensions if not ext.library_path().is_file()]
    cached = tuple(ext.label for ext in extensions if ext not in todo)
    built: list[str] = []
    failed: list[str] = []
    if todo:
        jobs = max(1, min(len(todo), jobs or len(os.sched_getaffinity(0))))
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            for label, ok in pool.map(_build, todo):
                (built if ok else failed).append(label)
    return PrebuildResult(cached, tuple(built), tuple(failed), time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    """``python -m pagedllm.worker.kernel_builds [--jobs N]``: prebuild and print what it did;
    exit status 1 if a kernel failed to build."""
    parser = argparse.ArgumentParser(prog="python -m pagedllm.worker.kernel_builds",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=None, help="compilers at once (default: the number of cores)")
    args = parser.parse_args(argv)
    if args.jobs is not None and args.jobs < 1:
        parser.error(f"--jobs must be at least 1, got {args.jobs}")
    result = prebuild(jobs=args.jobs)
    print(result.summary())
    return 1 if result.failed else 0


if __name__ == "__main__":
    sys.exit(main())
