"""`pagedllm bench kernels`: the model's linear shapes, each backend's numerics, the step totals."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pagedllm.benchmarks.kernels import (BackendUnavailable, KernelResult, make_backend, model_linear_shapes,
                                         run_kernels, time_mlp_block)
from pagedllm.benchmarks.latency import LinearShape
from pagedllm.entrypoints.cli import main


def _expected_shapes(cfg: dict) -> Counter:
    """(in, out) -> layer count, written out from the config: per layer the merged q/k/v
    projection, o, the merged gate/up projection and down; the LM head [vocab, hidden] once."""
    h, n_layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    d = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv, inter = cfg["num_attention_heads"] * d, cfg["num_key_value_heads"] * d, cfg["intermediate_size"]
    c: Counter = Counter()
    for shape, per_layer in (((h, q + 2 * kv), 1), ((q, h), 1), ((h, 2 * inter), 1), ((inter, h), 1)):
        c[shape] += per_layer * n_layers
    c[(h, cfg["vocab_size"])] += 1
    return c


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_model_linear_shapes_match_the_config(make_tiny_checkpoint, arch):
    cfg = json.loads((Path(make_tiny_checkpoint(arch)) / "config.json").read_text())
    got = Counter({(s.in_features, s.out_features): s.count for s in model_linear_shapes(cfg)})
    assert got == _expected_shapes(cfg)


@pytest.mark.parametrize("backend,rtol", [("onednn", 1e-5), ("torch", 0.0), ("bf16", 2e-2), ("int8", 3e-2)])
def test_each_backend_computes_the_linear_layer(backend, rtol):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 40, generator=gen) / 40 ** 0.5
    x = torch.randn(5, 40, generator=gen)
    try:
        layer, dtype = make_backend(backend, w, 8)
    except BackendUnavailable as exc:  # e.g. no fbgemm or oneDNN off x86; any other error fails
        pytest.skip(str(exc))
    ref = F.linear(x, w)
    y = layer(x.to(dtype)).float()
    assert y.shape == (5, 48)
    # Relative to the output's scale: bf16 rounds inputs to 8 bits of mantissa, int8 to 127 levels.
    assert (y - ref).abs().max() <= rtol * ref.abs().max() + 1e-6


def test_unknown_backend_and_bad_rows_raise():
    with pytest.raises(ValueError, match="backend"):
        run_kernels([LinearShape(4, 4, 1)], [1], ["fp4"])
    with pytest.raises(ValueError, match="rows"):
        run_kernels([LinearShape(4, 4, 1)], [0], ["torch"])


def test_step_seconds_adds_up_the_layers_of_one_step():
    shapes = [LinearShape(10, 20, 3), LinearShape(20, 10, 1)]
    r = KernelResult(shapes=shapes, rows=[4], backends=["torch"])
    r.gflops[(20, 10, 4, "torch")] = 2.0   # 3 layers x 2*4*10*20 = 4800 FLOP at 2 GFLOP/s
    r.gflops[(10, 20, 4, "torch")] = 1.0   # 1 layer  x 1600 FLOP at 1 GFLOP/s
    assert r.step_seconds(4, "torch") == pytest.approx(4800 / 2e9 + 1600 / 1e9)
    assert r.step_seconds(4, "bf16") is None
    steps = r.to_dict()["steps"]
    assert steps == [{"rows": 4, "backend": "torch", "step_seconds": pytest.approx(4.0e-6),
                      "tokens_per_s": pytest.approx(1e6)}]


def test_cli_writes_a_rate_for_every_shape_row_and_backend(make_tiny_checkpoint, tmp_path, capsys):
    model = make_tiny_checkpoint("qwen2")
    out = tmp_path / "k.json"
    rc = main(["bench", "kernels", "--model", model, "--rows", "1,3", "--backends", "onednn,torch",
               "--min-seconds", "0", "--output-json", str(out)])
    assert rc == 0
    res = json.loads(out.read_text())
    cfg = json.loads((Path(model) / "config.json").read_text())
    shapes = {(s["out_in"][1], s["out_in"][0]): s["count"] for s in res["shapes"]}
    assert shapes == dict(_expected_shapes(cfg))
    ran = [b for b in ("onednn", "torch") if b not in res["skipped"]]
    assert "torch" in ran
    keys = {(tuple(k["out_in"]), k["rows"], k["backend"]) for k in res["kernels"]}
    assert keys == {((o, i), m, b) for (i, o) in shapes for m in (1, 3) for b in ran}
    assert all(k["gflops_per_s"] > 0 for k in res["kernels"])
    assert {(s["rows"], s["backend"]) for s in res["steps"]} == {(m, b) for m in (1, 3) for b in ran}
    assert "one decode step of M tokens" in capsys.readouterr().out


def test_cli_rejects_an_unknown_backend(make_tiny_checkpoint, capsys):
    rc = main(["bench", "kernels", "--model", make_tiny_checkpoint("qwen2"), "--backends", "fp4", "--rows", "1"])
    assert rc == 2
    assert "fp4" in capsys.readouterr().err


def test_compiled_mlp_block_matches_eager():
    try:
        rows = time_mlp_block(32, 64, [3], min_seconds=0.0)
    except BackendUnavailable as exc:  # e.g. no fbgemm or oneDNN off x86; any other error fails
        pytest.skip(str(exc))
    (r,) = rows
    assert r["rows"] == 3 and r["eager_packed_ms"] > 0 and r["compiled_ms"] > 0
    assert r["max_abs_diff"] < 1e-4


@pytest.mark.parametrize("backend,rtol", [("int8_wo", 2e-2), ("int8_wo_torch", 2e-2), ("int4_wo", 0.15)])
def test_weight_only_backends_compute_the_linear_layer(backend, rtol):
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=gen) / 8
    x = torch.randn(5, 64, generator=gen)
    layer, dtype = make_backend(backend, w, 8)
    ref = F.linear(x, w)
    y = layer(x.to(dtype)).float()
    assert y.shape == (5, 48)
    # int8: 255 levels per row and bf16 activations; int4: 16 levels per group of 32 columns.
    assert (y - ref).abs().max() <= rtol * ref.abs().max()
    assert (y - ref).abs().max() > 0


def test_weight_gb_per_s_is_weight_bytes_over_call_time():
    """4096 x 1024 float32 weights (16 MiB) at 100 GFLOP/s with M = 2: a call does 2*2*4096*1024
    FLOPs in 167.8 us, so it streams 16.78 MB / 167.8 us = 100 GB/s; int4 reads an eighth of it."""
    r = KernelResult(shapes=[LinearShape(1024, 4096, 1)], rows=[2], backends=["onednn", "int4_wo"])
    r.gflops[(4096, 1024, 2, "onednn")] = 100.0
    r.gflops[(4096, 1024, 2, "int4_wo")] = 100.0
    assert r.gb_per_s(4096, 1024, 2, "onednn") == pytest.approx(100.0)
    assert r.gb_per_s(4096, 1024, 2, "int4_wo") == pytest.approx(12.5)
    assert r.gb_per_s(4096, 1024, 2, "bf16") is None


def test_stream_bandwidth_counts_read_and_written_bytes():
    from pagedllm.benchmarks.kernels import stream_bandwidth

    bw = stream_bandwidth(array_bytes=8 << 20, min_seconds=0.01)
    assert bw["array_bytes"] == 8 << 20
    assert 0.1 < bw["copy_gb_per_s"] < 10_000 and 0.1 < bw["read_gb_per_s"] < 10_000
