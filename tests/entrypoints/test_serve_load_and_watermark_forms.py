"""Two documented `pagedllm serve` forms started for real (README, "vLLM Python API" tensorizer
bullet and "Watermarking"): `serve DIR --load-format tensorizer` on a folder `tensorize_vllm_model`
wrote, and `serve ... --watermark-config '{"key": ...}'`. Each server's completions are compared
with the offline engine's on the same tiny float32 checkpoint."""

from __future__ import annotations

import json

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.engine.arg_utils import EngineArgs

pytestmark = pytest.mark.multiprocess

PROMPT = "The capital of France is"
KW = dict(dtype="float32", max_model_len=256, kv_cache_memory_bytes=32 << 20, seed=0)
FLAGS = ["--dtype", "float32", "--max-model-len", "256", "--kv-cache-memory-bytes", "32MiB", "--seed", "0",
         "--served-model-name", "tiny"]


def _offline_text(model: str, params: SamplingParams, **kwargs) -> str:
    llm = LLM(model, **KW, **kwargs)
    try:
        return llm.generate([PROMPT], params, use_tqdm=False)[0].outputs[0].text
    finally:
        llm.llm_engine.shutdown()


@pytest.mark.timeout(400)
def test_serve_a_tensorized_folder(make_tiny_checkpoint, launch_server, tmp_path):
    pytest.importorskip("tensorizer")
    from pagedllm.model_executor.model_loader.tensorizer import TensorizerConfig, tensorize_vllm_model

    ckpt = make_tiny_checkpoint("llama")
    out = tmp_path / "tensorized"
    tensorize_vllm_model(EngineArgs(model=ckpt, dtype="float32", max_model_len=256,
                                    kv_cache_memory_bytes=32 << 20),
                         TensorizerConfig(tensorizer_uri=f"{out}/model.tensors"))
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = _offline_text(ckpt, greedy)
    server = launch_server(["serve", str(out), "--load-format", "tensorizer", *FLAGS], "tensorizer",
                           module="pagedllm.entrypoints.cli")
    got = server.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0,
                                             extra_body={"ignore_eos": True})
    assert got.choices[0].text == want
    assert got.usage.completion_tokens == 16


@pytest.mark.timeout(400)
def test_serve_with_a_watermark_config(make_tiny_checkpoint, launch_server):
    ckpt = make_tiny_checkpoint("llama")
    sampled = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True)
    marked = _offline_text(ckpt, sampled, watermark_config={"key": 1234})
    plain_seeded = _offline_text(ckpt, SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=7))
    server = launch_server(["serve", ckpt, *FLAGS, "--watermark-config", json.dumps({"key": 1234})], "watermark",
                           module="pagedllm.entrypoints.cli")
    client = server.client()
    # The watermarked draw depends only on the key, the context and the logits: the server's
    # unseeded sampled text equals the offline engine's with the same key.
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=1.0,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == marked
    # Opting out samples as without a watermark: with a seed, the text of an engine without one.
    opted_out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=1.0, seed=7,
                                          extra_body={"ignore_eos": True, "watermarking": False})
    assert opted_out.choices[0].text == plain_seeded
    assert marked != plain_seeded
