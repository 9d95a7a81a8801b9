"""The C++ paged-attention kernel (backend ``cpu_paged``) against dense attention and torch_ref.

Scenarios run several engine "steps" through the public API (build_attention_metadata +
Attention.__call__), so later steps read K/V written by earlier ones: fresh prefills, chunks on
cached context and decodes share one flattened batch. Physical blocks are a random permutation of
the pool and the caches start as NaN, so a read of an unwritten slot (or a masked one leaking)
shows up. Sequences run past the kernel's 32-key chunk and 16-token tile, so the online softmax
rescales across chunks and long prefill chunks split into several work items.
"""

from __future__ import annotations

import logging
import math
import os
import time

import pytest
import torch

from pagedllm.attention import Attention, AttentionMetadata, build_attention_metadata
from pagedllm.attention.backends import (
    BACKEND_ENV, AttentionSpec, cpu_paged, cpu_sdpa, resolve_backend_name)
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.platforms.cpu import CpuIsa, cpu_flags, missing_flags
from pagedllm.platforms import cpu_extension
from cpp_build import require_built_extension



def built_kernel():
    """The compiled kernel (``conftest.require_built_extension``: skips only without a compiler)."""
    return require_built_extension(cpu_paged.load_kernel, "the paged-attention kernel")


def test_kernel_builds_here():
    """Where a C++ compiler exists (this machine), the kernel must build: else every other test
    here would silently exercise the cpu_sdpa fallback."""
    kernel = built_kernel()
    assert isinstance(kernel.built_with_avx2(), bool)
    # Every path this CPU can run is compiled in (-march=native allows each of them).
    can_run = [isa.value for isa in CpuIsa if not missing_flags(isa, cpu_flags())]
    assert kernel.compiled_isas() == can_run
    assert cpu_paged.EXTENSION.build_directory().name == cpu_paged.EXTENSION.name()


def dense_attention(q, k, v, scale, window=None, soft_cap=None):
    """Dense causal attention in float64: q [L, H, D], k/v [L, H_kv, D] -> [L, H, D]."""
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("ihd,jhd->hij", q, k) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    i = torch.arange(q.shape[0])[:, None]
    j = torch.arange(q.shape[0])[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= j > i - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hij,jhd->ihd", torch.softmax(scores, dim=-1), v)


# Tokens each sequence gets per step (0 = not scheduled): fresh prefills (A, H), chunks on cached
# context, some longer than a 16-token tile (B, F), and decodes at many context lengths, some past
# several 32-key chunks (G, H).
SCHEDULE = {
    "A": [0, 0, 37, 1],
    "B": [25, 15, 23, 40],
    "C": [16, 0, 1, 1],
    "D": [5, 12, 1, 0],
    "E": [1, 1, 1, 1],
    "F": [0, 63, 1, 1],
    "G": [70, 1, 1, 1],
    "H": [0, 0, 0, 100],
}


def run_schedule(backend, *, block_size=16, num_heads=4, num_kv_heads=2, head_dim=64,
                 windows=(None,), soft_cap=None, dtype=torch.float32, seed=0,
                 decodes_first=False, cpu_isa="auto"):
    """Yield (step, window, out, dense) for every step and layer (one layer per window)."""
    gen = torch.Generator().manual_seed(seed)
    h, h_kv, d, bs = num_heads, num_kv_heads, head_dim, block_size
    scale = d ** -0.5
    totals = {name: sum(steps) for name, steps in SCHEDULE.items()}
    data = {name: tuple(torch.randn(n, hh, d, generator=gen).to(dtype) for hh in (h, h_kv, h_kv))
            for name, n in totals.items()}
    needed = {name: math.ceil(n / bs) for name, n in totals.items()}
    num_blocks = sum(needed.values()) + 5
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    full_tables, used = {}, 0
    for name, n in needed.items():
        full_tables[name] = perm[used:used + n]
        used += n
    layers = [Attention(h, d, h_kv, scale, sliding_window=w, logits_soft_cap=soft_cap,
                        backend=backend, cpu_isa=cpu_isa) for w in windows]
    caches = [(torch.full((num_blocks, bs, h_kv, d), float("nan"), dtype=dtype),
               torch.full((num_blocks, bs, h_kv, d), float("nan"), dtype=dtype))
              for _ in windows]
    expected = [{name: dense_attention(*data[name], scale, w, soft_cap) for name in data}
                for w in windows]
    done = {name: 0 for name in SCHEDULE}
    for step in range(len(SCHEDULE["A"])):
        names = [n for n in SCHEDULE if SCHEDULE[n][step] > 0]
        if decodes_first:
            names.sort(key=lambda n: SCHEDULE[n][step] != 1)
        q_lens = [SCHEDULE[n][step] for n in names]
        ctx_lens = [done[n] for n in names]
        tables = [full_tables[n][:math.ceil((c + q) / bs)]
                  for n, c, q in zip(names, ctx_lens, q_lens)]
        md = build_attention_metadata(q_lens, ctx_lens, tables, bs, "cpu")
        chunks = [slice(c, c + q) for c, q in zip(ctx_lens, q_lens)]
        q = torch.cat([data[n][0][s] for n, s in zip(names, chunks)])
        k = torch.cat([data[n][1][s] for n, s in zip(names, chunks)])
        v = torch.cat([data[n][2][s] for n, s in zip(names, chunks)])
        for layer, (k_cache, v_cache), exp in zip(layers, caches, expected):
            out = layer(q, k, v, k_cache, v_cache, md)
            assert out.shape == q.shape and out.dtype == dtype
            want = torch.cat([exp[n][s] for n, s in zip(names, chunks)])
            yield step, layer.spec.sliding_window, out, want
        for n, ql in zip(names, q_lens):
            done[n] += ql


def check(atol, rtol, **kwargs):
    for step, window, out, want in run_schedule("cpu_paged", **kwargs):
        assert not out.isnan().any(), f"NaN leaked at step {step}, window {window}"
        torch.testing.assert_close(out.double(), want, atol=atol, rtol=rtol,
                                   msg=lambda m: f"step {step}, window {window}: {m}")


@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_matches_dense_float32(block_size, num_kv_heads):
    # Windows: none, shorter than every prompt, mid-size, past a 32-key chunk, longer than all.
    check(1e-5, 1e-5, block_size=block_size, num_kv_heads=num_kv_heads,
          windows=[None, 4, 20, 45, 1000])


@pytest.mark.parametrize("window", [None, 7, 50])
def test_head_dim_256_gemma_shape(window):
    """Gemma 3 270M: 4 query heads on 1 kv head, head_dim 256."""
    check(1e-5, 1e-5, num_heads=4, num_kv_heads=1, head_dim=256, windows=[window])


@pytest.mark.parametrize("block_size", [1, 16])
def test_soft_cap(block_size):
    check(1e-5, 1e-5, block_size=block_size, num_kv_heads=2, soft_cap=1.5, windows=[None, 9])


@pytest.mark.parametrize("num_heads, num_kv_heads", [(3, 1), (6, 2), (5, 5), (8, 1)])
def test_odd_groups(num_heads, num_kv_heads):
    """Row counts that are not multiples of the 4-row micro-kernel (tails of 1..3 rows)."""
    check(1e-5, 1e-5, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=40,
          windows=[None, 11])


def test_decodes_first_contiguous():
    check(1e-5, 1e-5, block_size=8, num_kv_heads=1, decodes_first=True, windows=[None, 6])


@pytest.mark.parametrize("soft_cap", [None, 2.0])
@pytest.mark.parametrize("head_dim, num_kv_heads", [(64, 2), (256, 1)])
def test_matches_dense_bfloat16(soft_cap, head_dim, num_kv_heads):
    check(2e-2, 2e-2, num_kv_heads=num_kv_heads, head_dim=head_dim, soft_cap=soft_cap,
          dtype=torch.bfloat16, windows=[None, 10])


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)])
def test_agrees_with_torch_ref(dtype, tol):
    """Same inputs through torch_ref (float32 softmax) and the kernel (float32 accumulation)."""
    ref = list(run_schedule("torch_ref", block_size=8, num_kv_heads=1, head_dim=256,
                            windows=[None, 5], dtype=dtype, seed=3))
    fast = list(run_schedule("cpu_paged", block_size=8, num_kv_heads=1, head_dim=256,
                             windows=[None, 5], dtype=dtype, seed=3))
    for (_, _, out_ref, _), (_, _, out_fast, _) in zip(ref, fast):
        torch.testing.assert_close(out_fast.float(), out_ref.float(), atol=tol, rtol=tol)


def _nan_pool(needed: list[int], bs: int, h_kv: int, d: int, dtype, gen):
    """(num_blocks, block tables in a random permutation of the pool, K and V caches
    [num_blocks, bs, h_kv, d] full of NaN): sequence i gets ``needed[i]`` blocks, 3 stay free."""
    num_blocks = sum(needed) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in needed:
        tables.append(perm[used:used + n])
        used += n
    k_cache = torch.full((num_blocks, bs, h_kv, d), float("nan"), dtype=dtype)
    v_cache = torch.full((num_blocks, bs, h_kv, d), float("nan"), dtype=dtype)
    return num_blocks, tables, k_cache, v_cache


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("window", [None, 100])
def test_large_decode_batch_matches_torch_ref(dtype, tol, window):
    """A 24-sequence decode batch at contexts 1..400 over a shared, NaN-padded pool."""
    gen = torch.Generator().manual_seed(7)
    h, h_kv, d, bs = 8, 2, 64, 16
    ctx = torch.randint(0, 400, (24,), generator=gen).tolist()
    num_blocks, tables, k_cache, v_cache = _nan_pool([c // bs + 1 for c in ctx], bs, h_kv, d, dtype, gen)
    # Cached context; every other slot stays NaN.
    slots = torch.tensor([table[p // bs] * bs + p % bs for c, table in zip(ctx, tables)
                          for p in range(c)], dtype=torch.int64)
    for cache in (k_cache, v_cache):
        cache.view(-1, h_kv, d)[slots] = torch.randn(len(slots), h_kv, d, generator=gen).to(dtype)
    md = build_attention_metadata([1] * len(ctx), ctx, tables, bs, "cpu")
    q = torch.randn(len(ctx), h, d, generator=gen).to(dtype)
    k = torch.randn(len(ctx), h_kv, d, generator=gen).to(dtype)
    v = torch.randn(len(ctx), h_kv, d, generator=gen).to(dtype)
    outs = {}
    for backend in ("torch_ref", "cpu_paged"):
        layer = Attention(h, d, h_kv, 0.125, sliding_window=window, backend=backend)
        outs[backend] = layer(q, k, v, k_cache.clone(), v_cache.clone(), md)
    assert not outs["cpu_paged"].isnan().any()
    torch.testing.assert_close(outs["cpu_paged"].float(), outs["torch_ref"].float(), atol=tol,
                               rtol=tol)


def test_padding_tokens_are_zero():
    """Tokens with slot -1 past the last sequence come back as zeros."""
    h, h_kv, d, bs = 4, 1, 16, 4
    md = build_attention_metadata([3, 1], [0, 2], [[1], [2]], block_size=bs, device="cpu")
    padded = AttentionMetadata(
        slot_mapping=torch.cat([md.slot_mapping, torch.full((2,), -1)]),
        block_tables=md.block_tables, query_start_loc=md.query_start_loc,
        seq_lens=md.seq_lens, context_lens=md.context_lens, max_query_len=md.max_query_len,
        max_seq_len=md.max_seq_len, block_size=bs, query_lens_cpu=md.query_lens_cpu,
        seq_lens_cpu=md.seq_lens_cpu, context_lens_cpu=md.context_lens_cpu)
    k_cache = torch.zeros(4, bs, h_kv, d)
    v_cache = torch.zeros(4, bs, h_kv, d)
    k_cache[2, :2] = torch.randn(2, h_kv, d)
    v_cache[2, :2] = torch.randn(2, h_kv, d)
    q, k, v = torch.randn(6, h, d), torch.randn(6, h_kv, d), torch.randn(6, h_kv, d)
    want = Attention(h, d, h_kv, scale=0.25, backend="torch_ref")(
        q[:4], k[:4], v[:4], k_cache.clone(), v_cache.clone(), md)
    out = Attention(h, d, h_kv, scale=0.25, backend="cpu_paged")(
        q, k, v, k_cache, v_cache, padded)
    assert torch.equal(out[4:], torch.zeros(2, h, d))
    torch.testing.assert_close(out[:4], want)


def test_strided_query_from_fused_qkv():
    """q/k/v as non-contiguous views of a fused QKV projection, under inference mode."""
    h, h_kv, d, bs = 4, 2, 16, 4
    md = build_attention_metadata([6, 1, 1], [0, 3, 9], [[3, 0], [1], [4, 2, 5]], bs, "cpu")
    qkv = torch.randn(8, (h + 2 * h_kv) * d)
    q, k, v = qkv.split([h * d, h_kv * d, h_kv * d], dim=-1)
    q, k, v = q.view(8, h, d), k.view(8, h_kv, d), v.view(8, h_kv, d)
    k_cache, v_cache = torch.randn(6, bs, h_kv, d), torch.randn(6, bs, h_kv, d)
    want = Attention(h, d, h_kv, 0.25, backend="torch_ref")(
        q.contiguous(), k.contiguous(), v.contiguous(), k_cache.clone(), v_cache.clone(), md)
    with torch.inference_mode():
        out = Attention(h, d, h_kv, 0.25, backend="cpu_paged")(q, k, v, k_cache, v_cache, md)
    torch.testing.assert_close(out, want)


def test_kernel_rejects_out_of_range_block_id():
    kernel = built_kernel()
    md = build_attention_metadata([1], [4], [[0, 9]], block_size=4, device="cpu")  # 9 >= 2 blocks
    q = torch.randn(1, 2, 8)
    cache = torch.zeros(2, 4, 1, 8)
    with pytest.raises(RuntimeError, match="out of range"):
        kernel.paged_attention(q, torch.empty_like(q), cache, cache, md.block_tables,
                               md.query_start_loc, md.seq_lens, md.context_lens,
                               torch.zeros(1, dtype=torch.int32), 1.0, 0, 0.0, 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_writes_kv_as_write_kv(dtype):
    """``cpu_paged`` writes this step's K/V inside the kernel call: the caches end up bitwise as
    after ``write_kv`` (strided K/V views of a fused qkv, a prefill chunk and decodes), and the
    output is the same as the kernel's on caches written beforehand."""
    from pagedllm.attention import write_kv

    kernel = built_kernel()
    h, h_kv, d, bs = 4, 2, 16, 4
    md = build_attention_metadata([6, 1, 1], [0, 3, 9], [[3, 0], [1], [4, 2, 5]], bs, "cpu")
    qkv = torch.randn(8, (h + 2 * h_kv) * d).to(dtype)
    q, k, v = qkv.split([h * d, h_kv * d, h_kv * d], dim=-1)
    q, k, v = q.view(8, h, d), k.view(8, h_kv, d), v.view(8, h_kv, d)
    k_cache, v_cache = torch.randn(6, bs, h_kv, d).to(dtype), torch.randn(6, bs, h_kv, d).to(dtype)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv(k, v, k_ref, v_ref, md.slot_mapping)
    spec = AttentionSpec(h, d, h_kv, 0.25)
    want = cpu_paged.forward(spec, q, k, v, k_ref, v_ref, md)
    out = Attention(h, d, h_kv, 0.25, backend="cpu_paged")(q, k, v, k_cache, v_cache, md)
    assert torch.equal(k_cache, k_ref) and torch.equal(v_cache, v_ref)
    assert torch.equal(out, want)


def test_kernel_write_rejects_bad_slots_and_shapes():
    kernel = built_kernel()
    md = build_attention_metadata([1], [4], [[0, 1]], block_size=4, device="cpu")
    q, k = torch.randn(1, 2, 8), torch.randn(1, 1, 8)
    cache = torch.zeros(2, 4, 1, 8)
    args = (q, torch.empty_like(q), cache, cache, md.block_tables, md.query_start_loc, md.seq_lens,
            md.context_lens, torch.zeros(1, dtype=torch.int32), 1.0, 0, 0.0, 0)
    with pytest.raises(RuntimeError, match=r"slot_mapping\[0\] = 8 out of range"):
        kernel.paged_attention(*args, k, k, torch.tensor([8]))
    with pytest.raises(RuntimeError, match="key and value must be"):
        kernel.paged_attention(*args, torch.randn(1, 2, 8), torch.randn(1, 2, 8), md.slot_mapping)
    with pytest.raises(RuntimeError, match="all three or none"):
        kernel.paged_attention(*args, k, k, None)
    with pytest.raises(RuntimeError, match="int64"):
        kernel.paged_attention(*args, k, k, md.slot_mapping.int())


def test_build_failure_warns_and_falls_back(monkeypatch, caplog):
    """No compiler: load_kernel returns None with a WARNING, and forward equals cpu_sdpa's."""
    from torch.utils import cpp_extension

    def broken_load(*args, **kwargs):
        raise RuntimeError("no compiler")

    monkeypatch.setattr(cpu_extension, "_import_built", lambda name, build_dir: None)
    monkeypatch.setattr(cpp_extension, "load", broken_load)
    with caplog.at_level(logging.WARNING, logger=cpu_extension.__name__):
        assert cpu_extension.load_extension.__wrapped__(cpu_paged.EXTENSION) is None
    assert any("falling back to cpu_sdpa" in r.getMessage() for r in caplog.records)

    monkeypatch.setattr(cpu_paged, "load_kernel", lambda: None)
    spec = AttentionSpec(4, 16, 2, 0.25)
    md = build_attention_metadata([5, 1], [0, 7], [[0, 1], [2, 3]], 4, "cpu")
    q, k, v = torch.randn(6, 4, 16), torch.randn(6, 2, 16), torch.randn(6, 2, 16)
    k_cache, v_cache = torch.randn(4, 4, 2, 16), torch.randn(4, 4, 2, 16)
    out = cpu_paged.forward(spec, q, k, v, k_cache, v_cache, md)
    want = cpu_sdpa.forward(spec, q, k, v, k_cache, v_cache, md)
    torch.testing.assert_close(out, want)


def test_stale_build_lock_is_removed(tmp_path):
    """A lock left by a killed build would make torch's builder wait forever."""
    lock = tmp_path / "lock"
    lock.touch()
    cpu_extension._remove_stale_lock(tmp_path)
    assert lock.exists()  # fresh: a build may be running
    old = time.time() - cpu_extension.STALE_LOCK_S - 1
    os.utime(lock, (old, old))
    cpu_extension._remove_stale_lock(tmp_path)
    assert not lock.exists()


def test_backend_env_var(monkeypatch):
    """PAGEDLLM_ATTENTION_BACKEND overrides "auto" only; explicit choices win; typos raise."""
    # Read once where EngineArgs is built; models pass KernelConfig.attention_backend to their layers.
    def configured() -> str:
        return EngineArgs().create_engine_config(128).kernel_config.attention_backend

    monkeypatch.setenv(BACKEND_ENV, "cpu_paged")
    assert resolve_backend_name(configured()) == "cpu_paged"
    assert Attention(4, 8, 1, scale=1.0, backend=configured()).backend == "cpu_paged"
    assert Attention(4, 8, 1, scale=1.0, backend="torch_ref").backend == "torch_ref"
    monkeypatch.setenv(BACKEND_ENV, "torch_ref")
    assert Attention(4, 8, 1, scale=1.0, backend=configured()).backend == "torch_ref"
    monkeypatch.setenv(BACKEND_ENV, "flash")
    with pytest.raises(ValueError, match=BACKEND_ENV):
        Attention(4, 8, 1, scale=1.0, backend=configured())
    monkeypatch.setenv(BACKEND_ENV, "")
    assert resolve_backend_name(configured()) in ("cpu_sdpa", "cpu_paged")


def require_isa(isa: CpuIsa) -> None:
    """Skip, naming the CPU flags that are missing, where this CPU cannot run ``isa``."""
    missing = missing_flags(isa, cpu_flags())
    if missing:
        pytest.skip(f"the CPU lacks {', '.join(missing)} (needed by the {isa.value} path)")
    built_kernel()


# bfloat16 outputs are rounded to bfloat16 (8 bits of mantissa): paths that sum in another order
# can differ by one unit in the last place, 2^-8 relative.
@pytest.mark.parametrize("isa", [CpuIsa.AVX2, CpuIsa.AVX512, CpuIsa.AVX512_BF16], ids=lambda i: i.value)
@pytest.mark.parametrize("dtype, atol, rtol", [(torch.float32, 2e-6, 1e-5), (torch.bfloat16, 8e-3, 8e-3)],
                         ids=["float32", "bfloat16"])
@pytest.mark.parametrize("head_dim, soft_cap, windows", [(64, None, (None, 10)), (256, 50.0, (None,)),
                                                          (40, None, (7,))], ids=["d64", "d256-cap", "d40-window"])
def test_isa_path_matches_portable(isa, dtype, atol, rtol, head_dim, soft_cap, windows):
    """Each SIMD path against the portable C++ loops on the same multi-step schedule (prefills,
    chunks, decodes, window, soft cap; head_dim 40 leaves a tail after the 16- and 32-wide loops)."""
    require_isa(isa)
    kwargs = dict(head_dim=head_dim, soft_cap=soft_cap, windows=windows, dtype=dtype, num_heads=4,
                  num_kv_heads=1, seed=3)
    portable = list(run_schedule("cpu_paged", cpu_isa="portable", **kwargs))
    fast = list(run_schedule("cpu_paged", cpu_isa=isa.value, **kwargs))
    assert len(portable) == len(fast)
    for (step, window, out_ref, _), (_, _, out, _) in zip(portable, fast):
        assert out.dtype == dtype
        torch.testing.assert_close(out.float(), out_ref.float(), atol=atol, rtol=rtol,
                                   msg=lambda m: f"{isa.value} step {step} window {window}: {m}")


def test_kernel_path_names():
    """Which micro-kernels a layer runs: the bf16 dot products for bfloat16 only."""
    require_isa(CpuIsa.AVX512_BF16)
    kernel = cpu_paged.load_kernel()
    assert cpu_paged.kernel_path(kernel, CpuIsa.AVX512_BF16, torch.bfloat16) == "avx512_bf16"
    assert cpu_paged.kernel_path(kernel, CpuIsa.AVX512_BF16, torch.float32) == "avx512"
    assert cpu_paged.kernel_path(kernel, CpuIsa.AVX2, torch.bfloat16) == "avx2"
    assert cpu_paged.kernel_path(kernel, CpuIsa.PORTABLE, torch.float32) == "portable"


def test_kernel_rejects_path_not_compiled():
    kernel = built_kernel()
    md = build_attention_metadata([1], [0], [[0]], block_size=4, device="cpu")
    q = torch.randn(1, 2, 8)
    cache = torch.zeros(1, 4, 1, 8)
    with pytest.raises(RuntimeError, match="not compiled"):
        kernel.paged_attention(q, torch.empty_like(q), cache, cache, md.block_tables, md.query_start_loc,
                               md.seq_lens, md.context_lens, torch.zeros(1, dtype=torch.int32), 1.0, 0, 0.0, 9)


def paged_case(q_lens, ctx_lens, *, num_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    """One kernel call's inputs: sequence i has ctx_lens[i] cached tokens and q_lens[i] new ones (their
    K/V written into the cache too), physical blocks a random permutation of a pool with spare blocks,
    every slot no sequence owns NaN. Returns (kwargs for the kernel, per-sequence (q, k, v) of all
    positions for the dense reference)."""
    gen = torch.Generator().manual_seed(seed)
    h, h_kv, d, bs = num_heads, num_kv_heads, head_dim, block_size
    needed = [math.ceil((c + q) / bs) for c, q in zip(ctx_lens, q_lens)]
    num_blocks, tables, k_cache, v_cache = _nan_pool(needed, bs, h_kv, d, dtype, gen)
    seqs = []
    for c, ql, table in zip(ctx_lens, q_lens, tables):
        n = c + ql
        q, k, v = (torch.randn(n, hh, d, generator=gen).to(dtype) for hh in (h, h_kv, h_kv))
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(n)], dtype=torch.int64)
        k_cache.view(-1, h_kv, d)[slots] = k
        v_cache.view(-1, h_kv, d)[slots] = v
        seqs.append((q[c:], k, v))
    md = build_attention_metadata(q_lens, ctx_lens, tables, bs, "cpu")
    query = torch.cat([s[0] for s in seqs])
    args = (query, k_cache, v_cache, md.block_tables, md.query_start_loc, md.seq_lens, md.context_lens,
            torch.arange(len(q_lens), dtype=torch.int32))
    return args, seqs


def dense_rows(q, k, v, scale, window):
    """float64 attention of the last len(q) positions of a sequence over all its keys [n, H_kv, D]."""
    n, new = k.shape[0], q.shape[0]
    group = q.shape[1] // k.shape[1]
    k = k.double().repeat_interleave(group, dim=1)
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("ihd,jhd->hij", q.double(), k) * scale
    i = torch.arange(n - new, n)[:, None]
    j = torch.arange(n)[None, :]
    allowed = j <= i
    if window:
        allowed &= j > i - window
    return torch.einsum("hij,jhd->ihd", torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1), v)


# Decodes at contexts around the 4-key score blocks, the 16-key prefetch distance, the 32-key chunk
# and the block size (not multiples of any), prefill chunks on cached context past one 16-token tile.
EDGE_Q_LENS = [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 17, 40, 5]
EDGE_CTX_LENS = [0, 2, 3, 4, 15, 16, 17, 33, 66, 131, 0, 29, 47]


@pytest.mark.parametrize("isa", list(CpuIsa)[1:], ids=lambda i: i.value)
@pytest.mark.parametrize("dtype, atol, rtol", [(torch.float32, 2e-6, 1e-5), (torch.bfloat16, 8e-3, 8e-3)],
                         ids=["float32", "bfloat16"])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(4, 1, 256), (8, 1, 64), (4, 2, 80), (3, 3, 32)],
                         ids=["gqa4-d256", "gqa8-d64", "gqa2-d80", "mha-d32"])
@pytest.mark.parametrize("window, block_size", [(0, 16), (5, 16), (21, 7), (64, 1)],
                         ids=["full-bs16", "window5-bs16", "window21-bs7", "window64-bs1"])
def test_isa_path_edges_match_portable_and_dense(isa, dtype, atol, rtol, num_heads, num_kv_heads, head_dim,
                                                 window, block_size):
    """Each SIMD path (4 rows x 4 keys scores, 64-column P.V tiles, prefetches kPrefetchKeys ahead)
    against the portable loops and float64 dense attention, in one call over decodes and prefill chunks
    at hand-picked lengths: GQA groups of 8, 4, 2 and 1 (the 4-row kernels see 8 rows, 4 rows or
    2 tokens x 2 heads, or fall back), head_dim 80 (AVX-512 float32 takes the 4x4 scores, bf16 the
    2-key ones; P.V has a 16-column tail), windows starting mid-block, blocks of 7 and 1 tokens."""
    require_isa(isa)
    kernel = built_kernel()
    args, seqs = paged_case(EDGE_Q_LENS, EDGE_CTX_LENS, num_heads=num_heads, num_kv_heads=num_kv_heads,
                            head_dim=head_dim, block_size=block_size, dtype=dtype, seed=11)
    scale = head_dim ** -0.5
    outs = {}
    for path in ("portable", cpu_paged.kernel_path(kernel, isa, dtype)):
        out = torch.empty_like(args[0])
        kernel.paged_attention(args[0], out, *args[1:], scale, window, 0.0, kernel.compiled_isas().index(path))
        assert not out.isnan().any(), path
        outs[path] = out
    fast = outs[cpu_paged.kernel_path(kernel, isa, dtype)]
    torch.testing.assert_close(fast.float(), outs["portable"].float(), atol=atol, rtol=rtol)
    want = torch.cat([dense_rows(q, k, v, scale, window) for q, k, v in seqs])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fast.double(), want, atol=tol, rtol=tol)
