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
start, before any progress bar) by the shared builder ``platforms.cpu_extension`` (``-O3
-march=native -fopenmp``; about 30 s on 2 cores; later processes load it in milliseconds). If
the build fails (no compiler), a WARNING is logged once and every call falls back to
``cpu_sdpa``; so do non-CPU tensors and dtypes other than float32 / bfloat16.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from types import ModuleType

import torch

from pagedllm.attention import ops
from pagedllm.attention.backends import AttentionSpec, cpu_sdpa
from pagedllm.attention.metadata import AttentionMetadata
from pagedllm.platforms.cpu import CpuIsa, resolve_cpu_isa
from pagedllm.platforms.cpu_extension import DEFAULT_CFLAGS, CpuExtension, load_extension

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).resolve().parent.parent / "csrc" / "paged_attention.cpp"
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16)
# Built and loaded by the shared builder (platforms/cpu_extension.py), default flags plus
# -ffp-contract=off: the compiler must not fuse a scalar loop's a * b + c into an FMA in one
# inlined copy of a loop and not in another (a row's result would then depend on the micro-kernel
# its tile picked: the kernel's batch invariance, csrc header); the intrinsics' FMAs stay FMAs.
EXTENSION = CpuExtension("paged_attention", SOURCE, "cpu_paged attention kernel", "cpu_sdpa",
                         extra_cflags=DEFAULT_CFLAGS + ("-ffp-contract=off",))


@functools.cache
def load_kernel() -> ModuleType | None:
    """The C++ kernel (``paged_attention(...)``, ``compiled_isas()``, ``built_with_avx2()``),
    compiled first on a machine that has not yet; None (one WARNING) if that fails.
    See ``platforms.cpu_extension.load_extension``."""
    return load_extension(EXTENSION)


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


def _step_plan(md: AttentionMetadata) -> tuple[torch.Tensor, bool]:
    """Built once per step, shared by every layer: [n] int32, the sequences with query tokens
    this step; whether the batch has padding rows past the last sequence's queries."""
    seq_ids = torch.tensor([i for i, q_len in enumerate(md.query_lens_cpu) if q_len > 0], dtype=torch.int32)
    return seq_ids, sum(md.query_lens_cpu) != md.num_tokens


def forward(
    spec: AttentionSpec,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    isa: CpuIsa | None = None,
    write_kv: bool = False,
) -> torch.Tensor:
    """Paged attention over a flattened batch of prefill chunks and decodes (CPU kernel).

    Args:
        spec: the layer's heads, scale, window and soft cap.
        query: [num_tokens, num_heads, head_dim], float32 or bfloat16 (else ``cpu_sdpa`` runs).
        key, value: [num_tokens, num_kv_heads, head_dim], this step's K/V; read only with
            ``write_kv`` (the kernel reads them back from the cache).
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], contiguous, holding
            this step's K/V already, or (``write_kv``) after this call.
        metadata: this step's AttentionMetadata (int32 block tables and lengths on the CPU).
        isa: the micro-kernels to run (``platforms.cpu``; None = the best the CPU's flags
            allow); a path not compiled into this build runs the fastest one below it.
        write_kv: write ``key`` / ``value`` into the caches first, through
            ``metadata.slot_mapping`` (int64, no padding slots: ``Attention`` checks): inside the
            kernel's call (one call per layer instead of two ``index_copy_`` and the kernel), else
            with ``ops.write_kv``.
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
        if write_kv:
            ops.write_kv(key, value, k_cache, v_cache, metadata.slot_mapping, False)
        return cpu_sdpa.forward(spec, query, key, value, k_cache, v_cache, metadata)

    seq_ids, padded = metadata.get_plan("cpu_paged", _step_plan)
    if write_kv and not seq_ids.numel():   # no kernel call to write in
        ops.write_kv(key, value, k_cache, v_cache, metadata.slot_mapping, False)
    if query.stride(-1) != 1:
        query = query.contiguous()
    # padding rows past the last sequence stay zero
    out = torch.zeros(query.shape, dtype=query.dtype) if padded else torch.empty(query.shape, dtype=query.dtype)
    if seq_ids.numel():
        kernel.paged_attention(
            query, out, k_cache, v_cache, metadata.block_tables, metadata.query_start_loc,
            metadata.seq_lens, metadata.context_lens, seq_ids, spec.scale,
            spec.sliding_window or 0, spec.logits_soft_cap or 0.0,
            _path_index(_compiled(kernel), isa or resolve_cpu_isa("auto"), query.dtype == torch.bfloat16)[0],
            *((key, value, metadata.slot_mapping) if write_kv else ()))
    return out
