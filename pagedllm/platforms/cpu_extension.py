"""Build (once per machine) and load the project's C++ CPU extensions.

One builder for every ``csrc`` source: the paged-attention kernel (``attention/csrc``) and the
fused elementwise ops (``layers/csrc``). Each is compiled with ``torch.utils.cpp_extension.load``
(g++ with ``-O3 -march=native -fopenmp`` through ninja; 20-40 s on 2 cores) into
``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/pagedllm/torch_extensions``, under a name hashing the
source, the flags, torch's version, Python's and this CPU's flags, so later processes import the
``.so`` in milliseconds and a different CPU or torch rebuilds it. A build that fails (no compiler,
no ninja, a compile error) logs one WARNING naming what runs instead, and the caller's fallback
(the eager torch code) runs.

The sources include ATen's core headers (``<ATen/core/Tensor.h>``), torch's pybind11 header
(``<torch/csrc/utils/pybind.h>``) and ``platforms/csrc/cpu_tensor.h`` (new CPU tensors through
``at::detail::empty_cpu``, on the include path of every build) instead of ``<torch/extension.h>``,
whose whole C++ frontend took ~2.5x the compile time and ~2x the compiler's memory, or the
``<ATen/ops/...>`` operator headers, about half of what remained (docs/benchmarks.md, "Building the
C++ kernels").

The environment variable ``TORCH_EXTENSIONS_DIR`` is torch's own (read by its builder too).
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import logging
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from pagedllm.platforms.cpu import cpu_flags

logger = logging.getLogger(__name__)

# A build takes about a minute; a lock file this old was left by a killed build (seconds).
STALE_LOCK_S = 15 * 60
DEFAULT_CFLAGS = ("-O3", "-march=native", "-fopenmp")
DEFAULT_LDFLAGS = ("-fopenmp",)
# The header every source includes for new tensors (``cpu_tensor::empty``, ``zeros``, ...).
TENSOR_HEADER = Path(__file__).resolve().parent / "csrc" / "cpu_tensor.h"


@dataclass(frozen=True)
class CpuExtension:
    """One C++ source built into one Python extension module.

    Attributes:
        label: short name; the module is ``pagedllm_<label>_<12 hex>``.
        source: the ``.cpp`` file (it defines ``compiled_isas()``: the code paths compiled in).
        description: what it is, for log lines ("paged-attention kernel").
        fallback: what runs when it cannot be built, for the warning ("cpu_sdpa").
        extra_cflags, extra_ldflags: compiler / linker flags (part of the name's hash).
        headers: local headers the source includes (part of the name's hash, so editing one rebuilds).
    """

    label: str
    source: Path
    description: str
    fallback: str
    extra_cflags: tuple[str, ...] = DEFAULT_CFLAGS
    extra_ldflags: tuple[str, ...] = DEFAULT_LDFLAGS
    headers: tuple[Path, ...] = ()

    def name(self) -> str:
        """``pagedllm_<label>_<12 hex>``: hash of source, headers (``TENSOR_HEADER`` too), flags,
        torch, Python and CPU."""
        import torch

        digest = hashlib.sha256()
        for part in (self.source.read_bytes(), TENSOR_HEADER.read_bytes(), *(h.read_bytes() for h in self.headers), " ".join(self.extra_cflags + self.extra_ldflags).encode(),
                     torch.__version__.encode(), sys.version.encode(), _cpu_fingerprint().encode()):
            digest.update(part)
            digest.update(b"\0")
        return f"pagedllm_{self.label}_{digest.hexdigest()[:12]}"

    def build_directory(self) -> Path:
        """Where the compiled module lives: ``$TORCH_EXTENSIONS_DIR/<name>`` or
        ``~/.cache/pagedllm/torch_extensions/<name>``."""
        root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
            "~", ".cache", "pagedllm", "torch_extensions")
        return Path(root).expanduser() / self.name()

    def library_path(self) -> Path:
        """The compiled module's file: it exists once some process has built it."""
        return _library_file(self.build_directory(), self.name())


@functools.cache
def _cpu_fingerprint() -> str:
    """The CPU's model and feature flags (``-march=native`` code is only valid on a match)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def _library_file(build_dir: Path, name: str) -> Path:
    """Where torch's builder leaves the module ``name`` built in ``build_dir``."""
    return build_dir / f"{name}.so"


def _import_built(name: str, build_dir: Path) -> ModuleType | None:
    """Import ``<build_dir>/<name>.so`` if a previous process built it, else None.

    The name hashes everything the binary depends on, so an existing file is current; this skips
    torch's builder (its ninja check and lock file) on every start after the first.
    """
    path = _library_file(build_dir, name)
    if not path.is_file():
        return None
    try:
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except ImportError as exc:  # e.g. a link cut short: let the builder redo it
        logger.warning("could not import %s (%s); rebuilding", path, exc)
        return None
    return module


def _remove_stale_lock(build_dir: Path) -> None:
    """Delete torch's build lock if it is older than ``STALE_LOCK_S`` (its builder was killed).

    torch's ``FileBaton`` waits forever on a lock file; a SIGKILLed build leaves one behind.
    """
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return
    if age > STALE_LOCK_S:
        logger.warning("removing stale build lock %s (%.0f s old)", lock, age)
        lock.unlink(missing_ok=True)


@functools.cache
def load_extension(ext: CpuExtension) -> ModuleType | None:
    """Load ``ext``, compiling it first if this machine has not yet; None if that fails.

    Process-safe: torch's builder holds a lock file in the build directory, so concurrent first
    calls build once. The outcome is memoised for the process: a failure logs one WARNING and is
    not retried.

    Returns:
        The extension module, or None.
    """
    name = ext.name()
    build_dir = ext.build_directory()
    start = time.perf_counter()
    action = "loaded"
    try:
        module = _import_built(name, build_dir)
        if module is None:
            action = "built"
            from torch.utils import cpp_extension

            logger.info("compiling the %s once, about 30 s (%s; later starts load it in milliseconds)",
                        ext.description, build_dir)
            build_dir.mkdir(parents=True, exist_ok=True)
            _remove_stale_lock(build_dir)
            module = cpp_extension.load(
                name=name, sources=[str(ext.source)], extra_cflags=list(ext.extra_cflags),
                extra_ldflags=list(ext.extra_ldflags), extra_include_paths=[str(TENSOR_HEADER.parent)],
                build_directory=str(build_dir), verbose=False)
    except Exception as exc:  # no compiler, no ninja, compile error, unwritable cache, ...
        logger.warning("%s unavailable (%s: %s); falling back to %s", ext.description,
                       type(exc).__name__, exc, ext.fallback)
        return None
    logger.info("%s %s %s in %.2f s (%s, code paths: %s)", ext.description, name, action,
                time.perf_counter() - start, build_dir, ", ".join(module.compiled_isas()))
    return module


def kernel_unavailable(ext: CpuExtension, compiled_isa: str, isa, paths: tuple, required_flags: tuple[str, ...],
                       flags: frozenset[str]) -> str | None:
    """Why the ``compiled_isa`` code of ``ext`` cannot run here, in words for the log; None when it
    can (then ``load_extension(ext)`` has loaded it). The checks, in order: the resolved code path
    ``isa`` (``platforms.cpu.CpuIsa``) is one of ``paths``; the CPU has every flag of
    ``required_flags``, in ``flags`` and in this machine's own flags (the extension is compiled
    with ``-march=native``, so a flag set given for a test does not build code this CPU lacks: no
    compile is spent on it); the extension builds and compiled ``compiled_isa`` in.

    Used by the kernel choosers of ``layers/int8_gemm.py`` and ``layers/bf16_gemm.py``.
    """
    if isa not in paths:
        names = " / ".join(p.value for p in paths)
        return f"cpu_isa {isa.value!r} (the {ext.description} needs the {names} path{'s' if len(paths) > 1 else ''})"
    missing = [f for f in required_flags if f not in flags]
    if missing:
        return f"the CPU lacks {', '.join(missing)}"
    missing_here = [f for f in required_flags if f not in cpu_flags()]
    if missing_here:
        return f"this machine's CPU lacks {', '.join(missing_here)} (the kernel is compiled for the CPU it runs on)"
    module = load_extension(ext)
    if module is None or compiled_isa not in module.compiled_isas():
        return "the extension could not be built (see the warning above)"
    return None
