"""Time this CPU's code paths against each other, interleaved, on the default model's shapes.

    PYTHONPATH=. python benchmarks/cpu_paths.py [--repeats 7] [--threads 1 --cpu-time]
        [--parts attention,linear] [--rows 16,64]

Two comparisons, each A/B/A/B... in one process so that drift and other load on a shared machine
hit every variant alike; medians are printed:

1. the paged-attention kernel's code paths (``platforms.cpu.CpuIsa``) on a decode step of 64
   sequences x 256 cached tokens with Gemma 3 270M's heads (4 query heads, 1 KV head of 256), in
   float32 and bfloat16;
2. the linear layers of one decode step (q/k/v, o, gate/up, down x 18 layers: 72 weights of their
   own, so that they stream from memory as in the model; and the tied LM head 262,144 x 640) at
   ``--rows`` rows (default 16 and 64): oneDNN packed float32 and our float32 GEMM
   (``layers/f32_gemm.py``, where it runs), with oneDNN's time over ours; oneDNN packed bfloat16
   (where the CPU has native bf16) and our AVX-512 BF16 GEMM (``layers/bf16_gemm.py``, where it
   runs), with oneDNN bf16's time over the GEMM's; and, on AMX CPUs, our AMX GEMM (``layers/amx_gemm.py``)
   with the ratios GEMM / AMX and oneDNN / AMX. (Before session 10 this part reused one weight per shape
   18 times, which stays in L3 and hid the difference between the bf16 kernels.) On AVX2 CPUs
   without native bf16: torch's bf16 ``F.linear`` (what ``cpu_bf16_gemm="onednn"`` runs there) and
   our AVX2 bf16 GEMM, with F.linear's time and our float32 GEMM's over the AVX2 GEMM's.

``--parts attention`` or ``--parts linear`` runs one of the two. For the linear part on two cores,
run it with nothing else on the machine and the default threads: another process's load stalls
one OpenMP thread while the other waits for it (``--threads 1`` is steadier under load).

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


def linear_kernels(repeats: int, rows_list: list[int]) -> None:
    """The linear-layer comparison (part 2 of the module docstring): one line per row count."""
    from pagedllm.layers.bf16_gemm import (AMX_KERNEL, AVX2_KERNEL, BF16_KERNEL, Bf16Linear, bf16_kernel_for,
                                           bf16_module)
    from pagedllm.layers.linear import plain_linear

    from pagedllm.layers.f32_gemm import F32_KERNEL, F32Linear, f32_kernel_for, load_f32_gemm

    kernels = {"float32": lambda w: PackedLinear(w, None, 64)}
    skipped = []
    got, why = f32_kernel_for("auto")
    if got == F32_KERNEL:
        kernels["float32 GEMM"] = lambda w, module=load_f32_gemm(): F32Linear(w, None, module)
    else:
        skipped.append(f"no float32 GEMM: {why}")
    if onednn_linear_available(torch.bfloat16):
        kernels["bfloat16 oneDNN"] = lambda w: PackedLinear(w.to(torch.bfloat16), None, 64)
    else:   # no native bf16: what cpu_bf16_gemm="onednn" runs there (torch's bf16 F.linear)
        kernels["bfloat16 F.linear"] = lambda w: plain_linear(w.to(torch.bfloat16), None)
    for label, name in (("bfloat16 GEMM", BF16_KERNEL), ("bfloat16 AVX2", AVX2_KERNEL), ("bfloat16 AMX", AMX_KERNEL)):
        got, why = bf16_kernel_for("auto", kernel=name)
        if got == name:
            kernels[label] = (lambda w, module=bf16_module(name): Bf16Linear(w.to(torch.bfloat16), None, module))
        else:
            skipped.append(f"no {label}: {why}")
    print(f"linear layers of one decode step, {LAYERS * len(SHAPES)} weights + the LM head (ms, median of "
          f"{repeats}): {', '.join(kernels)}" + (f" ({'; '.join(skipped)})" if skipped else ""))
    gen = torch.Generator().manual_seed(0)
    shapes = SHAPES * LAYERS
    sets = {"layers": shapes, "LM head": [LM_HEAD]}
    layers = {}
    for label, make in kernels.items():
        for part, part_shapes in sets.items():
            layers[label, part] = [make(torch.randn(*s, generator=gen) * 0.02) for s in part_shapes]
    for rows in rows_list:
        fns = {}
        for (label, part), mods in layers.items():
            dtype = torch.float32 if label.startswith("float32") else torch.bfloat16
            x_in = [torch.randn(rows, s[1], generator=gen).to(dtype) for s in sets[part]]
            fns[f"{label} {part}"] = (lambda mods=mods, x_in=x_in: [m(x) for m, x in zip(mods, x_in)])
        res = _median_times(fns, repeats, 1)
        line = "  ".join(f"{name} {t * 1e3:.2f}" for name, t in res.items())
        for base, other in (("float32", "float32 GEMM"), ("bfloat16 oneDNN", "bfloat16 GEMM"), ("bfloat16 GEMM", "bfloat16 AMX"),
                            ("bfloat16 oneDNN", "bfloat16 AMX"), ("bfloat16 F.linear", "bfloat16 AVX2"),
                            ("float32 GEMM", "bfloat16 AVX2")):
            if base in kernels and other in kernels:
                line += f"  {base} / {other}: " + ", ".join(
                    f"{part} {res[f'{base} {part}'] / res[f'{other} {part}']:.2f}x" for part in sets)
        print(f"  {rows} rows: {line}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--cpu-time", action="store_true", help="time CPU time, not the wall clock")
    parser.add_argument("--parts", default="attention,linear", help="attention, linear or both (comma-separated)")
    parser.add_argument("--rows", default="16,64", help="row counts of the linear part (comma-separated)")
    ns = parser.parse_args()
    global CLOCK
    if ns.threads:
        torch.set_num_threads(ns.threads)
    if ns.cpu_time:
        CLOCK = time.process_time
    print("clock:", "process CPU time" if ns.cpu_time else "wall")
    print("CPU flags:", " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx")))) or "(no AVX-512)")
    print("torch threads:", torch.get_num_threads())
    parts = ns.parts.split(",")
    if "attention" in parts:
        attention_paths(ns.repeats)
    if "linear" in parts:
        linear_kernels(ns.repeats, [int(r) for r in ns.rows.split(",")])


if __name__ == "__main__":
    main()
