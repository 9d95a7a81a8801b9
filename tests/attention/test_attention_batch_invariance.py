"""Batch invariance of the default attention backend (``cpu_paged``): a query row's output is the
same bits (``torch.equal``) whichever step computes it: the whole prompt as one fresh prefill,
chunked prefills of any size (16-token tiles and 32-key chunks cut differently), one decode per
token, and with another sequence sharing every step. Checked on every code path this CPU runs
(portable, avx2, avx512, avx512_bf16: a path the flags lack is not run, and its id says so), in
float32 and bfloat16, for Gemma 3's grouping (4 query heads on 1 kv head) and for groups that make
a 4-row micro-kernel group span tokens, with and without a sliding window.

``cpu_sdpa`` / ``torch_ref`` are not batch-invariant (SDPA's decode and prefill kernels round
differently) and are not tested here: ``auto`` picks ``cpu_paged`` wherever it builds.
"""

from __future__ import annotations

import math

import pytest
import torch

from pagedllm.attention import Attention, build_attention_metadata
from pagedllm.attention.backends import cpu_paged
from pagedllm.platforms.cpu import CpuIsa, best_cpu_isa, cpu_flags, missing_flags
from cpp_build import require_built_extension

BLOCK_SIZE = 16
LENGTH = 45                 # past a 32-key chunk and two 16-token tiles
OTHER = 30                  # the other sequence's prompt; then it decodes beside ours

# Chunk sizes of our sequence per step (its rows compared with the one-step prefill), and whether
# another sequence shares each step.
SCHEDULES = {
    "chunks_of_5": ([5] * 9, True),
    "chunks_of_33": ([33, 12], False),
    "one_decode_per_token": ([1] * LENGTH, False),
    "prefill_then_decodes": ([30] + [1] * 15, True),
}


# Gemma 3 270M's global and sliding-window layers (a window that is no chunk multiple); 2 query
# heads a kv head (a 4-row group spans two tokens); 1 (and a head_dim off the 32-wide bf16 step).
SHAPES = [(4, 1, 256, None), (4, 1, 256, 40), (4, 2, 64, 7), (3, 3, 80, None)]


def cases():
    """(isa, shape): every shape on the path the engine picks here; the other paths on one shape
    that reaches their tails (each skipped, naming the flags, where this CPU cannot run it)."""
    flags = cpu_flags()
    best = best_cpu_isa(flags)
    out = [pytest.param(best, shape, id=f"{best.value}-{shape}") for shape in SHAPES]
    for isa in CpuIsa:
        if isa is best:
            continue
        missing = missing_flags(isa, flags)
        marks = [pytest.mark.skip(reason=f"CPU lacks {' '.join(missing)}")] if missing else []
        out.append(pytest.param(isa, SHAPES[2], id=f"{isa.value}-{SHAPES[2]}", marks=marks))
    return out


def run(steps, *, num_heads, num_kv_heads, head_dim, window, dtype, isa, other):
    """Our sequence's [LENGTH, num_heads, head_dim] output, computed in ``steps`` chunks; with
    ``other`` a second sequence prefills OTHER tokens in the first step and decodes in each next."""
    gen = torch.Generator().manual_seed(1)
    ours = [torch.randn(LENGTH, h, head_dim, generator=gen).to(dtype) for h in (num_heads, num_kv_heads, num_kv_heads)]
    theirs = [torch.randn(OTHER + len(steps), h, head_dim, generator=gen).to(dtype)
              for h in (num_heads, num_kv_heads, num_kv_heads)]
    ours_blocks = math.ceil(LENGTH / BLOCK_SIZE)
    num_blocks = ours_blocks + math.ceil((OTHER + len(steps)) / BLOCK_SIZE) + 1
    # Ours on the odd blocks of a reversed pool, theirs after: tables that are not 0, 1, 2, ...
    table = list(range(num_blocks - 1, -1, -1))
    tables = (table[:ours_blocks], table[ours_blocks:])
    k_cache = torch.full((num_blocks, BLOCK_SIZE, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    layer = Attention(num_heads, head_dim, num_kv_heads, head_dim ** -0.5, sliding_window=window,
                      backend="cpu_paged", cpu_isa=isa.value)
    outs, done, their_done = [], 0, 0
    for n in steps:
        q_lens, ctx_lens, tabs, parts = [n], [done], [tables[0]], [[t[done:done + n]] for t in ours]
        if other:
            m = OTHER if their_done == 0 else 1
            q_lens.append(m), ctx_lens.append(their_done), tabs.append(tables[1])
            for part, t in zip(parts, theirs):
                part.append(t[their_done:their_done + m])
            their_done += m
        md = build_attention_metadata(q_lens, ctx_lens, tabs, BLOCK_SIZE, "cpu")
        q, k, v = (torch.cat(p) for p in parts)
        outs.append(layer(q, k, v, k_cache, v_cache, md)[:n])
        done += n
    return torch.cat(outs)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("isa, shape", cases())
def test_row_does_not_depend_on_the_step(isa, shape, dtype):
    require_built_extension(cpu_paged.load_kernel, "the paged-attention kernel")
    num_heads, num_kv_heads, head_dim, window = shape
    kw = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, window=window,
                 dtype=dtype, isa=isa)
    whole = run([LENGTH], other=False, **kw)
    assert not whole.isnan().any()
    for name, (steps, other) in SCHEDULES.items():
        assert sum(steps) == LENGTH
        got = run(steps, other=other, **kw)
        bad = [i for i in range(LENGTH) if not torch.equal(got[i], whole[i])]
        assert not bad, f"{name}: rows {bad} differ from the one-step prefill"
