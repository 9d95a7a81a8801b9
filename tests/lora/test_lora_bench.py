"""``pagedllm bench throughput --enable-lora --lora-modules ...``: request ``i`` on adapter ``i % N``,
the adapters named in the table and the JSON result."""

import json

from pagedllm.entrypoints.cli import main


def test_bench_throughput_with_lora_modules(make_tiny_checkpoint, make_adapter, tmp_path, capsys):
    base = make_tiny_checkpoint("llama")
    a, b = make_adapter(base, 1, r=8), make_adapter(base, 2, r=4, targets=["q_proj", "v_proj"])
    flags = ["bench", "throughput", "--model", base, "--dataset", "random", "--num-prompts", "4", "--input-len", "8",
             "--output-len", "4", "--dtype", "float32", "--kv-cache-memory-bytes", "8MiB", "--max-model-len", "128",
             "--no-progress", "--lora-modules", f"a={a}", f"b={b}"]
    assert main(flags) == 2   # without --enable-lora
    assert "--lora-modules needs --enable-lora" in capsys.readouterr().err
    out = tmp_path / "r.json"
    assert main([*flags, "--enable-lora", "--max-loras", "2", "--output-json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["lora_adapters"] == ["a", "b"] and res["num_requests"] == 4
    assert "request i on LoRA adapter i % 2" in capsys.readouterr().out
