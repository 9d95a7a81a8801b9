"""Paged attention backends against dense causal attention computed from scratch (no cache).

Each scenario runs several engine "steps" through the public API (build_attention_metadata +
Attention.__call__), so later steps read K/V written by earlier ones: fresh prefills, chunked
prefills on cached context and decodes share one flattened batch. Physical blocks are a random
permutation of the pool, and the caches start as NaN so any read of an unwritten slot shows up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from pagedllm.attention import Attention, AttentionMetadata, build_attention_metadata

BACKENDS = ["torch_ref", "cpu_sdpa"]


def dense_attention(q, k, v, scale, window=None, soft_cap=None):
    """Dense causal attention in float64 over a whole sequence.

    q: [L, H, D]; k, v: [L, H_kv, D]. Query i sees keys j with j <= i and i - window < j.
    Returns [L, H, D] float64.
    """
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("ihd,jhd->hij", q, k) * scale
    if soft_cap is not None:
        scores = soft_cap * torch.tanh(scores / soft_cap)
    n = q.shape[0]
    i = torch.arange(n)[:, None]
    j = torch.arange(n)[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= j > i - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hij,jhd->ihd", torch.softmax(scores, dim=-1), v)


@dataclass
class Case:
    block_size: int = 16
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    window: int | None = None
    soft_cap: float | None = None
    dtype: torch.dtype = torch.float32
    decodes_first: bool = False


# Tokens each sequence gets per step (0 = not scheduled). Step 3 mixes a fresh prefill (A),
# a chunk on cached context (B), and decodes (C..F) at several context lengths.
SCHEDULE = {
    "A": [0, 0, 37],
    "B": [25, 15, 23],
    "C": [16, 0, 1],
    "D": [5, 12, 1],
    "E": [1, 1, 1],
    "F": [0, 63, 1],
    "G": [33, 1, 1],
}


def run_schedule(case: Case, backend: str, windows: list[int | None], seed: int = 0):
    """Run SCHEDULE through one Attention layer per window; compare each step with dense."""
    gen = torch.Generator().manual_seed(seed)
    h, h_kv, d, bs = case.num_heads, case.num_kv_heads, case.head_dim, case.block_size
    scale = d ** -0.5
    totals = {name: sum(steps) for name, steps in SCHEDULE.items()}
    # Whole-sequence q/k/v, rounded to the model dtype once (so the dense oracle sees the same).
    data = {
        name: tuple(torch.randn(n, hh, d, generator=gen).to(case.dtype)
                    for hh in (h, h_kv, h_kv))
        for name, n in totals.items()
    }
    # Physical blocks: a random permutation of a pool with spare blocks.
    needed = {name: math.ceil(n / bs) for name, n in totals.items()}
    num_blocks = sum(needed.values()) + 5
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    full_tables, used = {}, 0
    for name, n in needed.items():
        full_tables[name] = perm[used:used + n]
        used += n

    layers = [Attention(h, d, h_kv, scale, sliding_window=w, logits_soft_cap=case.soft_cap,
                        backend=backend) for w in windows]
    caches = [(torch.full((num_blocks, bs, h_kv, d), float("nan"), dtype=case.dtype),
               torch.full((num_blocks, bs, h_kv, d), float("nan"), dtype=case.dtype))
              for _ in windows]
    expected = [{name: dense_attention(*data[name], scale, w, case.soft_cap) for name in data}
                for w in windows]

    done = {name: 0 for name in SCHEDULE}
    num_steps = len(next(iter(SCHEDULE.values())))
    for step in range(num_steps):
        names = [n for n in SCHEDULE if SCHEDULE[n][step] > 0]
        if case.decodes_first:
            names.sort(key=lambda n: SCHEDULE[n][step] != 1)
        q_lens = [SCHEDULE[n][step] for n in names]
        ctx_lens = [done[n] for n in names]
        # Tables exactly as long as the sequence needs after this step.
        tables = [full_tables[n][:math.ceil((c + q) / bs)]
                  for n, c, q in zip(names, ctx_lens, q_lens)]
        md = build_attention_metadata(q_lens, ctx_lens, tables, bs, "cpu")
        chunks = [slice(c, c + q) for c, q in zip(ctx_lens, q_lens)]
        q = torch.cat([data[n][0][s] for n, s in zip(names, chunks)])
        k = torch.cat([data[n][1][s] for n, s in zip(names, chunks)])
        v = torch.cat([data[n][2][s] for n, s in zip(names, chunks)])
        for layer, (k_cache, v_cache), exp in zip(layers, caches, expected):
            out = layer(q, k, v, k_cache, v_cache, md)
            assert out.shape == q.shape and out.dtype == case.dtype
            want = torch.cat([exp[n][s] for n, s in zip(names, chunks)])
            yield step, layer.spec.sliding_window, out, want
        for n, ql in zip(names, q_lens):
            done[n] += ql


def check(case: Case, backend: str, windows: list[int | None], atol: float, rtol: float):
    for step, window, out, want in run_schedule(case, backend, windows):
        torch.testing.assert_close(
            out.double(), want, atol=atol, rtol=rtol,
            msg=lambda m: f"step {step}, window {window}: {m}")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [1, 8, 16, 32])
@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_matches_dense_float32(backend, block_size, num_kv_heads):
    # Layers with different windows share one metadata per step (Gemma 3 local/global mix):
    # none, shorter than every prompt, mid-size, and longer than any sequence.
    case = Case(block_size=block_size, num_kv_heads=num_kv_heads)
    check(case, backend, [None, 4, 20, 1000], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("window", [None, 7])
def test_head_dim_256(backend, window):
    case = Case(block_size=16, num_kv_heads=1, head_dim=256)
    check(case, backend, [window], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("block_size", [1, 16])
def test_soft_cap(backend, block_size):
    case = Case(block_size=block_size, num_kv_heads=2, soft_cap=1.5)
    check(case, backend, [None, 9], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decodes_first_contiguous(backend):
    case = Case(block_size=8, num_kv_heads=1, decodes_first=True)
    check(case, backend, [None, 6], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("soft_cap", [None, 2.0])
@pytest.mark.parametrize("head_dim, num_kv_heads", [(64, 2), (256, 1)])
def test_matches_dense_bfloat16(backend, soft_cap, head_dim, num_kv_heads):
    case = Case(block_size=16, num_kv_heads=num_kv_heads, head_dim=head_dim, soft_cap=soft_cap,
                dtype=torch.bfloat16)
    check(case, backend, [None, 10], atol=2e-2, rtol=2e-2)


def test_backends_agree_bfloat16():
    """The fast backend stays within bf16 rounding of the float32-softmax reference."""
    case = Case(block_size=8, num_kv_heads=1, head_dim=64, dtype=torch.bfloat16)
    ref = list(run_schedule(case, "torch_ref", [None, 5], seed=3))
    fast = list(run_schedule(case, "cpu_sdpa", [None, 5], seed=3))
    for (_, _, out_ref, _), (_, _, out_fast, _) in zip(ref, fast):
        torch.testing.assert_close(out_fast.float(), out_ref.float(), atol=1.6e-2, rtol=1.6e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_window_of_one_returns_own_value(backend):
    """With sliding_window=1 each token sees only itself, so the output is its own V."""
    h, h_kv, d = 4, 2, 8
    layer = Attention(h, d, h_kv, scale=0.3, sliding_window=1, backend=backend)
    k_cache = torch.zeros(6, 4, h_kv, d)
    v_cache = torch.zeros(6, 4, h_kv, d)
    md = build_attention_metadata([5, 1], [0, 6], [[0, 1], [2, 3]], block_size=4, device="cpu")
    q, k, v = torch.randn(6, h, d), torch.randn(6, h_kv, d), torch.randn(6, h_kv, d)
    out = layer(q, k, v, k_cache, v_cache, md)
    torch.testing.assert_close(out, v.repeat_interleave(h // h_kv, dim=1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_padding_tokens(backend):
    """Tokens with slot -1 past the last sequence are not written and come back as zeros."""
    h, h_kv, d, bs = 4, 1, 16, 4
    layer = Attention(h, d, h_kv, scale=0.25, backend=backend)
    md = build_attention_metadata([3, 1], [0, 2], [[1], [2]], block_size=bs, device="cpu")
    padded = AttentionMetadata(
        slot_mapping=torch.cat([md.slot_mapping, torch.full((2,), -1)]),
        block_tables=md.block_tables, query_start_loc=md.query_start_loc,
        seq_lens=md.seq_lens, context_lens=md.context_lens, max_query_len=md.max_query_len,
        max_seq_len=md.max_seq_len, block_size=bs, query_lens_cpu=md.query_lens_cpu,
        seq_lens_cpu=md.seq_lens_cpu, context_lens_cpu=md.context_lens_cpu)
    k_cache = torch.zeros(4, bs, h_kv, d)
    v_cache = torch.zeros(4, bs, h_kv, d)
    k_cache[2, :2] = torch.randn(2, h_kv, d)  # the decode's 2 cached tokens
    v_cache[2, :2] = torch.randn(2, h_kv, d)
    q, k, v = torch.randn(6, h, d), torch.randn(6, h_kv, d), torch.randn(6, h_kv, d)
    ref_out = Attention(h, d, h_kv, scale=0.25, backend="torch_ref")(
        q[:4], k[:4], v[:4], k_cache.clone(), v_cache.clone(), md)
    untouched = (k_cache[0].clone(), k_cache[3].clone())
    out = layer(q, k, v, k_cache, v_cache, padded)
    assert torch.equal(out[4:], torch.zeros(2, h, d))
    torch.testing.assert_close(out[:4], ref_out)
    assert torch.equal(k_cache[0], untouched[0]) and torch.equal(k_cache[3], untouched[1])


def test_auto_backend_resolution(monkeypatch):
    from pagedllm.attention.backends import AUTO_BACKEND, BACKEND_ENV
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert Attention(4, 8, 1, scale=1.0).backend == AUTO_BACKEND == "cpu_paged"
    assert Attention(4, 8, 1, scale=1.0, backend="torch_ref").backend == "torch_ref"
    monkeypatch.setenv(BACKEND_ENV, "cpu_sdpa")  # read once by EngineArgs into KernelConfig.attention_backend
    from pagedllm.engine.arg_utils import EngineArgs
    backend = EngineArgs().create_engine_config(128).kernel_config.attention_backend
    assert Attention(4, 8, 1, scale=1.0, backend=backend).backend == "cpu_sdpa"


@pytest.mark.parametrize("kwargs, match", [
    (dict(num_heads=4, head_dim=8, num_kv_heads=3), "multiple of num_kv_heads"),
    (dict(num_heads=0, head_dim=8, num_kv_heads=1), "num_heads"),
    (dict(num_heads=4, head_dim=8, num_kv_heads=1, sliding_window=0), "sliding_window"),
    (dict(num_heads=4, head_dim=8, num_kv_heads=1, logits_soft_cap=-1.0), "logits_soft_cap"),
    (dict(num_heads=4, head_dim=8, num_kv_heads=1, backend="flash"), "attention backend"),
])
def test_attention_rejects_bad_config(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Attention(scale=1.0, **kwargs)


def test_attention_rejects_bad_shapes():
    layer = Attention(4, 8, 2, scale=1.0)
    md = build_attention_metadata([2], [0], [[0]], block_size=4, device="cpu")
    cache = torch.zeros(1, 4, 2, 8)
    with pytest.raises(ValueError, match="query must be"):
        layer(torch.randn(2, 2, 8), torch.randn(2, 2, 8), torch.randn(2, 2, 8), cache,
              cache.clone(), md)
    with pytest.raises(ValueError, match="key and value"):
        layer(torch.randn(2, 4, 8), torch.randn(2, 4, 8), torch.randn(2, 4, 8), cache,
              cache.clone(), md)


@pytest.mark.parametrize("backend", BACKENDS)
def test_strided_inputs_from_fused_qkv_under_inference_mode(backend):
    """q/k/v as views of a fused QKV projection (non-contiguous), as model code passes them."""
    h, h_kv, d, bs = 4, 2, 16, 4
    md = build_attention_metadata([6, 1, 1], [0, 3, 9], [[3, 0], [1], [4, 2, 5]], bs, "cpu")
    qkv = torch.randn(8, (h + 2 * h_kv) * d)
    q, k, v = qkv.split([h * d, h_kv * d, h_kv * d], dim=-1)
    q, k, v = q.view(8, h, d), k.view(8, h_kv, d), v.view(8, h_kv, d)
    k_cache = torch.randn(6, bs, h_kv, d)
    v_cache = torch.randn(6, bs, h_kv, d)
    want = Attention(h, d, h_kv, 0.25, backend="torch_ref")(
        q.contiguous(), k.contiguous(), v.contiguous(), k_cache.clone(), v_cache.clone(), md)
    with torch.inference_mode():
        out = Attention(h, d, h_kv, 0.25, sliding_window=None, backend=backend)(
            q, k, v, k_cache, v_cache, md)
    torch.testing.assert_close(out, want)
