"""Decode forward of the default model with the fused CPU ops on and off (docs/performance.md).

One process, one thread (``torch.set_num_threads(1)``), CPU time (``time.process_time``): the
same model instance runs both modes, interleaved, ``--repeats`` times; each timing is the
median. Also times the linear layers and attention (their classes' ``forward`` / ``__call__``
wrapped) so that "model forward, other" = forward - linear layers - attention. Run against
another checkout (``PYTHONPATH=<it>``) without the fused ops, both modes are its eager code.

    PYTHONPATH=$PWD python benchmarks/fused_ops_forward.py --dtype float32 --rows 1 16
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--context", type=int, default=64, help="cached tokens per sequence")
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--inner", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    from pagedllm import LLM
    from pagedllm.attention import Attention
    from pagedllm.attention.ops import build_attention_metadata

    llm = LLM(None, dtype=args.dtype, max_model_len=512, max_num_seqs=16, kv_cache_memory_bytes=256 << 20)
    worker = llm.llm_engine.executor.driver_worker
    model, kv, bs = worker.model, worker.kv_caches, worker.cache_config.block_size

    def set_fused(on: bool) -> None:
        for m in model.modules():
            if hasattr(m, "use_fused_ops"):
                m.use_fused_ops = on

    # Time spent in the linear layers and in attention: their classes' forward / __call__ wrapped
    # (attention.Attention is not an nn.Module, so module hooks would miss it). Neither nests in
    # the other, so the two sums are exclusive.
    acc = {"linear": 0.0, "attention": 0.0}

    def wrap(cls, key, attr="forward"):
        orig = getattr(cls, attr)

        def timed(self, *a, **k):
            t0 = time.process_time()
            out = orig(self, *a, **k)
            acc[key] += time.process_time() - t0
            return out
        setattr(cls, attr, timed)

    linear_classes = {type(m) for m in model.modules()
                      if type(m).__name__.endswith("Linear") and not any(True for _ in m.children())}
    for cls in linear_classes:
        wrap(cls, "linear")
    wrap(Attention, "attention", "__call__")

    for rows in args.rows:
        blocks_per = (args.context + 1 + bs - 1) // bs
        tables = [list(range(i * blocks_per, (i + 1) * blocks_per)) for i in range(rows)]
        md = build_attention_metadata([1] * rows, [args.context] * rows, tables, bs, "cpu")
        ids = torch.randint(10, 1000, (rows,))
        pos = torch.full((rows,), args.context, dtype=torch.int64)
        res = {}
        with torch.inference_mode():
            for on in (False, True):  # warm-up
                set_fused(on)
                model(ids, pos, kv, md)
            times = {False: [], True: []}
            parts = {False: [], True: []}
            attn = {False: [], True: []}
            for _ in range(args.repeats):
                for on in (False, True):
                    set_fused(on)
                    acc["linear"] = acc["attention"] = 0.0
                    t0 = time.process_time()
                    for _ in range(args.inner):
                        model(ids, pos, kv, md)
                    times[on].append((time.process_time() - t0) / args.inner * 1e3)
                    parts[on].append((acc["linear"] + acc["attention"]) / args.inner * 1e3)
                    attn[on].append(acc["attention"] / args.inner * 1e3)
        for on in (False, True):
            fwd, la = statistics.median(times[on]), statistics.median(parts[on])
            res[on] = (fwd, la, fwd - la)
            print(f"{args.dtype} rows={rows:3d} fused={'on ' if on else 'off'}: forward {fwd:7.2f} ms, "
                  f"linear+attention {la:7.2f} ms (attention {statistics.median(attn[on]):5.2f}), "
                  f"other {fwd - la:6.2f} ms")
        print(f"  -> other {res[False][2]:.2f} -> {res[True][2]:.2f} ms "
              f"({100 * (res[True][2] / res[False][2] - 1):+.0f}%), forward {100 * (res[True][0] / res[False][0] - 1):+.1f}%")


if __name__ == "__main__":
    main()
