"""vLLM's token-in / token-out route ``POST /inference/v1/generate`` (``--enable-scale-out``;
issue 28: vLLM's ``scale_out/token_generation_client.py`` runs unchanged). The reference is the
offline engine on the same tiny checkpoint with the same token ids and sampling parameters; the
documented command form (``pagedllm serve --enable-scale-out``) is started for real."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.openai.api_server import build_state

PROMPT = [5, 17, 42, 9, 33, 71, 8]
ENGINE = dict(dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 << 20, seed=0)


@pytest.fixture(scope="module")
def folder(make_tiny_checkpoint):
    return make_tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def reference(folder):
    """Offline greedy output of PROMPT: (token ids, text, per-token top-2 logprobs)."""
    from pagedllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(folder, **ENGINE)
    out = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)],
                       SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=2))[0].outputs[0]
    result = (list(out.token_ids), out.text, out.logprobs)
    del llm
    return result


@pytest.fixture(scope="module")
def state(folder):
    st = build_state(EngineArgs(model=folder, **ENGINE), ["tiny"], log_stats_interval_s=None, enable_scale_out=True)
    yield st
    st.engine.shutdown()


def _events(body: str) -> list:
    lines = [line[len("data: "):] for line in body.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_tokens_text_and_stream_equal_the_offline_engine(state, reference, asgi_run):
    want_ids, want_text, want_logprobs = reference
    greedy = {"temperature": 0, "max_tokens": 10, "ignore_eos": True}

    async def calls(http):
        tokens = await http.post("/inference/v1/generate", json={
            "model": "tiny", "token_ids": PROMPT, "request_id": "r1", "return_token_ids": True,
            "sampling_params": {**greedy, "logprobs": 2, "detokenize": False}})
        text = await http.post("/inference/v1/generate", json={
            "token_ids": PROMPT, "output_mode": "text", "sampling_params": greedy})
        stream = await http.post("/inference/v1/generate", json={
            "token_ids": PROMPT, "stream": True, "stream_options": {"include_usage": True}, "sampling_params": greedy})
        return tokens, text, stream

    tokens, text, stream = asgi_run(state, calls)
    assert tokens.status_code == 200, tokens.text
    body = tokens.json()
    assert body["request_id"] == "generate-tokens-r1" and body["model"] == "tiny" and body["output_mode"] == "tokens"
    assert body["prompt_token_ids"] == PROMPT
    [choice] = body["choices"]
    assert choice["token_ids"] == want_ids and choice["finish_reason"] == "length" and "text" not in choice
    assert choice["stop_reason"] is None
    assert body["usage"] == {"prompt_tokens": len(PROMPT), "completion_tokens": 10, "total_tokens": len(PROMPT) + 10}
    content = choice["logprobs"]["content"]
    assert [c["token_id"] for c in content] == want_ids
    for c, entry in zip(content, want_logprobs):
        assert c["logprob"] == pytest.approx(entry[c["token_id"]].logprob, abs=1e-5) and c["rank"] == 1
        assert [t["rank"] for t in c["top_logprobs"]] == [1, 2]
        assert {t["token_id"] for t in c["top_logprobs"]} == {t for t, lp in entry.items() if lp.rank <= 2}
    assert text.json()["choices"][0]["text"] == want_text and text.json()["output_mode"] == "text"
    events = _events(stream.text)
    streamed = [t for e in events for c in e["choices"] for t in c["token_ids"]]
    assert streamed == want_ids
    assert [c["finish_reason"] for e in events for c in e["choices"]][-1] == "length"
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 10


def test_max_tokens_defaults_to_the_context_and_n_samples(state, asgi_run):
    async def calls(http):
        long = await http.post("/inference/v1/generate", json={
            "token_ids": PROMPT, "sampling_params": {"temperature": 0, "ignore_eos": True}})
        two = await http.post("/inference/v1/generate", json={
            "token_ids": PROMPT, "sampling_params": {"n": 2, "seed": 3, "max_tokens": 4}})
        return long, two

    long, two = asgi_run(state, calls)
    # vLLM's rule on this route: no max_tokens means up to max_model_len (128), not SamplingParams' 16.
    assert len(long.json()["choices"][0]["token_ids"]) == 128 - len(PROMPT)
    assert sorted(c["index"] for c in two.json()["choices"]) == [0, 1]


@pytest.mark.parametrize("payload, status, param", [
    ({"token_ids": PROMPT, "sampling_params": {"temprature": 0.5}}, 400, "sampling_params.temprature"),
    ({"token_ids": PROMPT, "sampling_params": {"temperature": -1}}, 400, "sampling_params.temperature"),
    ({"token_ids": PROMPT, "sampling_params": {"detokenize": "no"}}, 400, "sampling_params.detokenize"),
    ({"token_ids": PROMPT, "output_mode": "text", "sampling_params": {"detokenize": False}}, 400,
     "sampling_params.detokenize"),
    ({"token_ids": PROMPT, "output_mode": "derender"}, 400, "output_mode"),
    ({"token_ids": PROMPT, "features": {"mm_hashes": {}, "mm_placeholders": {}}}, 400, "features"),
    ({"token_ids": PROMPT, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"token_ids": [5] * 200}, 400, "token_ids"),
    ({"token_ids": [10 ** 7]}, 400, None),
    ({"token_ids": []}, 400, None),
    ({"token_ids": PROMPT, "model": "nope"}, 404, "model"),
])
def test_bad_requests_are_openai_errors(state, payload, status, param, asgi_run):
    async def calls(http):
        bad = await http.post("/inference/v1/generate", json=payload)
        ok = await http.post("/inference/v1/generate", json={"token_ids": PROMPT, "sampling_params": {"max_tokens": 2}})
        return bad, ok

    bad, ok = asgi_run(state, calls)
    assert bad.status_code == status, bad.text
    error = bad.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    if param is not None:
        assert error["param"] == param, error
    assert ok.status_code == 200   # and the server goes on


async def _stream_then_abort(http: httpx.AsyncClient) -> tuple[str, int]:
    """Stream a 120-token request and abort it by id after 3 chunks: (last finish reason, tokens)."""
    async with http.stream("POST", "/inference/v1/generate", json={
            "token_ids": PROMPT, "request_id": "long", "stream": True,
            "sampling_params": {"max_tokens": 120, "ignore_eos": True}}) as stream:
        reasons, tokens = [], 0
        async for line in stream.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                tokens += len(c["token_ids"])
                reasons.append(c["finish_reason"])
                if len(reasons) == 3:
                    aborted = await http.post("/inference/v1/abort_requests",
                                              json={"request_ids": ["generate-tokens-long"]})
                    assert aborted.status_code == 200
        return reasons[-1], tokens


def test_abort_requests_ends_the_stream_with_abort(state):
    """``AsyncLLM.abort_requests`` (the engine in this process): the caller gets a final "abort"
    output. (The ASGI test transport delivers a streamed body whole, so this drives the engine.)"""
    from pagedllm import SamplingParams

    async def main():
        stream = state.engine.add_requests([("long", {"prompt_token_ids": PROMPT},
                                             SamplingParams(max_tokens=120, ignore_eos=True))])
        outputs = []
        async for out in stream:
            outputs.append(out)
            if len(outputs) == 3:
                assert await state.engine.abort_requests(["long", "unknown"]) == 1
        return outputs

    outputs = asyncio.run(main())
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    assert len(outputs[-1].outputs[0].token_ids) < 120


def test_serve_enable_scale_out_for_real_with_abort(launch_server, folder, reference):
    """``pagedllm serve --enable-scale-out`` (the engine in its own process): the route answers as
    offline, ``/inference/v1/abort_requests`` ends a running request (finish reason "abort"); a
    server started without the flag has no such route."""
    flags = ["--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "128",
             "--kv-cache-memory-bytes", "4MiB", "--seed", "0"]
    server = launch_server(["serve", folder, *flags, "--enable-scale-out"], "scale_out",
                           module="pagedllm.entrypoints.cli")
    r = httpx.post(server.url + "/inference/v1/generate", timeout=60, json={
        "token_ids": PROMPT, "sampling_params": {"temperature": 0, "max_tokens": 10, "ignore_eos": True}})
    assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == reference[0]

    async def abort_one():
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as http:
            return await _stream_then_abort(http)

    reason, tokens = asyncio.run(abort_one())
    assert reason == "abort" and tokens < 120
    assert server.metric("pagedllm:num_requests_running") == 0
    plain = launch_server(["serve", folder, *flags], "no_scale_out", module="pagedllm.entrypoints.cli")
    assert httpx.post(plain.url + "/inference/v1/generate", json={"token_ids": PROMPT}, timeout=30).status_code == 404
