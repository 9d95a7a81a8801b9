"""The server's prefix-cache surface in-process (httpx ASGI transport, tiny checkpoint):
``usage.prompt_tokens_details.cached_tokens`` with ``--enable-prompt-tokens-details``,
``POST /reset_prefix_cache`` and the Prometheus counters."""

from __future__ import annotations

import asyncio
import json

import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.openai.api_server import build_state, make_arg_parser

PROMPT = list(range(20, 60))  # 40 tokens: 2 full blocks of 16 are reusable (the last token reruns)


@pytest.fixture(scope="module")
def state(make_tiny_checkpoint):
    args = EngineArgs(model=make_tiny_checkpoint("qwen2"), dtype="float32", max_model_len=128,
                      kv_cache_memory_bytes=4 << 20, seed=0)
    st = build_state(args, ["tiny"], chat_template=None, log_stats_interval_s=None,
                     enable_prompt_tokens_details=True)
    yield st
    st.engine.shutdown()


def _metric(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in /metrics")


def test_cached_tokens_reset_and_counters(asgi_run, state):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "temperature": 0, "ignore_eos": True}

    async def calls(client):
        assert (await client.post("/reset_prefix_cache")).status_code == 200
        first = (await client.post("/v1/completions", json=body)).json()
        second = (await client.post("/v1/completions", json=body)).json()
        lines = []
        async with client.stream("POST", "/v1/completions",
                                 json={**body, "stream": True, "stream_options": {"include_usage": True}}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    lines.append(json.loads(line[6:]))
        metrics = (await client.get("/metrics")).text
        reset = await client.post("/reset_prefix_cache")
        after = (await client.post("/v1/completions", json=body)).json()
        return first, second, lines[-1], metrics, reset, after

    first, second, streamed, metrics, reset, after = asgi_run(state, calls)
    assert first["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert second["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    assert streamed["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    assert _metric(metrics, "pagedllm:prefix_cache_queries_total") >= 3 * len(PROMPT)
    assert _metric(metrics, "pagedllm:prefix_cache_hits_total") >= 64
    assert reset.status_code == 200
    assert after["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_reset_refused_while_a_request_holds_blocks(asgi_run, state, monkeypatch):
    from pagedllm import SamplingParams

    async def engine_side():
        params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
        gen = state.engine.generate({"prompt_token_ids": PROMPT}, params, "holder")
        await gen.__anext__()  # running, 79 tokens to go: it holds its blocks
        refused = await state.engine.reset_prefix_cache()
        async for _ in gen:
            pass
        return refused, await state.engine.reset_prefix_cache()

    assert asyncio.run(engine_side()) == (False, True)

    async def busy():
        return False

    monkeypatch.setattr(state.engine, "reset_prefix_cache", busy)

    async def calls(client):
        return await client.post("/reset_prefix_cache")

    refused = asgi_run(state, calls)
    assert refused.status_code == 409 and "hold KV blocks" in refused.json()["error"]["message"]


def test_server_flags_parse():
    import argparse
    ns = make_arg_parser(argparse.ArgumentParser()).parse_args(["--enable-prompt-tokens-details",
                                                                "--no-enable-prefix-caching"])
    assert ns.enable_prompt_tokens_details is True and ns.enable_prefix_caching is False
    ns = make_arg_parser(argparse.ArgumentParser()).parse_args([])
    assert ns.enable_prompt_tokens_details is False and ns.enable_prefix_caching is True
