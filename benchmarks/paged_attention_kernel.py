"""Single-thread CPU time of the paged-attention kernel on the workload's shapes (Gemma 3 270M).

    PYTHONPATH=. nice -n 19 python benchmarks/paged_attention_kernel.py [--baseline OLD.cpp] [--repeats 7]

Shapes (4 query heads, 1 KV head of 256, block size 16, physical blocks a random permutation of
the pool, one kernel call = one layer):

- ``decode``: 64 sequences, one query token each, cached contexts uniform in [100, 700];
- ``decode-L2``: 64 sequences of 400 cached tokens that share their blocks (0.8 MB in float32:
  the kernel's arithmetic without the trip to memory);
- ``prefill-N``: one fresh prompt of N tokens (context 0), N = 100, 250, 480;
- ``chunk``: a 256-token chunk on 400 cached tokens.

each with the sliding window of 512 (5 of Gemma 3's 6 layers) and without. ``--baseline`` builds a
second copy of the kernel from another source file (e.g. ``git show main:pagedllm/attention/csrc/
paged_attention.cpp > /tmp/old.cpp``) and times both, interleaved A/B/A/B in one process, so that
drift and other load on a shared machine hit both alike. The clock is ``time.process_time`` with
``torch.set_num_threads(1)``: only the kernel's own cycles count, not time spent waiting for a core.
Medians in milliseconds per call are printed.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from pagedllm.attention.backends import cpu_paged
from pagedllm.attention.ops import build_attention_metadata
from pagedllm.platforms.cpu import CpuIsa, cpu_flags, missing_flags
from pagedllm.platforms.cpu_extension import CpuExtension, load_extension

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 1, 256, 16
WINDOW = 512


def make_case(q_lens: list[int], ctx_lens: list[int], dtype: torch.dtype, seed: int = 0, shared: bool = False):
    """Query, caches and metadata for one kernel call: sequence i has ctx_lens[i] cached tokens
    and q_lens[i] new ones (their K/V already in the cache). ``shared``: every sequence reads the
    same blocks (a cache that stays in L2: the kernel's compute alone, without memory traffic)."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-(c + q) // BLOCK) for c, q in zip(ctx_lens, q_lens)]
    num_blocks = max(needed) if shared else sum(needed)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, used = [], 0
    for n in needed:
        tables.append(perm[:n] if shared else perm[used:used + n])
        used += n
    md = build_attention_metadata(q_lens, ctx_lens, tables, BLOCK, "cpu")
    q = torch.randn(sum(q_lens), HEADS, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    seq_ids = torch.arange(len(q_lens), dtype=torch.int32)
    return q, k, v, md, seq_ids


def cases(dtype: torch.dtype) -> dict[str, tuple]:
    gen = torch.Generator().manual_seed(1)
    decode_ctx = torch.randint(100, 701, (64,), generator=gen).tolist()
    out = {"decode": make_case([1] * 64, decode_ctx, dtype),
           "decode-L2": make_case([1] * 64, [400] * 64, dtype, shared=True)}
    for n in (100, 250, 480):
        out[f"prefill-{n}"] = make_case([n], [0], dtype)
    out["chunk"] = make_case([256], [400], dtype)
    return out


def call(kernel, isa_index: int, case, window: int):
    q, k, v, md, seq_ids = case
    out = torch.empty_like(q)
    kernel.paged_attention(q, out, k, v, md.block_tables, md.query_start_loc, md.seq_lens, md.context_lens,
                           seq_ids, HEAD_DIM ** -0.5, window, 0.0, isa_index)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", type=Path, help="another paged_attention.cpp to time against")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "both"], default="both")
    parser.add_argument("--cases", help="comma-separated case names to run (default: all)")
    parser.add_argument("--isa", choices=[i.value for i in CpuIsa], help="code path (default: the best this CPU runs)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    kernels = {"this": cpu_paged.load_kernel()}
    if args.baseline:
        kernels["baseline"] = load_extension(CpuExtension("paged_attention_baseline", args.baseline.resolve(),
                                                          "baseline paged-attention kernel", "nothing"))
    dtypes = [torch.float32, torch.bfloat16] if args.dtype == "both" else [getattr(torch, args.dtype)]
    best = CpuIsa(args.isa) if args.isa else [isa for isa in CpuIsa if not missing_flags(isa, cpu_flags())][-1]
    for dtype in dtypes:
        isa = cpu_paged.kernel_path(kernels["this"], best, dtype)
        print(f"# {dtype}, path {isa}; ms per call (median of {args.repeats}, single-thread CPU time)")
        print(f"{'case':<14}{'window':>7}" + "".join(f"{name:>10}" for name in kernels)
              + ("   max|diff|" if len(kernels) > 1 else ""))
        for name, case in cases(dtype).items():
            if args.cases and name not in args.cases.split(","):
                continue
            for window in (WINDOW, 0):
                idx = {kn: list(kern.compiled_isas()).index(isa) for kn, kern in kernels.items()}
                outs = {kn: call(kern, idx[kn], case, window) for kn, kern in kernels.items()}  # warm-up
                tokens = case[0].shape[0]
                inner = max(1, 2000 // tokens) if tokens > 1 else 3
                times = {kn: [] for kn in kernels}
                for _ in range(args.repeats):
                    for kn, kern in kernels.items():
                        t0 = time.process_time()
                        for _ in range(inner):
                            call(kern, idx[kn], case, window)
                        times[kn].append((time.process_time() - t0) / inner * 1e3)
                line = f"{name:<14}{window:>7}" + "".join(f"{statistics.median(times[kn]):>10.3f}" for kn in kernels)
                if len(kernels) > 1:
                    line += f"   {(outs['this'].float() - outs['baseline'].float()).abs().max().item():.2e}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
