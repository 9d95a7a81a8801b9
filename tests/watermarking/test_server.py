"""The OpenAI server with ``watermark_config``: completions are watermarked, ``"watermarking":
false`` opts out (in process, the app over httpx's ASGI transport). The word-level tokenizer makes
the text re-encode to the generated ids; the engine is seeded, so the outputs are fixed."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.openai.api_server import build_app, build_state
from pagedllm.tokenizers import get_tokenizer
from pagedllm.v1.watermarking import GumbelWatermarkDetector


@pytest.fixture(scope="module")
def state(broad_llama_dir):
    args = EngineArgs(model=broad_llama_dir, dtype="float32", max_model_len=256, kv_cache_memory_bytes=32 << 20,
                      seed=0, watermark_config={"key": 99})
    st = build_state(args, ["tiny"], chat_template=None, log_stats_interval_s=None)
    yield st
    st.engine.shutdown()


def test_server_watermarks_completions_and_honours_opt_out(state, broad_llama_dir):
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 80, "temperature": 1.0, "ignore_eos": True}

    async def calls():
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:
            marked = await client.post("/v1/completions", json=body)
            opted = await client.post("/v1/completions", json={**body, "watermarking": False})
            return marked, opted

    marked, opted = asyncio.run(calls())
    assert marked.status_code == 200 and opted.status_code == 200
    tok = get_tokenizer(broad_llama_dir)
    det = GumbelWatermarkDetector(99)
    ids = tok.encode(marked.json()["choices"][0]["text"], add_special_tokens=False)
    assert len(ids) == 80 and det.detect(ids).p_value < 0.01
    ids = tok.encode(opted.json()["choices"][0]["text"], add_special_tokens=False)
    assert len(ids) == 80 and not det.detect(ids).is_watermarked
