"""LoRA serving cost on the default model: ``bench throughput``'s workload through the base model
alone, with each request on one of N rank-16 adapters (all seven target modules, mixed in every
batch), and with one adapter merged into the weights (PEFT's ``merge_and_unload``: what serving
one adapter at a time costs nothing extra for). Engines kept alive, runs interleaved in rounds,
medians reported (the machine may be shared: compare ratios within one run).

    python benchmarks/lora_vs_base.py --dtype bfloat16 --rounds 3 --num-prompts 32

The adapters are random (seeded), saved by PEFT into --work-dir (reused when present).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapters(base: str, work: str, num: int, rank: int) -> tuple[list[str], str]:
    """``num`` PEFT adapter folders and a merged checkpoint of the first one, under ``work``."""
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = [os.path.join(work, f"adapter{i}") for i in range(num)]
    merged = os.path.join(work, "merged0")
    for i, path in enumerate(paths):
        if os.path.isfile(os.path.join(path, "adapter_config.json")):
            continue
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS,
                                                      lora_dropout=0.0, bias="none", task_type="CAUSAL_LM"))
        gen = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, p in peft_model.named_parameters():
                if "lora_B" in name:   # PEFT inits B to 0; small random B: the outputs stay text-like
                    p.copy_(torch.randn(p.shape, generator=gen) * 1e-3)
        peft_model.save_pretrained(path)
    if not os.path.isfile(os.path.join(merged, "config.json")):
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32), paths[0])
        model.merge_and_unload().save_pretrained(merged)
        for f in os.listdir(base):
            if f.startswith(("tokenizer", "special_tokens", "generation_config")) or f.endswith(".jinja"):
                shutil.copy(os.path.join(base, f), merged)
    return paths, merged


def main() -> None:
    from pagedllm.benchmarks.datasets import build_requests
    from pagedllm.benchmarks.throughput import run_throughput
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.loaders.model_files import resolve_model
    from pagedllm.lora.request import LoRARequest

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--num-adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--work-dir", default="/tmp/pagedllm_lora_bench")
    ap.add_argument("--output-json", default=None)
    ns = ap.parse_args()
    base = resolve_model("default").folder
    os.makedirs(ns.work_dir, exist_ok=True)
    paths, merged = make_adapters(base, ns.work_dir, ns.num_adapters, ns.rank)
    loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(paths)]
    common = dict(dtype=ns.dtype, seed=0)
    engines = {"base": LLM(base, **common),
               "lora": LLM(base, enable_lora=True, max_loras=len(loras), max_lora_rank=ns.rank, **common),
               "merged": LLM(merged, **common)}
    requests = build_requests("workload", ns.num_prompts, 0, 0, 0.0, 0,
                              engines["base"].llm_engine.vocab_size, engines["base"].llm_engine.max_model_len)
    per_request = [loras[i % len(loras)] for i in range(len(requests))]
    tps: dict[str, list[float]] = {k: [] for k in engines}
    for r in range(ns.rounds):
        for name, llm in engines.items():
            result, _ = run_throughput(llm, requests, warmup=(r == 0),
                                       lora_requests=per_request if name == "lora" else None)
            tps[name].append(result["output_tokens_per_s"])
            print(f"round {r} {name}: {result['output_tokens_per_s']:.1f} output tok/s", flush=True)
    med = {k: statistics.median(v) for k, v in tps.items()}
    summary = {"dtype": ns.dtype, "num_prompts": len(requests), "rounds": ns.rounds, "num_adapters": len(loras),
               "rank": ns.rank, "output_tok_s": tps, "median_output_tok_s": med,
               "lora_over_base": med["lora"] / med["base"], "merged_over_base": med["merged"] / med["base"]}
    print(json.dumps(summary, indent=1))
    if ns.output_json:
        with open(ns.output_json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
