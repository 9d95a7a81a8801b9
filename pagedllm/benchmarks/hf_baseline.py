"""The Hugging Face baseline: the same workload through transformers ``generate`` in static batches.

What a server without paging or continuous batching does: requests are taken in arrival order,
``batch_size`` at a time; each batch is left-padded to its longest prompt and runs
``max_new_tokens = min_new_tokens =`` its largest ``max_tokens``, so every member makes at least
its own tokens. Only each request's own ``max_tokens`` count as output; the rest of its row
(padding and overshoot) is waste. Every request arrives at the start, so TTFT includes the wait
for earlier batches; a request's TPOT runs from its batch's first token to its own last token.

It runs in a separate process (``python -m pagedllm.benchmarks.hf_baseline``), so the two engines
never share memory, threads or allocator state; :func:`run_hf_baseline` starts one process per
batch size.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time

from pagedllm.benchmarks.metrics import RequestRecord, summarize

logger = logging.getLogger(__name__)

WARMUP_NEW_TOKENS = 2


def static_batches(num_requests: int, batch_size: int) -> list[range]:
    """Request indices of each static batch, in arrival order.

    Raises:
        ValueError: if ``batch_size < 1``.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    return [range(i, min(i + batch_size, num_requests)) for i in range(0, num_requests, batch_size)]


def records_from_batch(t0: float, token_times: list[float], prompt_lens: list[int],
                       max_tokens: list[int]) -> list[RequestRecord]:
    """Per-request records of one static batch.

    Args:
        t0: when every request arrived (the benchmark start).
        token_times: when the batch produced its 1st, 2nd, ... token (one entry per decode step).
        prompt_lens, max_tokens: the members' own prompt lengths and output lengths.
    Raises:
        RuntimeError: if the batch made fewer steps than a member's ``max_tokens``.
    """
    need = max(max_tokens)
    if len(token_times) < need:
        raise RuntimeError(f"static batch made {len(token_times)} tokens, a member needs {need}")
    return [RequestRecord(prompt_len=p, output_len=n, start=t0, first_token_time=token_times[0],
                          last_token_time=token_times[n - 1], token_times=token_times[:n])
            for p, n in zip(prompt_lens, max_tokens)]


class _StepTimes:
    """A transformers streamer that timestamps each generated step (the first ``put`` is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._seen_prompt = False

    def put(self, value) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        self.times.append(time.monotonic())

    def end(self) -> None:
        pass


def run_static_batches(model, prompts: list[list[int]], max_tokens: list[int], batch_size: int,
                       pad_token_id: int) -> dict:
    """Generate the workload in static batches with an already loaded transformers model.

    Args:
        model: an ``AutoModelForCausalLM`` in eval mode.
        prompts: token ids per request (the engine's own tokenization, BOS included).
        max_tokens: output tokens per request.
        batch_size: requests per static batch.
        pad_token_id: left-padding id (masked out).
    Returns:
        ``metrics.summarize``'s dict plus ``batch_size``, ``num_generated_slots`` (rows x steps
        actually computed) and ``useful_output_fraction``.
    """
    import torch

    t0 = time.monotonic()
    records: list[RequestRecord] = []
    generated_slots = 0
    with torch.inference_mode():
        for batch in static_batches(len(prompts), batch_size):
            ids = [prompts[i] for i in batch]
            lens = [len(p) for p in ids]
            width = max(lens)
            input_ids = torch.full((len(ids), width), pad_token_id, dtype=torch.long)  # [B, L], left-padded
            attention_mask = torch.zeros((len(ids), width), dtype=torch.long)
            for row, p in enumerate(ids):
                input_ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
                attention_mask[row, width - len(p):] = 1
            own = [max_tokens[i] for i in batch]
            new = max(own)
            timer = _StepTimes()
            out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=new,
                                 min_new_tokens=new, do_sample=False, pad_token_id=pad_token_id,
                                 streamer=timer)
            if out.shape[1] - width != new:
                raise RuntimeError(f"transformers made {out.shape[1] - width} tokens per row, asked for {new}")
            generated_slots += len(ids) * new
            records.extend(records_from_batch(t0, timer.times, lens, own))
    duration = time.monotonic() - t0
    result = summarize(records, duration)
    useful = sum(max_tokens)
    result.update(batch_size=batch_size, num_generated_slots=generated_slots,
                  useful_output_fraction=useful / generated_slots if generated_slots else None,
                  kv_utilization=None, num_preemptions=0, prefix_cache_hit_rate=None)
    return result


def _torch_dtype(name: str):
    import torch
    table = {"float32": torch.float32, "float": torch.float32, "auto": torch.float32,
             "bfloat16": torch.bfloat16, "float16": torch.float16, "half": torch.float16}
    if name not in table:
        raise ValueError(f"dtype {name!r} is not supported by the HF baseline; use one of {sorted(table)}")
    return table[name]


def _child_main(argv: list[str] | None = None) -> int:
    """Entry point of the baseline process (see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m pagedllm.benchmarks.hf_baseline")
    parser.add_argument("--model-folder", required=True, help="HF folder (config.json + safetensors + tokenizer)")
    parser.add_argument("--requests", required=True, help='JSONL of {"prompt_token_ids": [...], "max_tokens": N}')
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--output", required=True, help="where to write the result JSON")
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s hf_baseline: %(message)s",
                        stream=sys.stderr)
    import torch
    from transformers import AutoModelForCausalLM

    with open(ns.requests, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    prompts = [r["prompt_token_ids"] for r in rows]
    max_tokens = [int(r["max_tokens"]) for r in rows]
    t = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(ns.model_folder, dtype=_torch_dtype(ns.dtype)).eval()
    load_s = time.perf_counter() - t
    pad = model.config.pad_token_id if getattr(model.config, "pad_token_id", None) is not None else 0
    logger.info("loaded %s (%s) in %.2f s; %d requests, batch size %d, %d torch threads", ns.model_folder,
                ns.dtype, load_s, len(rows), ns.batch_size, torch.get_num_threads())
    with torch.inference_mode():  # warm-up: one tiny batch, untimed
        x = torch.tensor([prompts[0][:16]])
        model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=WARMUP_NEW_TOKENS,
                       min_new_tokens=WARMUP_NEW_TOKENS, do_sample=False, pad_token_id=pad)
    result = run_static_batches(model, prompts, max_tokens, ns.batch_size, pad)
    result.update(load_time_s=load_s, dtype=ns.dtype, num_threads=torch.get_num_threads())
    logger.info("batch size %d: %.2f requests/s, %.1f output tokens/s", ns.batch_size, result["requests_per_s"],
                result["output_tokens_per_s"])
    with open(ns.output, "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


def run_hf_baseline(model_folder: str, prompts: list[list[int]], max_tokens: list[int], batch_sizes: list[int],
                    dtype: str, timeout_s: float | None = None) -> dict:
    """Run the static-batch baseline in a fresh process per batch size; the best one is compared.

    Args:
        model_folder: HF folder transformers can read (for the default model, the converted
            cache folder ``resolve_model(None).folder``).
        prompts: token ids per request (as the engine tokenized them).
        max_tokens: output tokens per request.
        batch_sizes: static batch sizes to try.
        dtype: "float32" | "bfloat16" | "float16".
        timeout_s: per process; None = no limit.
    Returns:
        The best run's result (highest output tokens/s) with ``runs``: every run's result.
    Raises:
        ValueError: for an empty ``batch_sizes`` or a size < 1.
        RuntimeError: if a baseline process fails (its exit code; its log went to stderr).
    """
    if not batch_sizes or any(b < 1 for b in batch_sizes):
        raise ValueError(f"baseline batch sizes must be >= 1, got {batch_sizes}")
    _torch_dtype(dtype)
    runs = []
    with tempfile.TemporaryDirectory(prefix="pagedllm_hf_") as tmp:
        req_path = os.path.join(tmp, "requests.jsonl")
        with open(req_path, "w", encoding="utf-8") as f:
            for p, n in zip(prompts, max_tokens):
                f.write(json.dumps({"prompt_token_ids": p, "max_tokens": n}) + "\n")
        env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false",
               "HF_HUB_OFFLINE": "1"}
        for bs in batch_sizes:
            out_path = os.path.join(tmp, f"result_{bs}.json")
            cmd = [sys.executable, "-m", "pagedllm.benchmarks.hf_baseline", "--model-folder", model_folder,
                   "--requests", req_path, "--batch-size", str(bs), "--dtype", dtype, "--output", out_path]
            logger.info("HF baseline, batch size %d: %s", bs, " ".join(cmd))
            proc = subprocess.run(cmd, env=env, timeout=timeout_s)
            if proc.returncode != 0:
                raise RuntimeError(f"HF baseline process (batch size {bs}) exited with code {proc.returncode}")
            with open(out_path, encoding="utf-8") as f:
                runs.append(json.load(f))
    best = max(runs, key=lambda r: r["output_tokens_per_s"])
    return {**best, "runs": runs}


if __name__ == "__main__":
    sys.exit(_child_main())
