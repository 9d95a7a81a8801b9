"""Smoke runs of ``pagedllm bench`` on a tiny random checkpoint (no timing assertions)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedllm.benchmarks.metrics import RESULT_KEYS
from pagedllm.entrypoints.cli import main

ENGINE_FLAGS = ["--kv-cache-memory-bytes", "8MiB", "--max-model-len", "256", "--block-size", "8"]


def _workload(tmp_path, rows):
    path = tmp_path / "w.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


def test_bench_throughput_json_keys_and_token_count(make_tiny_checkpoint, tmp_path, capsys):
    model = make_tiny_checkpoint("llama")
    out = tmp_path / "r.json"
    rc = main(["bench", "throughput", "--model", model, "--dataset", "random", "--num-prompts", "4",
               "--input-len", "12", "--output-len", "6", "--range-ratio", "0.5", "--dataset-seed", "1",
               "--output-json", str(out), *ENGINE_FLAGS])
    assert rc == 0
    res = json.loads(out.read_text())
    for k in RESULT_KEYS:
        assert k in res
    from pagedllm.benchmarks.datasets import random_requests
    reqs = random_requests(4, 12, 6, vocab_size=10**6, range_ratio=0.5, seed=1)  # same lengths for any vocab
    assert res["num_requests"] == 4
    assert res["num_output_tokens"] == sum(r.max_tokens for r in reqs)
    assert res["num_prompt_tokens"] == sum(r.prompt_len for r in reqs)
    assert res["requests_per_s"] > 0 and res["output_tokens_per_s"] > res["requests_per_s"]
    assert 0 < res["kv_utilization"] <= 1 and 0 < res["peak_kv_usage"] <= 1
    assert res["num_preemptions"] == 0 and res["prefix_cache_hit_rate"] == 0.0  # distinct random prompts
    assert res["mean_ttft_s"] > 0 and res["p99_ttft_s"] >= res["mean_ttft_s"] * 0.999
    assert res["block_size"] == 8
    captured = capsys.readouterr()
    table = captured.out
    assert "output_tokens_per_s" in table and "kv_utilization" in table
    # Row names give the unit of what they show: latencies in ms as *_ms, the run in seconds as duration_s.
    rows = {line.split()[0]: line.split()[1] for line in table.splitlines()[1:]}
    assert float(rows["mean_ttft_ms"]) == pytest.approx(res["mean_ttft_s"] * 1000, abs=0.051)
    assert float(rows["duration_s"]) == pytest.approx(res["duration_s"], abs=0.0051)
    assert not {"mean_ttft_s", "p99_tpot_s"} & set(rows)
    assert "Processed prompts: 100%" in captured.err  # the progress bar, on stderr


def test_bench_throughput_n_forks_against_separate_requests(make_tiny_checkpoint, tmp_path):
    """``--n 4``: one request per prompt whose samples fork the prompt's blocks; ``--n-separate``:
    four requests per prompt. Same tokens made; the forks hold fewer blocks at the peak (prompts of
    40 tokens = 5 blocks of 8, stored once instead of four times; prefix caching off)."""
    model = make_tiny_checkpoint("llama")
    data = _workload(tmp_path, [{"prompt": list(range(10 + i, 50 + i)), "max_tokens": 6} for i in range(3)])
    results = {}
    for mode in ([], ["--n-separate"]):
        out = tmp_path / f"r{len(mode)}.json"
        rc = main(["bench", "throughput", "--model", model, "--dataset", data, "--n", "4", *mode,
                   "--no-enable-prefix-caching", "--no-progress", "--output-json", str(out), *ENGINE_FLAGS])
        assert rc == 0
        results[bool(mode)] = json.loads(out.read_text())
    forks, separate = results[False], results[True]
    assert forks["n"] == separate["n"] == 4 and separate["n_separate"]
    assert forks["num_output_tokens"] == separate["num_output_tokens"] == 3 * 4 * 6
    assert forks["num_requests"] == 3 and separate["num_requests"] == 12
    # Forks: 5 prompt blocks once + 4 private last blocks per prompt; separate: 4 x 6 per prompt.
    assert forks["peak_blocks_used"] == 3 * (5 + 4) and separate["peak_blocks_used"] == 3 * 4 * 6


def test_bench_throughput_checks_the_dataset_before_loading_a_model(tmp_path, capsys):
    missing_model = str(tmp_path / "no-model")  # loading it would fail with another message
    rc = main(["bench", "throughput", "--model", missing_model, "--dataset", str(tmp_path / "nope.jsonl")])
    assert rc == 2
    err = capsys.readouterr().err
    assert "nope.jsonl' is neither one of" in err and "no-model" not in err


def test_bench_throughput_hf_baseline(make_tiny_checkpoint, tmp_path):
    model = make_tiny_checkpoint("llama")
    data = _workload(tmp_path, [{"prompt": "The quick brown fox", "max_tokens": 5},
                                {"prompt": "A paged KV cache splits keys", "max_tokens": 2},
                                {"prompt": [5, 6, 7, 8, 9, 10, 11], "max_tokens": 7}])
    out = tmp_path / "r.json"
    rc = main(["bench", "throughput", "--model", model, "--dataset", data, "--baseline", "hf",
               "--baseline-batch-size", "2", "--output-json", str(out), *ENGINE_FLAGS])
    assert rc == 0
    res = json.loads(out.read_text())
    base = res["baseline"]
    assert res["num_output_tokens"] == 14 and base["num_output_tokens"] == 14  # useful tokens only
    assert base["num_prompt_tokens"] == res["num_prompt_tokens"]               # same token ids
    assert base["batch_size"] == 2
    assert base["num_generated_slots"] == 2 * 5 + 1 * 7                         # batch max x rows
    assert base["useful_output_fraction"] == pytest.approx(14 / 17)
    assert set(res["ratio"]) == set(RESULT_KEYS)
    assert res["ratio"]["requests_per_s"] == pytest.approx(res["requests_per_s"] / base["requests_per_s"])
    assert res["ratio"]["kv_utilization"] is None


def test_bench_latency_reports_steps_and_ceiling(make_tiny_checkpoint, tmp_path):
    model = make_tiny_checkpoint("llama")
    out = tmp_path / "l.json"
    rc = main(["bench", "latency", "--model", model, "--batch-size", "3", "--input-len", "8", "--output-len", "5",
               "--num-iters", "2", "--num-iters-warmup", "0", "--output-json", str(out), *ENGINE_FLAGS])
    assert rc == 0
    res = json.loads(out.read_text())
    # One step prefills all three (24 tokens < 512), then 4 full-batch decode steps per iteration.
    assert res["num_decode_steps"] == 2 * 4
    assert res["mean_decode_step_s"] > 0 and res["ceiling_tokens_per_s"] > 0
    # tiny llama (hidden 64, 4 heads / 2 KV heads of 16, MLP 128): 3 layers x (merged q/k/v
    # [64 + 2 * 32, 64], o, merged gate/up [2 * 128, 64], down) + LM head.
    shapes = {tuple(s["out_in"]): s["count"] for s in res["shapes"]}
    assert shapes[(128, 64)] == 3 and shapes[(64, 64)] == 3 and shapes[(256, 64)] == 3 and shapes[(64, 128)] == 3
    assert sum(shapes.values()) == 3 * 4 + 1
    assert res["measured_over_ceiling"] == pytest.approx(res["decode_tokens_per_s"] / res["ceiling_tokens_per_s"])


def test_bench_latency_with_speculation_counts_tokens_per_forward(make_tiny_checkpoint, tmp_path, capsys):
    """A speculative step emits tokens_per_target_forward tokens per request: the decode rate says
    so, and the one-row ceiling is not compared with it."""
    model = make_tiny_checkpoint("llama")
    out = tmp_path / "s.json"
    rc = main(["bench", "latency", "--model", model, "--batch-size", "1", "--input-len", "16", "--output-len", "12",
               "--num-iters", "1", "--num-iters-warmup", "0", "--output-json", str(out), *ENGINE_FLAGS,
               "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["spec_draft_tokens"] is not None and res["tokens_per_target_forward"] >= 1.0
    assert res["decode_tokens_per_s"] == pytest.approx(res["tokens_per_target_forward"] / res["mean_decode_step_s"])
    assert res["measured_over_ceiling"] is None and res["ceiling_tokens_per_s"] > 0
    text = capsys.readouterr().out
    assert "x tokens per target forward" in text and "measured / ceiling  n/a (speculative" in text


def test_bench_latency_breakdown_per_step(make_tiny_checkpoint, tmp_path):
    model = make_tiny_checkpoint("gemma3")
    out = tmp_path / "b.json"
    rc = main(["bench", "latency", "--model", model, "--batch-size", "1", "--input-len", "8", "--output-len", "5",
               "--num-iters", "2", "--num-iters-warmup", "0", "--no-ceiling", "--breakdown",
               "--output-json", str(out), *ENGINE_FLAGS])
    assert rc == 0
    res = json.loads(out.read_text())
    # Per iteration: one prefill step (which samples the first token), then 4 decode steps.
    assert res["num_steps"] == 2 * 5
    per_step = res["breakdown_ms_per_step"]
    bd = res["breakdown"]
    for name, seconds in bd.items():
        if name != "wall_s":
            assert per_step[name] == pytest.approx(seconds / 10 * 1000)
    assert per_step["linear layers"] > 0 and per_step["LM head"] > 0
    # The components sum to the timed iterations' wall time; the overhead is all but linear + head.
    assert sum(v for k, v in bd.items() if k != "wall_s") == pytest.approx(bd["wall_s"])
    assert res["overhead_ms_per_step"] == pytest.approx(
        sum(per_step.values()) - per_step["linear layers"] - per_step["LM head"])
    assert bd["wall_s"] == pytest.approx(res["mean_latency_s"] * 2)


def test_bench_memory_json(tmp_path, capsys):
    data = _workload(tmp_path, [{"prompt": "x", "prompt_len": 13, "max_tokens": 3}])
    out = tmp_path / "m.json"
    rc = main(["bench", "memory", "--dataset", data, "--num-prompts", "12", "--max-model-len", "32",
               "--static-concurrency", "2", "--block-size", "4", "--block-sizes", "4,8",
               "--max-num-batched-tokens", "64", "--output-json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["headline"]["peak_concurrency"] == 4 and res["headline"]["static_concurrency"] == 2
    assert [r["block_size"] for r in res["block_size_sweep"]] == [4, 8]
    assert "peak 4 concurrent (2.0x)" in capsys.readouterr().out


def test_bench_memory_defaults_to_the_shipped_workload(tmp_path, caplog):
    out = tmp_path / "m.json"
    rc = main(["bench", "memory", "--num-prompts", "32", "--block-sizes", "16", "--output-json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    from pagedllm.benchmarks.datasets import dataset_file
    assert res["dataset"] == dataset_file("workload") and res["num_requests"] == 32
    # --num-requests still works, with a warning
    with caplog.at_level("WARNING"):
        assert main(["bench", "memory", "--num-requests", "8", "--block-sizes", "16", "--output-json", str(out)]) == 0
    assert json.loads(out.read_text())["num_requests"] == 8
    assert "--num-requests is deprecated; use --num-prompts" in caplog.text


def test_bench_bad_dataset_line_is_a_clean_error(tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    data.write_text('{"prompt": "x"}\n')
    rc = main(["bench", "memory", "--dataset", str(data)])
    assert rc == 2
    assert "missing field 'max_tokens'" in capsys.readouterr().err


def test_bench_latency_prefills_the_batch_in_one_step_and_counts_a_tied_head_once(make_tiny_checkpoint, tmp_path):
    model = make_tiny_checkpoint("gemma3")  # tied LM head (packed next to the embedding on CPU f32)
    out = tmp_path / "l.json"
    # 4 x 300 prompt tokens > the default 1024-token budget: without a budget of batch x input_len,
    # chunked prefill would overlap the first requests' decodes with the last prompts.
    rc = main(["bench", "latency", "--model", model, "--batch-size", "4", "--input-len", "300", "--output-len", "3",
               "--num-iters", "1", "--num-iters-warmup", "0", "--output-json", str(out),
               "--kv-cache-memory-bytes", "8MiB", "--max-model-len", "320", "--block-size", "8"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert res["num_decode_steps"] == 2  # token 1 from the prefill step, tokens 2 and 3 from full-batch decodes
    cfg = json.loads((Path(model) / "config.json").read_text())
    shapes = {tuple(s["out_in"]): s["count"] for s in res["shapes"]}
    assert shapes[(cfg["vocab_size"], cfg["hidden_size"])] == 1


def test_bench_throughput_structured_output_compares_the_same_lengths(make_tiny_checkpoint, tmp_path, capsys):
    """--structured-output json: the unconstrained run makes exactly the constrained replies'
    lengths (same steps), both greedy constrained runs agree, and --breakdown puts grammar time
    only on the constrained runs."""
    model = make_tiny_checkpoint("llama")
    out = tmp_path / "s.json"
    rc = main(["bench", "throughput", "--model", model, "--dataset", "random", "--num-prompts", "8",
               "--input-len", "12", "--output-len", "24", "--dataset-seed", "1", "--structured-output", "json",
               "--breakdown", "--no-progress", "--output-json", str(out), *ENGINE_FLAGS])
    assert rc == 0
    res = json.loads(out.read_text())
    first, second, plain = res["constrained_first_run"], res["constrained"], res["unconstrained"]
    assert first["output_lens"] == second["output_lens"] == plain["output_lens"]
    from pagedllm.benchmarks.datasets import random_requests
    reqs = random_requests(8, 12, 24, vocab_size=10**6, range_ratio=0.5, seed=1)  # the workload (CLI defaults)
    assert all(1 <= n <= r.max_tokens for n, r in zip(plain["output_lens"], reqs)), (plain["output_lens"], [r.max_tokens for r in reqs])
    assert first["num_steps"] == second["num_steps"] == plain["num_steps"]
    assert res["num_schemas"] == 8 and res["compile_p99_s"] >= res["compile_mean_s"] > 0
    for run in (first, second):
        assert run["breakdown"]["grammar bitmask fill"] > 0 and run["breakdown"]["grammar mask apply"] > 0
    assert plain["breakdown"]["grammar bitmask fill"] == plain["breakdown"]["grammar mask apply"] == 0
    both = (first["num_output_tokens"] + second["num_output_tokens"]) / (first["duration_s"] + second["duration_s"])
    assert res["ratio_both_constrained_runs"] == pytest.approx(both / plain["output_tokens_per_s"])
    assert "both runs together" in capsys.readouterr().out
