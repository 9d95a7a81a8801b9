"""A MoE decode step against a dense model with the same active weight bytes (issue 30, item 2).

Builds two random checkpoints from transformers' config classes into a temporary folder (nothing
downloaded): a Qwen3-MoE with E experts of width I, top k, and a Qwen3 whose dense MLP has width
k x I, with the same attention, embedding and head, so one token reads the same weight bytes in
both (the MoE adds only its router, E x H). Then ``bench latency``'s ``run_latency`` on each, at
each batch size, interleaved (MoE, dense, MoE, dense, ...: the machine is shared, so a slow spell
hits both), and prints the median decode step of each and their ratio.

    python benchmarks/moe_vs_dense.py --dtype float32 --batch-sizes 1,16 --rounds 5
    python benchmarks/moe_vs_dense.py --compare-ep    # the MoE at -tp 2: sliced vs whole experts

A script that starts ranks needs the ``__main__`` guard (spawned workers), which this one has.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile


def build(folder: str, moe: bool, hidden: int, layers: int, experts: int, top_k: int, width: int, vocab: int) -> str:
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config, Qwen3MoeConfig

    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
                  num_key_value_heads=max(1, hidden // 256), head_dim=64, max_position_embeddings=1024,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    config = (Qwen3MoeConfig(**common, num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=width,
                             intermediate_size=width * top_k, norm_topk_prob=True) if moe
              else Qwen3Config(**common, intermediate_size=width * top_k))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    words = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=words, bos_token="t1", eos_token="t2").save_pretrained(folder)
    return folder


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quantization", default=None)
    p.add_argument("--batch-sizes", default="1,16")
    p.add_argument("--rounds", type=int, default=5, help="interleaved (MoE, dense) rounds per batch size")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--width", type=int, default=768, help="one expert's intermediate size (dense: top_k x width)")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--output-len", type=int, default=24)
    p.add_argument("--threads", type=int, default=None, help="torch threads of the in-process engine (default: torch's)")
    p.add_argument("--compare-ep", action="store_true",
                   help="instead: the MoE model at tensor_parallel_size=2, experts sliced vs whole (expert parallel)")
    p.add_argument("--output-json", default=None)
    ns = p.parse_args()

    import torch

    from pagedllm import LLM
    from pagedllm.benchmarks.latency import run_latency

    if ns.threads:
        torch.set_num_threads(ns.threads)

    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        folders = {kind: build(f"{tmp}/{kind}", kind == "moe", ns.hidden, ns.layers, ns.experts, ns.top_k, ns.width,
                               ns.vocab) for kind in ("moe", "dense")}
        for bs in [int(b) for b in ns.batch_sizes.split(",")]:
            kw = dict(dtype=ns.dtype, quantization=ns.quantization, max_model_len=256, max_num_seqs=bs,
                      max_num_batched_tokens=max(bs * 16, 64), kv_cache_memory_bytes=64 << 20, exact_greedy_head="off")
            if ns.compare_ep:   # one thread per rank on this 2-core machine
                llms = {kind: LLM(folders["moe"], tensor_parallel_size=2, enable_expert_parallel=kind == "ep",
                                  cpu_threads_per_rank=1, **kw) for kind in ("tp", "ep")}
            else:
                llms = {kind: LLM(folder, **kw) for kind, folder in folders.items()}
            steps = {kind: [] for kind in llms}
            info = {}
            for _ in range(ns.rounds):
                for kind, llm in llms.items():
                    r = run_latency(llm, bs, 16, ns.output_len, num_iters=1, num_iters_warmup=1, ceiling=False)
                    steps[kind].append(r["p50_decode_step_s"])
                    info[kind] = (r.get("weight_bytes", 0), r.get("active_weight_bytes_per_token", 0))
            med = {kind: statistics.median(v) for kind, v in steps.items()}
            if ns.compare_ep:
                results[bs] = {"median_decode_step_ms": {k: v * 1e3 for k, v in med.items()},
                               "all_decode_steps_ms": {k: [x * 1e3 for x in v] for k, v in steps.items()}}
                print(f"batch {bs:3d}, MoE at -tp 2: experts sliced {med['tp'] * 1e3:7.2f} ms, whole experts per "
                      f"rank (--enable-expert-parallel) {med['ep'] * 1e3:7.2f} ms per decode step "
                      f"(medians of {ns.rounds})", flush=True)
                del llms
                continue
            results[bs] = {"median_decode_step_ms": {k: v * 1e3 for k, v in med.items()},
                           "all_decode_steps_ms": {k: [x * 1e3 for x in v] for k, v in steps.items()},
                           "weight_mib": {k: v[0] / 2**20 for k, v in info.items()},
                           "active_mib_per_token": {k: v[1] / 2**20 for k, v in info.items()},
                           "moe_over_dense": med["moe"] / med["dense"]}
            print(f"batch {bs:3d}: MoE {med['moe'] * 1e3:7.2f} ms, dense {med['dense'] * 1e3:7.2f} ms per decode step "
                  f"(medians of {ns.rounds}), ratio {med['moe'] / med['dense']:.2f}; weights MoE "
                  f"{info['moe'][0] / 2**20:.0f} MiB / dense {info['dense'][0] / 2**20:.0f} MiB, active per token "
                  f"{info['moe'][1] / 2**20:.1f} / {info['dense'][1] / 2**20:.1f} MiB", flush=True)
            del llms
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
