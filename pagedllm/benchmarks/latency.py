"""Latency of one fixed batch (vLLM's ``benchmark_latency``) and a matmul ceiling for its decode.

``batch_size`` random prompts of ``input_len`` tokens each make ``output_len`` tokens (greedy,
``ignore_eos``), all submitted at once, ``num_iters`` times after ``num_iters_warmup`` untimed
runs. Reported: end-to-end batch latency (mean / percentiles over iterations), and, from the
engine's per-step times, the prefill phase and the decode steps (steps whose batch is all
single-token decodes of the full batch); the model's weight bytes and its active weight bytes per
token (a mixture of experts reads top-k of each MoE layer's experts: ``layers.fused_moe.parameter_bytes``).

The ceiling: a decode step of M = ``batch_size`` tokens does, per linear layer of shape
[out, in], 2·M·in·out FLOPs, plus the LM head (2·M·hidden·vocab). Each distinct shape's rate is
measured here through the layer the engine runs (``F.linear``, or oneDNN's packed layout on the
CPU in float32: layers/linear.py) at M rows in the model dtype; the
ceiling step time is Σ FLOPs / rate over the layers, and the ceiling is M / that tokens/s.
Attention, norms, RoPE, sampling and scheduling are left out of the ceiling but are in the
measured time, so measured / ceiling says how much of a step the linear layers take.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass

from pagedllm.benchmarks.datasets import MIN_RANDOM_TOKEN_ID
from pagedllm.benchmarks.metrics import mean, percentile, spec_decode_summary
from pagedllm.benchmarks.throughput import BenchStatLogger

logger = logging.getLogger(__name__)

MIN_MEASURE_S = 0.3  # time each matmul shape at least this long
MIN_MEASURE_REPS = 5


@dataclass(frozen=True)
class LinearShape:
    """A linear layer shape: y[M, out] = x[M, in] @ W[out, in]^T, ``count`` of them per step."""

    in_features: int
    out_features: int
    count: int

    def flops(self, m: int) -> int:
        """FLOPs of all ``count`` layers for ``m`` rows (a multiply-add = 2)."""
        return 2 * m * self.in_features * self.out_features * self.count


def model_linear_layers(model) -> list[tuple[object, int, int, int]]:
    """(layer, in_features, out_features, count) per distinct shape of the model's linear layers
    and LM head, each ``layer`` being a callable [M, in] -> [M, out] that runs the kernel the
    engine runs (``nn.Linear``, oneDNN's ``PackedLinear`` or ``Int8DynamicLinear``; for the head,
    ``lm_head_logits``).
    """
    from functools import partial

    from torch import nn

    from pagedllm.layers.linear import KernelLinear, lm_head_logits

    by_shape: dict[tuple[int, int], object] = {}
    counts: Counter[tuple[int, int]] = Counter()
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, KernelLinear)) and name not in ("lm_head", "packed_lm_head"):
            key = (module.in_features, module.out_features)
            by_shape.setdefault(key, module)
            counts[key] += 1
    embed = model.get_input_embeddings()
    key = (embed.embedding_dim, embed.num_embeddings)
    by_shape[key] = partial(lm_head_logits, model)
    counts[key] += 1
    return [(by_shape[k], k[0], k[1], counts[k]) for k in by_shape]


def measure_linear_gflops(layer, in_features: int, out_features: int, m: int, dtype, device,
                          min_seconds: float = MIN_MEASURE_S) -> float:
    """GFLOP/s of ``layer(x[m, in_features])`` (2·m·in·out FLOPs per call)."""
    import torch

    x = torch.randn(m, in_features, dtype=dtype, device=device)
    flops = 2 * m * in_features * out_features
    with torch.inference_mode():
        seconds = seconds_per_call(lambda: layer(x), min_seconds)
    return flops / seconds / 1e9


def seconds_per_call(fn, min_seconds: float = MIN_MEASURE_S, min_reps: int = MIN_MEASURE_REPS,
                     warmup: int = 2) -> float:
    """Mean wall seconds of ``fn()`` over at least ``min_reps`` calls and ``min_seconds``, after
    ``warmup`` untimed calls."""
    for _ in range(warmup):
        fn()
    reps, t0 = 0, time.perf_counter()
    while True:
        fn()
        reps += 1
        elapsed = time.perf_counter() - t0
        if reps >= min_reps and elapsed >= min_seconds:
            return elapsed / reps


def linear_ceiling(model, m: int, min_seconds: float = MIN_MEASURE_S) -> dict:
    """Tokens/s that the linear layers + LM head allow for a decode step of ``m`` tokens.

    Returns:
        ``ceiling_tokens_per_s``, ``ceiling_step_time_s``, ``linear_gflops_per_step`` and
        ``shapes``: per shape ``[out, in]``, count, measured GFLOP/s and its time share.
    """
    shapes = []
    total_time = 0.0
    total_flops = 0
    embed = model.get_input_embeddings().weight
    for layer, in_features, out_features, count in model_linear_layers(model):
        rate = measure_linear_gflops(layer, in_features, out_features, m, embed.dtype, embed.device, min_seconds)
        shape = LinearShape(in_features, out_features, count)
        flops = shape.flops(m)
        seconds = flops / (rate * 1e9)
        total_time += seconds
        total_flops += flops
        shapes.append({"out_in": [shape.out_features, shape.in_features], "count": count,
                       "gflops_per_s": rate, "seconds_per_step": seconds})
    for s in shapes:
        s["time_share"] = s["seconds_per_step"] / total_time
    return {"ceiling_tokens_per_s": m / total_time, "ceiling_step_time_s": total_time,
            "linear_gflops_per_step": total_flops / 1e9, "shapes": shapes}


def run_latency(llm, batch_size: int, input_len: int, output_len: int, num_iters: int = 3,
                num_iters_warmup: int = 1, seed: int = 0, ceiling: bool = True,
                breakdown: bool = False, dataset: str = "random") -> dict:
    """Time one batch end to end and per step; see the module docstring.

    With ``breakdown``, the timed iterations also run under ``StepBreakdown`` (result key
    ``breakdown``: seconds per component over all timed iterations; ``breakdown_ms_per_step``:
    the same per engine step, and ``overhead_ms_per_step``: everything but the linear layers and
    the LM head, per step). The hooks cost a few microseconds per call, so take the latency
    itself from a run without ``breakdown``.

    ``dataset``: "random" (random token ids) or a JSONL dataset ("grounded", "workload" or a
    path, ``datasets.dataset_file``): its first ``batch_size`` prompts, tokenized and cut to
    their last ``input_len`` tokens (prompts worth speculating on; result keys ``spec_*`` and
    ``output_tokens_per_s`` report what speculative decoding did).

    Raises:
        ValueError: for sizes < 1, or a batch larger than ``max_num_seqs`` (it would not be one batch).
    """
    import numpy as np

    from pagedllm.sampling_params import SamplingParams

    for name, v in (("batch_size", batch_size), ("input_len", input_len), ("output_len", output_len),
                    ("num_iters", num_iters)):
        if v < 1:
            raise ValueError(f"{name} must be >= 1, got {v}")
    engine = llm.llm_engine
    if batch_size > engine.scheduler_config.max_num_seqs:
        raise ValueError(f"batch_size={batch_size} exceeds max_num_seqs={engine.scheduler_config.max_num_seqs}")
    rng = np.random.default_rng(seed)
    if dataset == "random":
        prompts = [{"prompt_token_ids": rng.integers(MIN_RANDOM_TOKEN_ID, engine.vocab_size, size=input_len).tolist()}
                   for _ in range(batch_size)]
    else:
        from pagedllm.benchmarks.datasets import dataset_file, load_jsonl_requests

        rows = load_jsonl_requests(dataset_file(dataset), batch_size)
        prompts = [{"prompt_token_ids": (r.prompt if isinstance(r.prompt, list)
                                         else engine.tokenizer.encode(r.prompt))[-input_len:]} for r in rows]
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    for _ in range(num_iters_warmup):
        llm.generate(prompts, params, use_tqdm=False)
    spec_before = None if engine.spec_decoder is None else engine.spec_decoder.stats.copy()
    num_decoding_steps = 0
    latencies, decode_steps, prefill_phase = [], [], []
    num_steps = 0
    timer = None
    if breakdown:
        from pagedllm.benchmarks.breakdown import StepBreakdown
        timer = StepBreakdown(engine).__enter__()
    for _ in range(num_iters):
        stat_logger = BenchStatLogger()
        engine.stat_loggers.append(stat_logger)
        try:
            t0 = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            latencies.append(time.perf_counter() - t0)
        finally:
            engine.stat_loggers.remove(stat_logger)
        num_steps += len(stat_logger.steps)
        full = [s.step_time for s in stat_logger.steps
                if s.num_prefill_tokens == 0 and s.num_decode_tokens >= batch_size]
        num_decoding_steps += sum(1 for s in stat_logger.steps if s.num_decode_tokens)
        decode_steps.extend(full)
        # Steps up to the last one with prompt tokens (mixed prefill + early decodes).
        last_prefill = max((i for i, s in enumerate(stat_logger.steps) if s.num_prefill_tokens), default=-1)
        prefill_phase.append(sum(s.step_time for s in stat_logger.steps[:last_prefill + 1]))
    if timer is not None:
        timer.__exit__(None, None, None)
        timer.wall_s = sum(latencies)
    step = mean(decode_steps)
    spec = spec_decode_summary(spec_before, None if engine.spec_decoder is None else engine.spec_decoder.stats,
                               batch_size * output_len * num_iters, num_decoding_steps)
    # a speculative step emits tokens_per_target_forward tokens per request, not one
    per_step = spec["tokens_per_target_forward"] if spec.get("spec_draft_tokens") is not None else 1
    result = {
        "batch_size": batch_size, "input_len": input_len, "output_len": output_len, "num_iters": num_iters,
        "mean_latency_s": mean(latencies), "p50_latency_s": percentile(latencies, 50),
        "p90_latency_s": percentile(latencies, 90), "p99_latency_s": percentile(latencies, 99),
        "mean_prefill_phase_s": mean(prefill_phase),
        "num_decode_steps": len(decode_steps), "mean_decode_step_s": step,
        "p50_decode_step_s": percentile(decode_steps, 50), "p90_decode_step_s": percentile(decode_steps, 90),
        "decode_tokens_per_s": batch_size * per_step / step if step else None,
        "output_tokens_per_s": batch_size * output_len / mean(latencies),
        "dataset": dataset,
        **spec,
        "dtype": str(engine.executor.model_dtype or engine.model_config.dtype).replace("torch.", ""),
        "quantization": engine.model_config.quantization,
    }
    worker = engine.executor.local_worker   # in-process executors only
    if worker is not None:
        from pagedllm.layers.fused_moe import parameter_bytes

        result["weight_bytes"], result["active_weight_bytes_per_token"] = parameter_bytes(worker.model)
    if timer is not None:
        bd = timer.as_dict()
        per_step = {k: v / max(num_steps, 1) * 1000 for k, v in bd.items() if k != "wall_s"}
        result["breakdown"] = bd
        result["num_steps"] = num_steps
        result["breakdown_ms_per_step"] = per_step
        result["overhead_ms_per_step"] = sum(v for k, v in per_step.items() if k not in ("linear layers", "LM head"))
    if ceiling:
        c = linear_ceiling(engine.executor.local_worker.model, batch_size)
        result.update(c)
        # the ceiling is for one row per request per step; a speculative step scores k + 1
        result["measured_over_ceiling"] = (result["decode_tokens_per_s"] / c["ceiling_tokens_per_s"]
                                           if result["decode_tokens_per_s"] and result.get("spec_draft_tokens") is None
                                           else None)
    return result


def format_latency(result: dict) -> str:
    """Human-readable summary (ms)."""
    ms = lambda v: "n/a" if v is None else f"{v * 1000:.1f} ms"  # noqa: E731
    lines = [f"==== Latency: batch {result['batch_size']} x ({result['input_len']} in, {result['output_len']} out), "
             f"{result['dtype']}{'' if not result.get('quantization') else ', ' + result['quantization']}, "
             f"{result['num_iters']} iterations ====",
             f"end-to-end     mean {ms(result['mean_latency_s'])}  p50 {ms(result['p50_latency_s'])}  "
             f"p90 {ms(result['p90_latency_s'])}  p99 {ms(result['p99_latency_s'])}",
             f"prefill phase  mean {ms(result['mean_prefill_phase_s'])}",
             f"decode step    mean {ms(result['mean_decode_step_s'])}  p50 {ms(result['p50_decode_step_s'])}  "
             f"p90 {ms(result['p90_decode_step_s'])}  ({result['num_decode_steps']} full-batch decode steps)"]
    if "breakdown_ms_per_step" in result:
        lines.append(f"---- per engine step ({result['num_steps']} steps, all iterations; exclusive) ----")
        for name, v in result["breakdown_ms_per_step"].items():
            lines.append(f"  {name:26s} {v:8.2f} ms")
        lines.append(f"  {'overhead (not linear/head)':26s} {result['overhead_ms_per_step']:8.2f} ms")
    if "weight_bytes" in result:
        lines.append(f"weights        {result['weight_bytes'] / 2**20:.1f} MiB, active per token "
                     f"{result['active_weight_bytes_per_token'] / 2**20:.1f} MiB (experts: top-k of each MoE layer)")
    tps = result.get("decode_tokens_per_s")
    spec = result.get("spec_draft_tokens") is not None
    per = "per full-batch step x tokens per target forward" if spec else "per full-batch step"
    lines.append(f"decode         {'n/a' if tps is None else f'{tps:.1f}'} tokens/s "
                 f"({per}; end to end {result['output_tokens_per_s']:.1f} output tokens/s)")
    if result.get("spec_draft_tokens") is not None:
        rate, length = result["spec_acceptance_rate"], result["spec_mean_acceptance_length"]
        lines.append(f"speculative    acceptance rate {'n/a' if rate is None else f'{rate:.1%}'}, "
                     f"mean acceptance length {'n/a' if length is None else f'{length:.2f}'}, "
                     f"{result['tokens_per_target_forward']:.2f} tokens per target forward "
                     f"({result['spec_draft_tokens']} draft tokens)")
    if "ceiling_tokens_per_s" in result:
        lines.append(f"ceiling        {result['ceiling_tokens_per_s']:.1f} tokens/s "
                     f"(linear layers + LM head: {result['linear_gflops_per_step']:.2f} GFLOP/step in "
                     f"{ms(result['ceiling_step_time_s'])} at measured matmul rates)")
        ratio = result.get("measured_over_ceiling")
        why = " (speculative: a step scores k + 1 rows per request; the ceiling is for one)" if spec else ""
        lines.append(f"measured / ceiling  {'n/a' if ratio is None else f'{ratio:.2f}'}{why}")
        for s in result["shapes"]:
            lines.append(f"  linear [{s['out_in'][0]} x {s['out_in'][1]}] x{s['count']:<3} "
                         f"{s['gflops_per_s']:8.1f} GFLOP/s  {ms(s['seconds_per_step'])}/step "
                         f"({s['time_share'] * 100:.0f}%)")
    return "\n".join(lines)
