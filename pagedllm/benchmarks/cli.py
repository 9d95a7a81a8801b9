"""``pagedllm bench {throughput,serving,latency,memory,kernels,accuracy}``: argument parsing and report printing.

Each command prints a table to stdout and, with ``--output-json FILE``, writes its numbers as
JSON (flat keys; a baseline's under ``baseline`` and ours / baseline under ``ratio``).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import math

from pagedllm.config import DEFAULT_MAX_NUM_BATCHED_TOKENS

logger = logging.getLogger(__name__)

# The project's 64-request workload, shipped as package data (``--dataset workload``).
DEFAULT_WORKLOAD = "workload"
THROUGHPUT_TABLE_KEYS = ("num_requests", "num_prompt_tokens", "num_output_tokens", "duration_s", "requests_per_s",
                         "output_tokens_per_s", "total_tokens_per_s", "mean_ttft_s", "p50_ttft_s", "p99_ttft_s",
                         "mean_tpot_s", "p50_tpot_s", "p99_tpot_s", "peak_kv_usage", "kv_utilization",
                         "num_preemptions", "prefix_cache_hit_rate", "prefill_tokens_saved", "n",
                         "peak_blocks_used", "spec_acceptance_rate", "spec_mean_acceptance_length",
                         "tokens_per_target_forward")
SERVING_TABLE_KEYS = THROUGHPUT_TABLE_KEYS[:13] + ("mean_itl_s", "p50_itl_s", "p90_itl_s", "p99_itl_s",
                                                   "num_failed", "prefix_cache_hit_rate")


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from e
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected comma-separated ints >= 1, got {text!r}")
    return values


def _str_list(text: str) -> list[str]:
    values = [x.strip() for x in text.split(",") if x.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return values


def _add_dataset_args(p: argparse.ArgumentParser, default_dataset: str) -> None:
    g = p.add_argument_group("workload")
    g.add_argument("--dataset", default=default_dataset,
                   help="'random', 'sharegpt-like', 'workload' (the project's 64-request workload, shipped "
                        "in the package), 'prefix-sharing' (64 requests: a shared 1000-token prefix "
                        "+ a 50-300-token question, 64-128 output tokens), 'multi-turn' (users sending 4 turns, "
                        "each prompt the whole conversation) or a JSONL file of {prompt, max_tokens}")
    g.add_argument("--num-prompts", type=int, default=None,
                   help="requests (default: all rows of a file, 64 generated ones)")
    g.add_argument("--input-len", type=int, default=128,
                   help="prompt tokens: mean (random) or median (sharegpt-like)")
    g.add_argument("--output-len", type=int, default=64,
                   help="output tokens: mean (random) or median (sharegpt-like)")
    g.add_argument("--range-ratio", type=float, default=0.5,
                   help="random: lengths uniform in len*(1-r)..len*(1+r)")
    g.add_argument("--dataset-seed", type=int, default=0, help="seed of the generated / resampled workload")
    g.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def format_breakdown(breakdown: dict[str, float]) -> str:
    """The ``StepBreakdown`` seconds as a table with each component's share of the wall time."""
    wall = breakdown.get("wall_s") or 1.0
    lines = ["---- where the time went (exclusive wall time per component) ----"]
    for name, seconds in breakdown.items():
        if name != "wall_s":
            lines.append(f"{name:28s} {seconds:9.2f} s {100 * seconds / wall:6.1f}%")
    lines.append(f"{'total (generate)':28s} {wall:9.2f} s")
    return "\n".join(lines)


def _write_json(path: str | None, obj: dict) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(obj, f, indent=2)
        logger.info("wrote %s", path)


# -- throughput ----------------------------------------------------------------------------------

def _cmd_throughput(ns) -> int:
    from pagedllm.benchmarks.breakdown import format_rank_times
    from pagedllm.benchmarks.datasets import build_requests, check_dataset
    from pagedllm.benchmarks.metrics import RESULT_KEYS, format_table, ratios
    from pagedllm.benchmarks.throughput import run_throughput
    from pagedllm.engine.arg_utils import engine_args_from_cli
    from pagedllm.entrypoints.llm import LLM
    from pagedllm.worker.kernel_plan import choose_dtype
    from pagedllm.worker.worker import resolve_device

    if ns.baseline == "openai" and not ns.base_url:
        raise ValueError("--baseline openai needs --base-url")
    if ns.baseline == "vllm" and not ns.baseline_python:
        raise ValueError("--baseline vllm needs --baseline-python (a vLLM CPU venv's python; "
                         "benchmarks/setup_vllm_cpu.sh builds one)")
    if ns.n < 1:
        raise ValueError(f"--n must be >= 1, got {ns.n}")
    if ns.baseline and ns.n > 1:
        raise ValueError("--baseline runs one sample per prompt: it cannot be combined with --n > 1")
    check_dataset(ns.dataset, ns.num_prompts)  # before minutes of model loading
    args = engine_args_from_cli(ns)
    llm = LLM(**vars(args))
    engine = llm.llm_engine
    requests = build_requests(ns.dataset, ns.num_prompts, ns.input_len, ns.output_len, ns.range_ratio,
                              ns.dataset_seed, engine.vocab_size, engine.max_model_len)
    dtype = str(choose_dtype(engine.model_config.dtype, engine.model_config,
                             resolve_device(engine.model_config.device), engine.kernel_config.cpu_isa)[0]
                ).replace("torch.", "")
    logger.info("throughput: %d requests (%d output tokens) from %s, dtype %s", len(requests),
                sum(r.max_tokens for r in requests), ns.dataset, dtype)
    if ns.structured_output:
        return _structured_throughput(ns, llm, requests, dtype)
    loras = None
    if getattr(ns, "lora_modules", None):   # [LoRA] request i on adapter i % N
        from pagedllm.entrypoints.openai.serving_lora import parse_lora_modules
        from pagedllm.lora.request import LoRARequest

        if not args.enable_lora:
            raise ValueError("--lora-modules needs --enable-lora")
        modules = [LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(parse_lora_modules(ns.lora_modules))]
        loras = [modules[i % len(modules)] for i in range(len(requests))]
    lora_note = f", request i on LoRA adapter i % {len(modules)}" if loras else ""
    result, prompt_ids = run_throughput(llm, requests, warmup=not ns.no_warmup, breakdown=ns.breakdown,
                                        progress=not ns.no_progress, n=ns.n, separate=ns.n_separate,
                                        lora_requests=loras)
    result.update(model=engine.model_files.source, dtype=dtype, block_size=engine.cache_config.block_size,
                  num_blocks=engine.num_blocks, max_num_seqs=engine.scheduler_config.max_num_seqs,
                  max_num_batched_tokens=engine.scheduler_config.max_num_batched_tokens,
                  dataset=ns.dataset, engine_load_time_s=engine.load_time_s, n_separate=ns.n_separate,
                  lora_adapters=[m.lora_name for m in modules] if loras else None)
    model_folder = engine.model_files.folder
    sched = engine.scheduler_config
    driver = engine.executor.local_worker  # in-process; else vLLM gets our default budget
    kv_bytes = engine.num_blocks * driver.kv_shape.bytes_per_block if driver is not None else 4 << 30
    del llm, engine
    gc.collect()
    if ns.baseline:  # ours first, so a baseline that fails or is killed loses nothing
        print(format_table(f"pagedllm throughput ({dtype}, {ns.dataset}{lora_note})", result, THROUGHPUT_TABLE_KEYS),
              flush=True)
        _write_json(ns.output_json, result)

    baseline, baseline_name = None, None
    if ns.baseline == "hf":
        from pagedllm.benchmarks.hf_baseline import run_hf_baseline
        baseline = run_hf_baseline(model_folder, prompt_ids, [r.max_tokens for r in requests],
                                   ns.baseline_batch_size, dtype, timeout_s=ns.baseline_timeout)
        baseline_name = f"HF static b={baseline['batch_size']}"
    elif ns.baseline == "vllm":
        from pagedllm.benchmarks.vllm_baseline import run_vllm_baseline
        baseline = run_vllm_baseline(ns.baseline_python, model_folder, prompt_ids, [r.max_tokens for r in requests],
                                     dtype, sched.max_num_seqs, sched.max_num_batched_tokens, sched.max_model_len,
                                     kv_bytes, timeout_s=ns.baseline_timeout,
                                     lora_modules=[(m.lora_name, m.lora_path) for m in modules] if loras else None,
                                     max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)
        baseline_name = f"vLLM {baseline['vllm_version']} CPU" + (f", {len(modules)} LoRA adapters" if loras else "")
    elif ns.baseline == "openai":
        from pagedllm.benchmarks.metrics import summarize
        from pagedllm.benchmarks.serving import run_serving
        logging.getLogger("httpx").setLevel(logging.WARNING)
        records, duration, model = run_serving(ns.base_url, ns.baseline_model, requests)
        baseline = summarize(records, duration)
        baseline.update(model=model, base_url=ns.base_url, kv_utilization=None, num_preemptions=None,
                        prefix_cache_hit_rate=None)
        baseline_name = "openai server"

    print(format_table(f"pagedllm throughput ({dtype}, {ns.dataset}{lora_note})", result, THROUGHPUT_TABLE_KEYS,
                       baseline, baseline_name or "baseline"))
    if "breakdown" in result:
        print(format_breakdown(result["breakdown"]))
    if "rank_breakdown" in result:
        print(format_rank_times(result["rank_breakdown"], result["duration_s"]))
    if baseline is not None and "runs" in baseline:
        for run in baseline["runs"]:
            print(f"  HF batch size {run['batch_size']}: {run['requests_per_s']:.3f} requests/s, "
                  f"{run['output_tokens_per_s']:.1f} output tokens/s, useful output fraction "
                  f"{run['useful_output_fraction']:.3f}")
    out = dict(result)
    if baseline is not None:
        out["baseline"] = baseline
        out["ratio"] = ratios(result, baseline, RESULT_KEYS)
    _write_json(ns.output_json, out)
    return 0


def _structured_throughput(ns, llm, requests, dtype: str) -> int:
    """``--structured-output json``: compile the 8 schemas (timed), then the workload with
    constraints, then without them at the same lengths (request ``i`` unconstrained, with
    ``ignore_eos``, makes exactly as many tokens as its constrained reply did), then with
    constraints again; one table (the second constrained run = pagedllm column, unconstrained =
    baseline column) and the ratio over both constrained runs.

    Like with like: a constrained reply ends where its grammar does, usually well before
    ``max_tokens``, so an unconstrained run to ``max_tokens`` would make more tokens and keep its
    batch full longer (more rows per step, more tokens/s). At the same lengths both runs schedule
    the same batches step for step, and the ratio is the grammar's cost alone. The order
    constrained, unconstrained, constrained puts the first timed run's one-off costs (first
    batches of these shapes) on a constrained run, and the mean of the two constrained runs
    cancels a load that rises or falls steadily during the three (a shared machine)."""
    from dataclasses import replace

    from pagedllm.benchmarks.metrics import format_table, ratios
    from pagedllm.benchmarks.structured import compile_schemas, schema_for
    from pagedllm.benchmarks.throughput import run_throughput
    from pagedllm.sampling_params import StructuredOutputsParams

    if ns.baseline:
        raise ValueError("--structured-output compares runs with and without constraints; drop --baseline")
    engine = llm.llm_engine
    compiles = compile_schemas(engine)
    logger.info("structured output: %d schemas compiled, mean %.3f s, p99 %.3f s (tokenizer info %.2f s)",
                compiles["num_schemas"], compiles["compile_mean_s"], compiles["compile_p99_s"],
                compiles["tokenizer_info_s"])
    constraints = [StructuredOutputsParams(json=schema_for(i)) for i in range(len(requests))]
    constrained, _ = run_throughput(llm, requests, warmup=not ns.no_warmup, breakdown=ns.breakdown,
                                    progress=not ns.no_progress, structured_outputs=constraints)
    same_lengths = [replace(r, max_tokens=n) for r, n in zip(requests, constrained["output_lens"])]
    plain, _ = run_throughput(llm, same_lengths, warmup=False, breakdown=ns.breakdown,
                              progress=not ns.no_progress)
    first = constrained
    constrained, _ = run_throughput(llm, requests, warmup=False, breakdown=ns.breakdown,
                                    progress=not ns.no_progress, structured_outputs=constraints)
    if constrained["output_lens"] != first["output_lens"]:
        logger.warning("the two greedy constrained runs made different lengths (%d vs %d tokens)",
                       constrained["num_output_tokens"], first["num_output_tokens"])
    both_tokens_per_s = (first["num_output_tokens"] + constrained["num_output_tokens"]) \
        / (first["duration_s"] + constrained["duration_s"])
    info = dict(model=engine.model_files.source, dtype=dtype, max_num_seqs=engine.scheduler_config.max_num_seqs,
                dataset=ns.dataset, structured_output=ns.structured_output, **compiles)
    keys = ("num_requests", "num_output_tokens", "duration_s", "output_tokens_per_s", "mean_tpot_s", "p99_tpot_s",
            "num_steps")
    print(format_table(f"pagedllm throughput with {ns.structured_output} constraints ({dtype}, {ns.dataset}, "
                       f"max_num_seqs {info['max_num_seqs']}; unconstrained run at the same output lengths)",
                       constrained, keys, plain, "unconstrained"))
    print(f"constrained output tokens/s, first run {first['output_tokens_per_s']:.2f}, second "
          f"{constrained['output_tokens_per_s']:.2f}; both runs together "
          f"{both_tokens_per_s:.2f} = {both_tokens_per_s / plain['output_tokens_per_s']:.3f}x unconstrained")
    print(f"grammar compile per distinct schema ({compiles['num_schemas']} schemas): mean "
          f"{compiles['compile_mean_s']:.3f} s, p99 {compiles['compile_p99_s']:.3f} s, max "
          f"{compiles['compile_max_s']:.3f} s; tokenizer info (once) {compiles['tokenizer_info_s']:.2f} s")
    for name, result in (("constrained, second run", constrained), ("unconstrained", plain)):
        if "breakdown" in result:
            print(f"[{name}]")
            print(format_breakdown(result["breakdown"]))
    _write_json(ns.output_json, {**info, "constrained": constrained, "constrained_first_run": first,
                                 "unconstrained": plain, "ratio": ratios(constrained, plain, keys),
                                 "ratio_both_constrained_runs": both_tokens_per_s / plain["output_tokens_per_s"]})
    return 0


# -- serving -------------------------------------------------------------------------------------

def _serving_requests(ns):
    from pagedllm.benchmarks.datasets import DATASET_CHOICES, BenchRequest, build_requests, check_dataset

    check_dataset(ns.dataset, ns.num_prompts)
    tok = None
    if ns.dataset in DATASET_CHOICES:
        from pagedllm.loaders import resolve_model
        from pagedllm.tokenizer import Tokenizer
        tok = Tokenizer.from_pretrained(ns.tokenizer or resolve_model(None).folder)
    requests = build_requests(ns.dataset, ns.num_prompts, ns.input_len, ns.output_len, ns.range_ratio,
                              ns.dataset_seed, None if tok is None else len(tok))
    if tok is not None:  # every OpenAI server takes text; token-id prompts are an extension
        requests = [BenchRequest(tok.decode(r.prompt, skip_special_tokens=False), r.prompt_len, r.max_tokens,
                                 r.conversation_id) for r in requests]
    return requests


def _cmd_serving(ns) -> int:
    from pagedllm.benchmarks.metrics import format_table, parse_goodput, summarize
    from pagedllm.benchmarks.serving import prefix_cache_hit_rate, run_serving

    slos = parse_goodput(ns.goodput)
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request
    requests = _serving_requests(ns)
    records, duration, model = run_serving(ns.base_url, ns.model, requests, request_rate=ns.request_rate,
                                           max_concurrency=ns.max_concurrency, burstiness=ns.burstiness,
                                           seed=ns.dataset_seed, ignore_eos=not ns.no_ignore_eos,
                                           progress=not ns.no_progress, lora_names=ns.lora_modules)
    result = summarize(records, duration, itl=True, goodput_slos=slos)
    result.update(model=model, base_url=ns.base_url, request_rate=ns.request_rate, burstiness=ns.burstiness,
                  max_concurrency=ns.max_concurrency, dataset=ns.dataset,
                  prefix_cache_hit_rate=prefix_cache_hit_rate(records))
    keys = SERVING_TABLE_KEYS + (("goodput_requests_per_s",) if slos else ())
    rate = "inf" if math.isinf(ns.request_rate) else f"{ns.request_rate:g}/s"
    print(format_table(f"serving {model} at {ns.base_url}, rate {rate}", result, keys))
    _write_json(ns.output_json, result)
    return 0


# -- latency -------------------------------------------------------------------------------------

def _cmd_latency(ns) -> int:
    from pagedllm.benchmarks.latency import format_latency, run_latency
    from pagedllm.engine.arg_utils import engine_args_from_cli
    from pagedllm.entrypoints.llm import LLM

    args = engine_args_from_cli(ns)
    if args.max_num_batched_tokens is None:
        # The whole batch's prompts in one step, so that every later step decodes the full batch
        # (with a smaller budget, chunked prefill overlaps the first requests' decodes with the
        # last prompts, and no step is a full-batch decode when output_len is short).
        args.max_num_batched_tokens = max(ns.batch_size * ns.input_len, ns.batch_size)
        logger.info("latency: max_num_batched_tokens=%d (batch_size x input_len)", args.max_num_batched_tokens)
    if args.max_num_seqs is None or args.max_num_seqs < ns.batch_size:
        args.max_num_seqs = ns.batch_size
    llm = LLM(**vars(args))
    result = run_latency(llm, ns.batch_size, ns.input_len, ns.output_len, ns.num_iters, ns.num_iters_warmup,
                         seed=ns.dataset_seed, ceiling=not ns.no_ceiling, breakdown=ns.breakdown,
                         dataset=ns.dataset)
    print(format_latency(result))
    _write_json(ns.output_json, result)
    return 0


# -- memory --------------------------------------------------------------------------------------

def _layer_windows(spec: str | None) -> list[int | None] | None:
    """``--layer-windows``: comma-separated per-layer windows, ``full`` for full attention, ``X*N``
    for N layers of X (Gemma 3 270M: ``512*5,full,512*5,full,512*5,full``).

    Raises:
        ValueError: naming the flag, for an item that is not ``full`` or a positive int.
    """
    if not spec:
        return None
    out: list[int | None] = []
    for item in spec.split(","):
        kind, _, count = item.strip().partition("*")
        try:
            n = int(count) if count else 1
            window = None if kind == "full" else int(kind)
        except ValueError:
            raise ValueError(f"--layer-windows: {item!r} is not 'full', a window or 'X*N'") from None
        if n < 1 or (window is not None and window < 1):
            raise ValueError(f"--layer-windows: {item!r} needs a positive window and count")
        out.extend([window] * n)
    return out


def _cmd_memory(ns) -> int:
    from pagedllm.benchmarks.datasets import dataset_file, load_jsonl_requests, resample_lengths
    from pagedllm.benchmarks.memory import format_memory_table, simulate_kv_concurrency

    if ns.num_requests is not None:
        logger.warning("--num-requests is deprecated; use --num-prompts")
        ns.num_prompts = ns.num_requests
    path = dataset_file(ns.dataset)
    lengths = resample_lengths(load_jsonl_requests(path), ns.num_prompts, ns.dataset_seed)
    sizes = sorted(set(ns.block_sizes) | {ns.block_size})
    results = [simulate_kv_concurrency(lengths, block_size=bs, max_model_len=ns.max_model_len,
                                       static_concurrency=ns.static_concurrency, max_num_seqs=ns.max_num_seqs,
                                       max_num_batched_tokens=ns.max_num_batched_tokens,
                                       layer_windows=_layer_windows(ns.layer_windows)) for bs in sizes]
    head = next(r for r in results if r.block_size == ns.block_size)
    print(f"==== KV memory: {ns.num_prompts} requests resampled from {path} (seed {ns.dataset_seed}); "
          f"scheduler + KV cache manager, no model ====")
    print(f"KV budget {head.kv_budget_tokens} tokens = {ns.static_concurrency} x max_model_len {ns.max_model_len}: "
          f"a static allocator runs {head.static_concurrency} requests at once")
    if ns.layer_windows:
        print(f"KV cache: hybrid (--layer-windows {ns.layer_windows}): 'blocks' are pages of one layer group, "
              f"so the same bytes hold more of them; prompts shorter than the windows free nothing")
    else:
        print("KV cache: one block table per request over every layer (--layer-windows for the hybrid manager)")
    print(f"paged (block_size {head.block_size}): peak {head.peak_concurrency} concurrent "
          f"({head.peak_ratio:.1f}x), mean {head.mean_concurrency:.1f} while requests wait ({head.mean_ratio:.1f}x), "
          f"mean {head.mean_concurrency_all_steps:.1f} over all steps; KV utilization {head.kv_utilization:.3f}, "
          f"{head.num_preemptions} preemptions")
    print(format_memory_table(results))
    _write_json(ns.output_json, {"dataset": path, "num_requests": ns.num_prompts, "seed": ns.dataset_seed,
                                 "layer_windows": ns.layer_windows,
                                 "headline": head.to_dict(), "block_size_sweep": [r.to_dict() for r in results]})
    return 0


# -- kernels -------------------------------------------------------------------------------------

def _cmd_kernels(ns) -> int:
    from pagedllm.benchmarks.kernels import (BackendUnavailable, format_kernels, model_linear_shapes, run_kernels,
                                             stream_bandwidth, time_mlp_block)
    from pagedllm.loaders.model_files import load_config, resolve_model

    config = load_config(resolve_model(ns.model).folder)
    result = run_kernels(model_linear_shapes(config), ns.rows, ns.backends, min_seconds=ns.min_seconds)
    if not ns.no_stream:
        result.bandwidth = stream_bandwidth(min_seconds=ns.min_seconds)
    if ns.compile_mlp:
        text = config.get("text_config") or config
        try:
            result.mlp_block = time_mlp_block(int(text["hidden_size"]), int(text["intermediate_size"]), ns.rows,
                                              min_seconds=ns.min_seconds)
        except BackendUnavailable as exc:
            result.skipped["compile_mlp"] = str(exc)
    print(format_kernels(result))
    _write_json(ns.output_json, result.to_dict())
    return 0


# -- accuracy ------------------------------------------------------------------------------------

def _cmd_accuracy(ns) -> int:
    from pagedllm.benchmarks.accuracy import ACCURACY_TABLE_KEYS, compare_scores, score_prompts
    from pagedllm.benchmarks.datasets import build_requests, check_dataset
    from pagedllm.benchmarks.metrics import format_table
    from pagedllm.engine.arg_utils import engine_args_from_cli
    from pagedllm.entrypoints.llm import LLM

    check_dataset(ns.dataset, ns.num_prompts)
    candidate_args = engine_args_from_cli(ns)
    reference_args = dataclasses.replace(candidate_args, dtype="float32", quantization=None)
    label = f"dtype {candidate_args.dtype}, quantization {candidate_args.quantization}"
    import torch

    from pagedllm.loaders.model_files import load_config, resolve_model
    from pagedllm.worker.kernel_plan import choose_dtype
    from pagedllm.worker.worker import resolve_device

    candidate_dtype = choose_dtype(candidate_args.dtype, load_config(resolve_model(candidate_args.model).folder),
                                   resolve_device(candidate_args.device),
                                   candidate_args.cpu_isa)[0]   # the engine's own rule for "auto"
    if candidate_dtype == torch.float32 and candidate_args.quantization in (None, "gguf"):
        raise ValueError("the candidate settings are the float32 reference itself; pass --quantization "
                         "(int8, int8_weight_only, int4_weight_only) or --dtype bfloat16")
    scores, prompts = [], None
    for args in (reference_args, candidate_args):
        llm = LLM(**vars(args))
        if prompts is None:
            engine = llm.llm_engine
            requests = build_requests(ns.dataset, ns.num_prompts, ns.input_len, ns.output_len, ns.range_ratio,
                                      ns.dataset_seed, engine.vocab_size, engine.max_model_len)
            tok = engine.tokenizer
            prompts = [r.prompt if isinstance(r.prompt, list) else tok.encode(r.prompt) for r in requests]
            logger.info("accuracy: %d prompts (%d tokens), %d greedy tokens each; reference float32, candidate %s",
                        len(prompts), sum(map(len, prompts)), ns.output_len, label)
        scores.append(score_prompts(llm, prompts, ns.output_len))
        del llm
        gc.collect()
    result = compare_scores(*scores)
    result.update(dataset=ns.dataset, output_len=ns.output_len, dtype=candidate_args.dtype,
                  quantization=candidate_args.quantization)
    print(format_table(f"accuracy of {label} against float32", result, ACCURACY_TABLE_KEYS))
    _write_json(ns.output_json, result)
    return 0


# -- parser --------------------------------------------------------------------------------------

def add_bench_parser(subparsers) -> None:
    """Add ``bench`` and its subcommands to the ``pagedllm`` parser's subparsers."""
    from pagedllm.engine.arg_utils import add_engine_cli_args

    bench = subparsers.add_parser("bench", help="benchmarks: throughput, serving, latency, memory, kernels, accuracy")
    sub = bench.add_subparsers(dest="bench_command", required=True)

    tp = sub.add_parser("throughput", help="offline: the whole workload at once through LLM.generate")
    _add_dataset_args(tp, "random")
    tp.add_argument("--baseline", choices=["hf", "vllm", "openai"], default=None,
                    help="also run the workload through transformers static batches (hf, separate process), "
                         "vLLM's CPU build (vllm, in the venv of --baseline-python) "
                         "or an OpenAI-compatible server (openai, with --base-url)")
    tp.add_argument("--baseline-python", default=None,
                    help="for --baseline vllm: the python of a vLLM CPU venv (benchmarks/setup_vllm_cpu.sh)")
    tp.add_argument("--baseline-batch-size", type=_int_list, default=[8, 32],
                    help="HF static batch size(s), comma-separated; the best is compared (default 8,32)")
    tp.add_argument("--baseline-timeout", type=float, default=None, help="seconds per baseline process (HF, vLLM)")
    tp.add_argument("--base-url", default=None, help="OpenAI-compatible server for --baseline openai")
    tp.add_argument("--baseline-model", default=None, help="model name for --baseline openai (default: first listed)")
    tp.add_argument("--n", type=int, default=1,
                    help="samples per prompt (vLLM's --n); > 1 samples at temperature 1 (seeded) and forks the "
                         "prompt's blocks (copy-on-write)")
    tp.add_argument("--n-separate", action="store_true",
                    help="with --n: run each sample as its own request (seeds s..s+n-1, the same outputs), the "
                         "baseline of the forks")
    tp.add_argument("--no-warmup", action="store_true", help="skip the untimed one-request warm-up")
    tp.add_argument("--breakdown", action="store_true",
                    help="also time the engine's components (linear layers, LM head, attention, sampler, "
                         "scheduler, ...; single process) and, per rank, the step time and its share in "
                         "all-reduce / all-gather / send / recv, and print where the wall time went")
    tp.add_argument("--structured-output", choices=["json"], default=None,
                    help="constrain request i to the i %% 8-th of 8 JSON schemas (benchmarks/structured.py): "
                         "report grammar compile time per schema and output tokens/s with vs without constraints")
    tp.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                    help="LoRA adapters (PEFT folders; needs --enable-lora): request i runs with adapter i %% N")
    tp.add_argument("--output-json", default=None, help="write the results here")
    add_engine_cli_args(tp)
    tp.set_defaults(func=_cmd_throughput)

    sv = sub.add_parser("serving", help="online: streaming completions against a running server")
    sv.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000 (or .../v1)")
    sv.add_argument("--model", default=None, help="served model name (default: the first of /v1/models)")
    sv.add_argument("--tokenizer", default=None,
                    help="tokenizer folder for the generated datasets (default: the default model's)")
    _add_dataset_args(sv, "random")
    sv.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    sv.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps (1 = Poisson)")
    sv.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    sv.add_argument("--goodput", nargs="+", default=None, metavar="METRIC:MS",
                    help="SLOs for goodput, e.g. --goodput ttft:500 tpot:50")
    sv.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (for strict servers)")
    sv.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME",
                    help="served LoRA adapter names: request i names adapter i %% N as its model")
    sv.add_argument("--output-json", default=None)
    sv.set_defaults(func=_cmd_serving)

    lt = sub.add_parser("latency", help="one fixed batch: end-to-end and per-step time, with a matmul ceiling")
    lt.add_argument("--batch-size", type=int, default=8)
    lt.add_argument("--input-len", type=int, default=32)
    lt.add_argument("--output-len", type=int, default=128)
    lt.add_argument("--num-iters", type=int, default=3)
    lt.add_argument("--num-iters-warmup", type=int, default=1)
    lt.add_argument("--dataset-seed", type=int, default=0)
    lt.add_argument("--dataset", default="random",
                    help="'random' token ids, or a JSONL dataset ('grounded', 'workload', a file) whose first "
                         "batch-size prompts, cut to their last input-len tokens, are the batch (default: random)")
    lt.add_argument("--no-ceiling", action="store_true", help="skip the matmul-rate ceiling")
    lt.add_argument("--breakdown", action="store_true",
                    help="time the engine's components too, per step (the overhead: all but linear layers and LM head)")
    lt.add_argument("--output-json", default=None)
    add_engine_cli_args(lt)
    lt.set_defaults(func=_cmd_latency)

    mm = sub.add_parser("memory", help="requests sharing a KV budget: paged vs. max_model_len reservations "
                                       "(scheduler only, no model)")
    mm.add_argument("--dataset", default=DEFAULT_WORKLOAD,
                    help="JSONL workload to resample: 'workload' (shipped in the package) or a file")
    mm.add_argument("--num-prompts", type=int, default=256, help="requests resampled from the workload")
    mm.add_argument("--num-requests", type=int, default=None, help=argparse.SUPPRESS)  # deprecated alias
    mm.add_argument("--dataset-seed", type=int, default=0)
    mm.add_argument("--max-model-len", type=int, default=2048)
    mm.add_argument("--static-concurrency", type=int, default=8,
                    help="requests a max_model_len-reserving allocator fits; budget = this x max_model_len")
    mm.add_argument("--block-size", type=int, default=16, help="the headline block size")
    mm.add_argument("--block-sizes", type=_int_list, default=[8, 16, 32], help="block-size sweep (default 8,16,32)")
    mm.add_argument("--max-num-seqs", type=int, default=256)
    mm.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS)
    mm.add_argument("--layer-windows", default=None,
                    help="hybrid KV cache: per-layer sliding windows ('full' = full attention, X*N = N layers), "
                         "e.g. 512*5,full,512*5,full,512*5,full for Gemma 3 270M; the budget's bytes then "
                         "hold pages of one layer group (default: one table per request)")
    mm.add_argument("--output-json", default=None)
    mm.set_defaults(func=_cmd_memory)

    kn = sub.add_parser("kernels", help="linear-layer kernels (oneDNN, MKL, bf16, int8) at the model's shapes")
    kn.add_argument("--model", default=None, help="model folder or .gguf (default: the default model)")
    kn.add_argument("--rows", type=_int_list, default=[16, 64, 512], help="row counts M (default 16,64,512)")
    kn.add_argument("--backends", type=_str_list, default=["onednn", "torch", "bf16", "int8"],
                    help="comma-separated subset of onednn,torch,bf16,int8,int8_wo,int8_wo_torch,int4_wo "
                         "(int8_wo / int4_wo: the weight-only quantized layers as the engine runs them; "
                         "int8_wo_torch: int8 on torch's kernel)")
    kn.add_argument("--no-stream", action="store_true",
                    help="skip the STREAM-like memory bandwidth measurement (weight GB/s are shown for M <= 8)")
    kn.add_argument("--min-seconds", type=float, default=0.3, help="time each kernel at least this long")
    kn.add_argument("--compile-mlp", action="store_true",
                    help="also time one MLP block eager vs torch.compile (inductor freezing)")
    kn.add_argument("--output-json", default=None)
    kn.set_defaults(func=_cmd_kernels)

    ac = sub.add_parser("accuracy", help="a cheaper setting (--quantization int8, --dtype bfloat16) against the "
                                         "float32 engine: perplexity, top-1 agreement, greedy agreement")
    _add_dataset_args(ac, "random")
    ac.add_argument("--output-json", default=None)
    add_engine_cli_args(ac)
    ac.set_defaults(func=_cmd_accuracy)
