"""Time this CPU's code paths against each other, interleaved, on the default model's shapes.

    PYTHONPATH=. python benchmarks/cpu_paths.py [--repeats 7] [--threads 1 --cpu-time]

Two comparisons, each A/B/A/B... in one process so that drift and other load on a shared machine
hit every variant alike; medians are printed:

1. the paged-attention kernel's code paths (``platforms.cpu.CpuIsa``) on a decode step of 64
   sequences x 256 cached tokens with Gemma 3 270M's heads (4 query heads, 1 KV head of 256), in
   float32 and bfloat16;
2. the linear layers of one decode step (q/k/v, o, gate/up, down x 18 layers, and the tied LM head
   262,144 x 640) at 16 and 64 rows: oneDNN packed float32 against oneDNN packed bfloat16 (where
   the CPU has native bf16).

On a machine shared with other work, ``--threads 1 --cpu-time`` times the process's CPU time
(``time.process_time``) on one thread instead of the wall clock: time spent waiting for a core
then does not count, only the code's own cycles (and what it loses to shared caches and memory).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm.attention.backends import cpu_paged
from pagedllm.attention.ops import build_attention_metadata
from pagedllm.layers.linear import PackedLinear, onednn_linear_available
from pagedllm.platforms.cpu import CpuIsa, cpu_flags, missing_flags

LAYERS = 18
SHAPES = [(1536, 640), (640, 1024), (4096, 640), (640, 2048)]  # merged qkv, o, merged gate/up, down
LM_HEAD = (262144, 640)


CLOCK = time.perf_counter


def _median_times(fns: dict, repeats: int, inner: int) -> dict[str, float]:
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up (oneDNN JIT, caches)
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = CLOCK()
            for _ in range(inner):
                fn()
            times[name].append((CLOCK() - t0) / inner)
    return {name: statistics.median(ts) for name, ts in times.items()}


def attention_paths(repeats: int) -> None:
    kernel = cpu_paged.load_kernel()
    paths = [isa for isa in CpuIsa if isa.value in kernel.compiled_isas() and not missing_flags(isa, cpu_flags())]
    seqs, ctx, heads, kv_heads, d, bs = 64, 256, 4, 1, 256, 16
    blocks = seqs * ctx // bs
    md = build_attention_metadata([1] * seqs, [ctx - 1] * seqs,
                                  [list(range(i * ctx // bs, (i + 1) * ctx // bs)) for i in range(seqs)], bs, "cpu")
    seq_ids = torch.arange(seqs, dtype=torch.int32)
    print(f"paged attention, decode step: {seqs} sequences x {ctx} tokens, {heads} heads / {kv_heads} KV head "
          f"of {d} (one layer; ms, median of {repeats})")
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(seqs, heads, d).to(dtype)
        k_cache = torch.randn(blocks, bs, kv_heads, d).to(dtype)
        v_cache = torch.randn(blocks, bs, kv_heads, d).to(dtype)
        out = torch.empty_like(q)
        fns = {}
        for isa in paths:
            if isa is CpuIsa.AVX512_BF16 and dtype != torch.bfloat16:
                continue
            idx = kernel.compiled_isas().index(isa.value)
            fns[isa.value] = (lambda idx=idx: kernel.paged_attention(
                q, out, k_cache, v_cache, md.block_tables, md.query_start_loc, md.seq_lens, md.context_lens,
                seq_ids, d ** -0.5, 0, 0.0, idx))
        res = _median_times(fns, repeats, 5)
        kv_bytes = 2 * seqs * ctx * kv_heads * d * q.element_size()
        print(f"  {str(dtype).replace('torch.', ''):9s} " + "  ".join(
            f"{name} {t * 1e3:.2f} ms ({kv_bytes / t / 1e9:.0f} GB/s)" for name, t in res.items()))


def linear_dtypes(repeats: int) -> None:
    dtypes = [torch.float32] + ([torch.bfloat16] if onednn_linear_available(torch.bfloat16) else [])
    print(f"linear layers of one decode step, oneDNN packed (ms, median of {repeats}; "
          f"{'bfloat16 not native here' if len(dtypes) == 1 else 'float32 vs bfloat16'})")
    gen = torch.Generator().manual_seed(0)
    weights = {s: torch.randn(*s, generator=gen) * 0.02 for s in SHAPES + [LM_HEAD]}
    for rows in (16, 64):
        fns = {}
        for dtype in dtypes:
            layers = {s: PackedLinear(w.to(dtype), None, 64) for s, w in weights.items()}
            x_in = {s: torch.randn(rows, s[1], generator=gen).to(dtype) for s in weights}
            name = str(dtype).replace("torch.", "")
            fns[f"{name} layers"] = (lambda layers=layers, x_in=x_in: [layers[s](x_in[s]) for s in SHAPES])
            fns[f"{name} LM head"] = (lambda layers=layers, x_in=x_in: layers[LM_HEAD](x_in[LM_HEAD]))
        res = _median_times(fns, repeats, 1)
        print(f"  {rows} rows: " + "  ".join(
            f"{name} {t * 1e3 * (LAYERS if name.endswith('layers') else 1):.1f}" for name, t in res.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--cpu-time", action="store_true", help="time CPU time, not the wall clock")
    ns = parser.parse_args()
    global CLOCK
    if ns.threads:
        torch.set_num_threads(ns.threads)
    if ns.cpu_time:
        CLOCK = time.process_time
    print("clock:", "process CPU time" if ns.cpu_time else "wall")
    print("CPU flags:", " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx")))) or "(no AVX-512)")
    print("torch threads:", torch.get_num_threads())
    attention_paths(ns.repeats)
    linear_dtypes(ns.repeats)


if __name__ == "__main__":
    main()
