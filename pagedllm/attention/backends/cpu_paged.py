"""CPU paged attention through a C++ kernel that reads K/V in place through the block table.

Source: PagedAttention (Kwon et al., SOSP 2023), V1 kernel layout; online softmax (Milakov &
Gimelshein 2018; FlashAttention, Dao et al. 2022). Sliding window per Hugging Face / Mistral (query
at p sees p - window < k <= p); soft cap per Gemma 2 (``cap * tanh(s / cap)``).

Unlike ``cpu_sdpa``, which copies every decode's window-reachable blocks into a padded
``[B, L, H_kv, D]`` tensor each layer of each step, the kernel (``csrc/paged_attention.cpp``)
walks each sequence's block table and reads the cached rows where they lie, with float32
accumulation (bfloat16 is widened on load). One kernel call per layer covers the whole flattened
batch: decodes, chunked prefills and fresh prefills (for these too the kernel measured faster than
SDPA on this machine's CPU, see docs/performance.md; it also has the soft cap SDPA lacks).

The kernel is compiled on first use (``attention.backends.prepare_backend`` does it at engine
start, before any progress bar) with ``torch.utils.cpp_extension.load`` (g++ with ``-O3
-march=native -fopenmp`` through ninja; about 30 s on 2 cores) into
``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/pagedllm/torch_extensions``, under a name hashing the
source, the flags, torch's version and this CPU's flags, so later processes load it in
milliseconds and a different CPU or torch rebuilds it. If the build fails (no compiler), a WARNING
is logged once and every call falls back to ``cpu_sdpa``; so do non-CPU tensors and dtypes other
than float32 / bfloat16.
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
from pathlib import Path
from types import ModuleType

import torch

from pagedllm.attention.backends import AttentionSpec, cpu_sdpa
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.platforms.cpu import CpuIsa, resolve_cpu_isa

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "paged_attention.cpp"
EXTRA_CFLAGS = ("-O3", "-march=native", "-fopenmp")
EXTRA_LDFLAGS = ("-fopenmp",)
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)


def _cpu_fingerprint() -> str:
    """The CPU's model and feature flags (``-march=native`` code is only valid on a match)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() or platform.machine()


def extension_name() -> str:
    """``pagedllm_paged_attention_<12 hex>``: hash of source, flags, torch, Python and CPU."""
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), " ".join(EXTRA_CFLAGS + EXTRA_LDFLAGS).encode(),
                 torch.__version__.encode(), sys.version.encode(), _cpu_fingerprint().encode()):
        digest.update(part)
        digest.update(b"\0")
    return f"pagedllm_paged_attention_{digest.hexdigest()[:12]}"


def build_directory() -> Path:
    """Where the compiled kernel lives: ``$TORCH_EXTENSIONS_DIR`` or ``~/.cache/pagedllm/...``."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        "~", ".cache", "pagedllm", "torch_extensions")
    return Path(root).expanduser() / extension_name()


# A build takes about a minute; a lock file this old was left by a killed build (seconds).
STALE_LOCK_S = 15 * 60


def _import_built(name: str, build_dir: Path) -> ModuleType | None:
    """Import ``<build_dir>/<name>.so`` if a previous process built it, else None.

    The name hashes everything the binary depends on, so an existing file is current; this skips
    torch's builder (its ninja check and lock file) on every start after the first.
    """
    path = build_dir / f"{name}.so"
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
def load_kernel() -> ModuleType | None:
    """Load the C++ kernel, compiling it first if this machine has not yet; None if that fails.

    Process-safe: torch's builder holds a lock file in the build directory, so concurrent first
    calls build once. The outcome is memoised for the process: a failure logs one WARNING and is
    not retried.

    Returns:
        The extension module (``paged_attention(...)``, ``built_with_avx2()``), or None.
    """
    name = extension_name()
    build_dir = build_directory()
    start = time.perf_counter()
    action = "loaded"
    try:
        module = _import_built(name, build_dir)
        if module is None:
            action = "built"
            from torch.utils import cpp_extension

            logger.info("compiling the paged-attention kernel once, about 30 s (%s; later starts load it "
                        "in milliseconds)", build_dir)
            build_dir.mkdir(parents=True, exist_ok=True)
            _remove_stale_lock(build_dir)
            module = cpp_extension.load(
                name=name, sources=[str(SOURCE)], extra_cflags=list(EXTRA_CFLAGS),
                extra_ldflags=list(EXTRA_LDFLAGS), build_directory=str(build_dir),
                verbose=False)
    except Exception as exc:  # no compiler, no ninja, compile error, unwritable cache, ...
        logger.warning("cpu_paged attention kernel unavailable (%s: %s); falling back to "
                       "cpu_sdpa", type(exc).__name__, exc)
        return None
    logger.info("cpu_paged attention kernel %s %s in %.2f s (%s, code paths: %s)",
                name, action, time.perf_counter() - start, build_dir, ", ".join(module.compiled_isas()))
    return module


@functools.cache
def _compiled(kernel: ModuleType) -> tuple[str, ...]:
    return tuple(kernel.compiled_isas())


@functools.cache
def _path_index(compiled: tuple[str, ...], isa: CpuIsa, bf16: bool) -> tuple[int, str]:
    order = list(CpuIsa)
    for cand in reversed(order[: order.index(isa) + 1]):
        if cand is CpuIsa.AVX512_BF16 and not bf16:
            continue  # the bf16 dot products change bfloat16 caches only; float32 runs AVX-512
        if cand.value in compiled:
            return compiled.index(cand.value), cand.value
    return 0, CpuIsa.PORTABLE.value


def kernel_path(kernel: ModuleType, isa: CpuIsa, dtype: torch.dtype) -> str:
    """The name of the code path the kernel runs for ``isa`` in ``dtype``: ``isa`` itself, or the
    fastest path below it compiled into this build (``avx512_bf16`` applies to bfloat16 only)."""
    return _path_index(_compiled(kernel), isa, dtype == torch.bfloat16)[1]


def _seq_ids(md: AttentionMetadata) -> torch.Tensor:
    """[n] int32: the sequences with query tokens this step (built once per step)."""
    return torch.tensor([i for i, q_len in enumerate(md.query_lens_cpu) if q_len > 0],
                        dtype=torch.int32)


def forward(
    spec: AttentionSpec,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    isa: CpuIsa | None = None,
) -> torch.Tensor:
    """Paged attention over a flattened batch of prefill chunks and decodes (CPU kernel).

    Args:
        spec: the layer's heads, scale, window and soft cap.
        query: [num_tokens, num_heads, head_dim], float32 or bfloat16 (else ``cpu_sdpa`` runs).
        key, value: [num_tokens, num_kv_heads, head_dim], this step's K/V; unused (the kernel
            reads them back from the cache, where they were just written).
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous, already
            holding this step's K/V.
        metadata: this step's AttentionMetadata (int32 block tables and lengths on the CPU).
        isa: the micro-kernels to run (``platforms.cpu``; None = the best the CPU's flags
            allow); a path not compiled into this build runs the fastest one below it.
    Returns:
        [num_tokens, num_heads, head_dim] in query dtype; rows of padding tokens (past the last
        sequence's queries) are zero.
    Raises:
        RuntimeError: (from the kernel) if a block id or length in the metadata is out of range.
    """
    kernel = None
    if query.device.type == "cpu" and query.dtype in SUPPORTED_DTYPES:
        kernel = load_kernel()
    if kernel is None:
        return cpu_sdpa.forward(spec, query, key, value, k_cache, v_cache, metadata)

    seq_ids = metadata.get_plan("cpu_paged", _seq_ids)
    if query.stride(-1) != 1:
        query = query.contiguous()
    if metadata.query_start_loc_cpu[-1] == metadata.num_tokens:
        out = torch.empty(query.shape, dtype=query.dtype)
    else:  # padding rows past the last sequence stay zero
        out = torch.zeros(query.shape, dtype=query.dtype)
    if seq_ids.numel():
        kernel.paged_attention(
            query, out, k_cache, v_cache, metadata.block_tables, metadata.query_start_loc,
            metadata.seq_lens, metadata.context_lens, seq_ids, spec.scale,
            spec.sliding_window or 0, spec.logits_soft_cap or 0.0,
            _path_index(_compiled(kernel), isa or resolve_cpu_isa("auto"), query.dtype == torch.bfloat16)[0])
    return out
