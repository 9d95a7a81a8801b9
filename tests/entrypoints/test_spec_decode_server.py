"""`pagedllm serve --speculative-config ...` started for real (tiny float32 Llama): answers equal the
engine without speculation (openai client, plain and streamed), suffix decoding drafts a repeated
request from the first one's output, and `/metrics` carries vLLM's spec-decode counters. The
two-rank form (`-tp 2`) is in the slow tier."""

from __future__ import annotations

import json

import pytest

from pagedllm import LLM, SamplingParams

PROMPTS = [[7, 11, 13, 200, 17, 3, 40, 41, 42, 50], list(range(30, 49))]
SUFFIX = json.dumps({"method": "suffix", "num_speculative_tokens": 6, "suffix_decoding_min_token_prob": 0.0,
                     "adaptive": False})


def _args(folder: str, *flags: str) -> list[str]:
    return ["serve", folder, "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "128",
            "--block-size", "8", "--kv-cache-memory-bytes", "4MiB", "--speculative-config", SUFFIX, *flags]


@pytest.fixture(scope="module")
def reference(make_tiny_checkpoint):
    folder = make_tiny_checkpoint("llama")
    llm = LLM(folder, dtype="float32", max_model_len=128, block_size=8)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                        SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    return folder, [o.outputs[0].text for o in outs]


def _check(server, want: list[str]) -> None:
    client = server.client()
    for prompt, text in zip(PROMPTS, want):
        for _ in range(2):   # the second time, suffix decoding drafts from the first answer
            r = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0,
                                          extra_body={"ignore_eos": True})
            assert r.choices[0].text == text
        chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0, stream=True,
                                           extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    drafts = server.metric("pagedllm:spec_decode_num_draft_tokens_total", model_name="tiny")
    accepted = server.metric("pagedllm:spec_decode_num_accepted_tokens_total", model_name="tiny")
    assert server.metric("pagedllm:spec_decode_num_drafts_total", model_name="tiny") > 0
    assert drafts > 0 and accepted >= 0.5 * 24 * len(PROMPTS)   # repeated requests: mostly accepted
    assert server.metric("pagedllm:spec_decode_num_accepted_tokens_per_pos_total", position="0") > 0


def test_serve_with_speculative_config(reference, launch_server):
    folder, want = reference
    server = launch_server(_args(folder), "spec", module="pagedllm.entrypoints.cli")
    _check(server, want)
    assert server.terminate() == 0


@pytest.mark.multiprocess
def test_serve_tensor_parallel_with_speculative_config(reference, launch_server):
    folder, want = reference
    server = launch_server(_args(folder, "--tensor-parallel-size", "2"), "spec_tp2", module="pagedllm.entrypoints.cli",
                           env={"PAGEDLLM_CPU_THREADS_PER_RANK": "1"})
    _check(server, want)
    assert server.terminate() == 0


def test_serve_rejects_a_bad_speculative_config(make_tiny_checkpoint, tmp_path):
    import subprocess
    import sys

    folder = make_tiny_checkpoint("llama")
    proc = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", folder, "--speculative-config",
                           '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_mx": 3}'],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "prompt_lookup_mx" in proc.stderr + proc.stdout
