"""The ``pagedllm`` command as a new user meets it: errors, ``--help``, output labels, start-up log lines
(tiny random checkpoint; no default model)."""

from __future__ import annotations

import gc
import logging
import os
import re
import subprocess
import sys

import pytest

import pagedllm
from pagedllm.entrypoints.cli import build_parser, main

TINY_FLAGS = ["--dtype", "float32", "--max-model-len", "64", "--kv-cache-memory-bytes", "8MiB", "--no-progress"]


@pytest.fixture(scope="module")
def tiny_dir(make_tiny_checkpoint):
    return make_tiny_checkpoint("llama")


def test_missing_prompts_file_is_one_line_and_exit_2(tmp_path, capsys):
    rc = main(["generate", "--prompts-file", str(tmp_path / "nope.txt")])
    assert rc == 2
    err = capsys.readouterr().err
    assert err == f"pagedllm: error: --prompts-file '{tmp_path / 'nope.txt'}': no such file\n"


@pytest.mark.parametrize("argv, expected", [
    (["generate"], ["--max-tokens MAX_TOKENS", "(default: 32)", "--temperature TEMPERATURE", "default: 0.0",
                    "--block-size BLOCK_SIZE", "tokens per KV block (default: 16)", "--dtype", "default: auto"]),
    (["serve"], ["--port PORT", "default: 8000", "--shutdown-timeout SHUTDOWN_TIMEOUT", "(default: 30.0)"]),
    (["bench", "throughput"], ["--input-len INPUT_LEN", "(default: 128)", "--dataset DATASET", "(default: random)"]),
    (["bench", "memory"], ["--dataset DATASET", "(default: workload)", "--num-prompts NUM_PROMPTS",
                           "(default: 256)"]),
])
def test_help_shows_defaults(argv, expected, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args([*argv, "--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for fragment in expected:
        assert fragment in text, fragment
    assert "--num-requests" not in text  # bench memory's deprecated alias stays out of the help


def test_text_output_labels_request_then_sample(tiny_dir, capsys):
    rc = main(["generate", "--model", tiny_dir, "one", "two", "--max-tokens", "2", *TINY_FLAGS])
    assert rc == 0
    labels = [line.split()[1] for line in capsys.readouterr().out.splitlines() if line.startswith("--- ")]
    assert labels == ["[0]", "[1]"]
    rc = main(["generate", "--model", tiny_dir, "one", "--n", "2", "--temperature", "1", "--max-tokens", "2",
               *TINY_FLAGS])
    assert rc == 0
    labels = [line.split()[1] for line in capsys.readouterr().out.splitlines() if line.startswith("--- ")]
    assert labels == ["[0.0]", "[0.1]"]


def test_command_process_output_equals_in_process_main(tiny_dir, capsys):
    """``python -m pagedllm.entrypoints.cli generate`` owns its process (it stops the engine and
    freezes the collector at its end: docs/performance.md, "Step 19"); it prints what an in-process
    ``main([...])`` prints, and ``main([...])`` leaves the caller's collector as it was."""
    argv = ["generate", "--model", tiny_dir, "one", "two", "--max-tokens", "3", *TINY_FLAGS]
    frozen = gc.get_freeze_count()
    assert main(argv) == 0
    assert gc.get_freeze_count() == frozen
    expected = capsys.readouterr().out
    root = os.path.dirname(os.path.dirname(os.path.abspath(pagedllm.__file__)))  # this checkout's package
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
    done = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", *argv], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == expected
    assert "Throughput:" in done.stderr


def _start_log(tiny_dir, caplog, *flags) -> str:
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        assert main(["generate", "--model", tiny_dir, "x", "--max-tokens", "1", *TINY_FLAGS, *flags]) == 0
    return caplog.text


def test_gpu_memory_utilization_line_only_when_set(tiny_dir, caplog, monkeypatch):
    monkeypatch.setenv("PAGEDLLM_CPU_KVCACHE_SPACE", "0.01")  # GiB: the CPU budget, when no bytes are given
    argv = ["generate", "--model", tiny_dir, "x", "--max-tokens", "1", "--max-model-len", "64", "--no-progress"]
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        assert main(argv) == 0
    assert "KV cache:" in caplog.text and "does not apply on the CPU" not in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pagedllm"):
        assert main([*argv, "--gpu-memory-utilization", "0.5"]) == 0
    assert "gpu_memory_utilization=0.5 does not apply on the CPU" in caplog.text


def test_start_log_names_the_attention_backend_and_why(tiny_dir, caplog, monkeypatch):
    """The kernel plan's table, once: its attention row names the backend and why."""
    from pagedllm.attention.backends.cpu_paged import load_kernel
    from pagedllm.platforms.cpu import cpu_flags, missing_flags, CpuIsa
    expected = (r"cpu_paged +\(the default on the CPU: the C\+\+ paged-attention kernel;" if load_kernel() is not None
                else r"cpu_sdpa +\(the cpu_paged kernel could not be built")
    log = _start_log(tiny_dir, caplog)
    assert log.count("Kernel plan:") == 1
    assert re.search(rf"Kernel plan:\n(  .*\n)*  attention backend +{expected}", log), log
    if load_kernel() is not None:  # which micro-kernels run, and which path "auto" chose from the CPU's flags
        best = "avx512" if not missing_flags(CpuIsa.AVX512, cpu_flags()) else \
            "avx2" if not missing_flags(CpuIsa.AVX2, cpu_flags()) else "portable"
        assert f"{best} micro-kernels for float32 (cpu_isa 'auto' -> " in log
    caplog.clear()
    monkeypatch.setenv("PAGEDLLM_ATTENTION_BACKEND", "cpu_sdpa")
    assert re.search(r"\n  attention backend +cpu_sdpa +\(set by attention_backend='cpu_sdpa' / "
                     r"\$PAGEDLLM_ATTENTION_BACKEND\)", _start_log(tiny_dir, caplog))
