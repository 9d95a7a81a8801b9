"""Wall time of a bf16 model's linear layers: our AVX-512 BF16 GEMM against oneDNN's packed kernel.

    PYTHONPATH=. python benchmarks/bf16_gemm.py [--rows 1,4,8,16,32,64,128,512] [--sets layers,head]
        [--threads 2] [--repeats 9] [--baseline OLD.cpp]

Sets (random bf16 weights of Gemma 3 270M's shapes, so that they stream from memory as in the model):

- ``layers``: the 72 decoder linear layers (18 x qkv 1536 x 640, o 640 x 1024, gate/up 4096 x 640,
  down 640 x 2048; 200 MB), called one after another: one decode step's linear layers;
- ``head``: the tied LM head, 262,144 x 640 (335 MB).

For each row count M it times one pass over the set with each kernel, interleaved A/B/A/B in one
process (drift and other load on a shared machine hit both alike), on ``--threads`` threads, and
prints the medians in milliseconds and oneDNN's time over ours. Run it with nothing else on the
machine: with as many threads as cores, another process's load stalls one OpenMP thread and the
other waits for it, which swamps the difference (``--threads 1`` is steadier under load). ``--baseline`` adds a second
build of our kernel from another source file (e.g. ``git show HEAD~1:pagedllm/layers/csrc/
bf16_gemm.cpp > /tmp/old.cpp``) as a third column.

Raises SystemExit where the CPU lacks the kernel's flags or the kernel does not build.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from pagedllm.layers.bf16_gemm import BF16_GEMM_FLAGS, EXTENSION, load_bf16_gemm
from pagedllm.layers.linear import PackedLinear
from pagedllm.platforms.cpu import cpu_flags
from pagedllm.platforms.cpu_extension import CpuExtension, load_extension

LAYER_SHAPES = [(1536, 640), (640, 1024), (4096, 640), (640, 2048)] * 18
HEAD_SHAPES = [(262144, 640)]


def time_sets(sets: list[str], rows: list[int], repeats: int, kernels: dict) -> None:
    """Print one line per set: per row count, the median ms of each kernel and oneDNN / ours."""
    for name in sets:
        shapes = LAYER_SHAPES if name == "layers" else HEAD_SHAPES
        torch.manual_seed(0)
        weights = [(torch.randn(n, k) * 0.05).bfloat16() for n, k in shapes]
        layers = {label: [make(w) for w in weights] for label, make in kernels.items()}
        del weights
        for m in rows:
            xs = [torch.randn(m, k).bfloat16() for _, k in shapes]
            samples = {label: [] for label in layers}
            for rep in range(repeats + 2):
                for label, mods in layers.items():
                    t0 = time.perf_counter()
                    for mod, x in zip(mods, xs):
                        mod(x)
                    if rep >= 2:  # two warm-up passes
                        samples[label].append(time.perf_counter() - t0)
            med = {label: 1e3 * statistics.median(s) for label, s in samples.items()}
            cols = "  ".join(f"{label} {v:8.2f} ms" for label, v in med.items())
            print(f"{name:6s} M={m:4d}  {cols}  oneDNN/ours {med['oneDNN'] / med['ours']:.2f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,4,8,16,32,64,128,512")
    parser.add_argument("--sets", default="layers,head")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--baseline", type=Path, help="another bf16_gemm.cpp to time as a third kernel")
    args = parser.parse_args()
    missing = [f for f in BF16_GEMM_FLAGS if f not in cpu_flags()]
    if missing:
        raise SystemExit(f"the bf16 GEMM needs the CPU flags {missing}")
    from pagedllm.layers.bf16_gemm import Bf16Linear

    ours = load_bf16_gemm()
    if ours is None:
        raise SystemExit("the bf16 GEMM did not build (see the warning above)")
    torch.set_num_threads(args.threads)
    kernels = {"ours": lambda w: Bf16Linear(w, None, ours), "oneDNN": lambda w: PackedLinear(w, None, 16)}
    if args.baseline is not None:
        old = load_extension(CpuExtension("bf16_gemm_baseline", args.baseline.resolve(), "baseline bf16 GEMM", "none",
                                          EXTENSION.extra_cflags, EXTENSION.extra_ldflags))
        if old is None:
            raise SystemExit(f"{args.baseline} did not build")
        kernels["baseline"] = lambda w: Bf16Linear(w, None, old)
    print(f"threads {args.threads}, medians of {args.repeats} passes; CPU flags: "
          + " ".join(sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx")))))
    time_sets(args.sets.split(","), [int(r) for r in args.rows.split(",")], args.repeats, kernels)


if __name__ == "__main__":
    main()
