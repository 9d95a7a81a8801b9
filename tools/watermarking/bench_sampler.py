"""Per-step cost of the watermarked draw vs the ordinary one (``Sampler``), at batch 1 and 16 on
the default model's 262,144-token vocabulary, float32 random logits, temperature 1.

Usage: python tools/watermarking/bench_sampler.py [--repeats 15]
Prints, per batch size, the minimum and median over ``--repeats`` interleaved runs of one sampler
call (metadata build included) with every row watermarked and with none, each also with top_k 64
(ms), then the vocabulary PRF alone, C++ kernel against torch rounds, and the machine's torch
thread count.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm.config import WatermarkConfig
from pagedllm.sample import Sampler, SamplingMetadata
from pagedllm.sampling_params import SamplingParams
from pagedllm.watermarking.sampling import WatermarkSampler

VOCAB = 262144


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    sampler = Sampler()
    wm = WatermarkSampler(WatermarkConfig(key=1234))
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, vocab {VOCAB}")
    for n in (1, 16):
        logits = torch.randn(n, VOCAB)
        outputs = [[int(t) for t in torch.randint(0, VOCAB, (20,))] for _ in range(n)]
        variants = (("watermarked", True, wm, 0), ("watermarked top_k=64", True, wm, 64),
                    ("plain", False, None, 0), ("plain top_k=64", False, None, 64))
        times = {name: [] for name, *_ in variants}
        for _ in range(args.repeats + 1):
            for name, watermarking, marker, top_k in variants:
                params = [SamplingParams(watermarking=watermarking, top_k=top_k)] * n
                t0 = time.perf_counter()
                md = SamplingMetadata.build(params, outputs, [[1]] * n, None, VOCAB, "cpu", watermark=marker)
                sampler(logits, md)
                times[name].append(time.perf_counter() - t0)
        # the vocabulary PRF alone: the C++ kernel against the torch rounds, interleaved
        contexts = torch.tensor([o[-4:] for o in outputs])
        prf = wm.watermarker.prf
        for use_kernel in (True, False) * (args.repeats + 1):
            t0 = time.perf_counter()
            prf.vocab_uniform(contexts, VOCAB, use_kernel=use_kernel)
            times.setdefault(f"PRF {'C++' if use_kernel else 'torch'}", []).append(time.perf_counter() - t0)
        for name, ts in times.items():
            ts = ts[1:]   # the first run warms up
            print(f"batch {n:2d} {name:20s}: min {min(ts) * 1e3:7.1f} ms, median {statistics.median(ts) * 1e3:7.1f} ms")


if __name__ == "__main__":
    main()
