"""Batch-1 decode overhead in single-thread CPU time (docs/performance.md, step 18).

``bench latency --breakdown``'s components, but timed with ``time.process_time`` on one thread
(``torch.set_num_threads(1)``), so that other processes on a shared machine move the numbers
less. Runs ``run_latency`` ``--repeats`` times on one engine and prints each component's median
ms per step (and the overhead: everything but the linear layers and the LM head).

    PYTHONPATH=$PWD nice -n 19 python benchmarks/b1_overhead_cpu.py --quantization int8_weight_only
"""

from __future__ import annotations

import argparse
import statistics
import time
import types

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quantization", default="int8_weight_only")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from pagedllm.benchmarks import breakdown, latency
    from pagedllm.entrypoints.llm import LLM

    cpu_time = types.SimpleNamespace(perf_counter=time.process_time)
    breakdown.time = cpu_time   # every component timer, and the iteration's total
    latency.time = cpu_time
    llm = LLM(None, dtype=args.dtype, quantization=args.quantization, max_num_seqs=1,
              max_num_batched_tokens=args.input_len)
    runs = []
    for _ in range(args.repeats):
        r = latency.run_latency(llm, 1, args.input_len, args.output_len, num_iters=2, num_iters_warmup=1,
                                ceiling=False, breakdown=True)
        per = dict(r["breakdown_ms_per_step"])
        per["overhead (not linear/head)"] = r["overhead_ms_per_step"]
        per["step (all)"] = sum(r["breakdown_ms_per_step"].values())
        runs.append(per)
    for key in runs[0]:
        vals = [run[key] for run in runs]
        print(f"{key:28s} {statistics.median(vals):8.3f} ms/step  (min {min(vals):.3f}, max {max(vals):.3f})")


if __name__ == "__main__":
    main()
