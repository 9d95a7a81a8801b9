"""Single-thread CPU time of the full LM head + argmax vs the exact greedy head (cheap pass +
bound + exact re-score), on the default model's head and real hidden rows.

Usage (repo root): ``nice -n 19 python benchmarks/greedy_head.py [model folder] [--repeats 7] [--rows 1,4,16,64]
[--kinds bf16,int8,int8_vnni,int8_avx2]`` (``int8_vnni``'s two-pass time is its fused C++ call;
``int8_avx2`` only where the int8 kernel's AVX2 code runs); the full head is the engine's float32 GEMM
where it runs (``layers/f32_gemm.py``), else oneDNN's packed inner product; for ``bfloat16`` where the
engine runs the AVX2 bf16 GEMM, that GEMM, and only ``int8_avx2`` as the bf16-logit head (its tokens
checked against the full head's argmax instead of the exact one);
``--engine``: instead, the default model in each of ``--dtypes`` through ``LLM`` with ``exact_greedy_head``
``auto`` and ``off``: whether 5 prompts x 32 greedy tokens agree, and the CPU time of a batch-1
generate of 48 tokens (3 interleaved repeats).
Hidden rows: the final-norm hidden states of every position of a few texts through transformers
(float32), so the candidate counts are those of real logits. Times are medians of
``time.process_time`` with ``torch.set_num_threads(1)`` (the machine is shared; wall time is not
reliable there). Prints one line per (model dtype, M, path).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pagedllm.sample.greedy_head import ExactGreedyHead
from pagedllm.layers.linear import PackedLinear

TEXTS = [
    "The capital of France is Paris, and the capital of Germany is Berlin. The largest city in",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "Q: What is 17 times 23?\nA: 17 times 23 is 391. Q: What is 12 times 12?\nA:",
    "The mitochondria is the powerhouse of the cell. Photosynthesis happens in the",
]


def hidden_rows(folder: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden [T, K] float32 after the final norm, head weight [V, K] float32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    rows = []
    with torch.inference_mode():
        for text in TEXTS:
            ids = tok(text, return_tensors="pt").input_ids
            out = model(ids, output_hidden_states=True)
            rows.append(out.hidden_states[-1][0])
    return torch.cat(rows), model.get_output_embeddings().weight.detach().clone()


def cpu_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return 1e3 * statistics.median(times)


def engine_check(repeats: int = 3, dtype: str = "float32") -> None:
    """The engine with the switch on and off (see the module docstring)."""
    from pagedllm import LLM, SamplingParams

    prompts = ["The capital of France is", "def quicksort(arr):", "Once upon a time, in a land far away,",
               "The three laws of thermodynamics are", "Water boils at"]
    llms = {m: LLM(None, dtype=dtype, seed=0, exact_greedy_head=m, max_num_seqs=4) for m in ("auto", "off")}
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    tokens = {m: [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
              for m, llm in llms.items()}
    head = llms["auto"].llm_engine.executor.driver_worker.model_runner.greedy_head
    print(f"5 prompts x 32 tokens identical: {tokens['auto'] == tokens['off']}; rows through the exact head "
          f"{head.num_rows if head else 0}, fallback {head.num_fallback_rows if head else 0}", flush=True)
    one = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    times: dict[str, list[float]] = {m: [] for m in llms}
    for _ in range(repeats):
        for m, llm in llms.items():
            t0 = time.process_time()
            llm.generate([prompts[0]], one, use_tqdm=False)
            times[m].append(time.process_time() - t0)
    for m, ts in times.items():
        print(f"exact_greedy_head={m}: batch 1, 48 tokens: {1e3 * statistics.median(ts) / 48:.2f} ms CPU per token "
              f"(runs {[round(t, 2) for t in ts]} s)", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("folder", nargs="?", default=None)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rows", default="1,4,16,64")
    ap.add_argument("--engine", action="store_true", help="the engine check instead of the head timings")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="model dtypes to time")
    ap.add_argument("--kinds", default="bf16,int8,int8_vnni,int8_avx2",
                    help="cheap-pass kinds to time (int8_vnni only where the CPU has VNNI, int8_avx2 where its code runs)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.engine:
        for dtype in args.dtypes.split(","):
            print(f"== {dtype}", flush=True)
            engine_check(dtype=dtype)
        return
    if args.folder is None:
        from pagedllm.loaders.model_files import resolve_model
        args.folder = resolve_model(None).folder
    torch.set_num_threads(1)
    hidden, weight = hidden_rows(args.folder)
    hidden = hidden[torch.randperm(hidden.shape[0], generator=torch.Generator().manual_seed(0))]
    print(f"head {list(weight.shape)}, {hidden.shape[0]} hidden rows", flush=True)
    for dtype in [getattr(torch, d) for d in args.dtypes.split(",")]:
        w = weight.to(dtype)
        from pagedllm.layers.f32_gemm import F32Linear, f32_kernel_for, load_f32_gemm
        from pagedllm.layers.int8_gemm import VNNI_KERNEL, int8_avx2_unavailable, int8_kernel_for

        from pagedllm.layers.bf16_gemm import AVX2_KERNEL, Bf16Linear, bf16_kernel_for, bf16_module

        logits_kernel = None
        if dtype == torch.float32 and f32_kernel_for()[0] != "onednn":   # the engine's float32 head here
            full = F32Linear(w, None, load_f32_gemm())
        elif dtype == torch.bfloat16 and bf16_kernel_for()[0] == AVX2_KERNEL:
            # the engine's bf16 head here, and the bf16-logit head (its argmax, ties included)
            logits_kernel = bf16_module(AVX2_KERNEL)
            full = Bf16Linear(w, None, logits_kernel)
        else:
            full = PackedLinear(w, None, 64)
        print(f"{str(dtype)[6:]:9s} full head: {type(full).__name__}", flush=True)
        kinds = [k for k in args.kinds.split(",") if (k != "int8_vnni" or int8_kernel_for()[0] == VNNI_KERNEL)
                 and (k != "int8_avx2" or int8_avx2_unavailable() is None)]
        if logits_kernel is not None:
            kinds = [k for k in kinds if k == "int8_avx2"]
        heads = {kind: ExactGreedyHead(w, kind, 64, logits_kernel=logits_kernel) for kind in kinds}
        for kind, head in heads.items():   # a row's fallback does not depend on the other rows
            _, fb = head.argmax(hidden.to(dtype))
            print(f"{str(dtype)[6:]:9s} {kind}: {int(fb.sum())} of {hidden.shape[0]} rows fall back to the full head",
                  flush=True)
        for m in [int(r) for r in args.rows.split(",")]:
            x = hidden[:m].to(dtype)
            # the exact argmax, or (bf16-logit head) the full head's own
            ref = (x.double() @ w.double().t()).argmax(dim=1) if logits_kernel is None else full(x).float().argmax(dim=1)
            t_full = cpu_ms(lambda: full(x).float().argmax(dim=1), args.repeats)
            line = f"{str(dtype)[6:]:9s} M={m:3d} full head + argmax {t_full:7.1f} ms"
            for kind, head in heads.items():
                toks, fb = head.argmax(x)
                assert torch.equal(toks[~fb], ref[~fb]), kind
                t = cpu_ms(lambda: head.argmax(x), args.repeats)
                t_cheap = cpu_ms(lambda: head.cheap_pass(x), args.repeats)
                line += (f" | {kind}: cheap {t_cheap:6.1f} two-pass {t:6.1f} ms "
                         f"({t_full / t:4.2f}x, fallback rows {int(fb.sum())})")
            print(line, flush=True)


if __name__ == "__main__":
    main()
