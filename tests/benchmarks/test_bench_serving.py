"""The serving client against a mock OpenAI server (httpx MockTransport, no sockets)."""

from __future__ import annotations

import asyncio
import json

import httpx

from pagedllm.benchmarks.datasets import BenchRequest
from pagedllm.benchmarks.metrics import summarize
from pagedllm.benchmarks.serving import run_requests


def _sse(chunks) -> bytes:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n"


def _handler(seen: list, with_usage: bool = True):
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "mock-model"}]})
        body = json.loads(request.content)
        seen.append(body)
        if body["prompt"] == "fail":
            return httpx.Response(400, json={"error": {"message": "bad prompt"}})
        n = body["max_tokens"]
        chunks = [{"choices": [{"index": 0, "text": f"t{i}"}]} for i in range(n)]
        if with_usage:
            chunks.append({"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": n}})
        return httpx.Response(200, content=_sse(chunks), headers={"content-type": "text/event-stream"})
    return handle


def _run(requests, handler, **kw):
    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
            return await run_requests("http://mock", None, requests, client=client, **kw)
    return asyncio.run(go())


def test_streaming_records_and_payload():
    seen = []
    reqs = [BenchRequest("hello", 2, 4), BenchRequest([1, 2, 3], 3, 1), BenchRequest("fail", 1, 2)]
    records, duration, model = _run(reqs, _handler(seen), max_concurrency=2)
    assert model == "mock-model" and duration > 0
    assert [r.success for r in records] == [True, True, False]
    assert "HTTP 400" in records[2].error
    assert records[0].output_len == 4 and len(records[0].token_times) == 4 and records[0].prompt_len == 7
    assert records[1].output_len == 1 and records[1].tpot is None
    body = seen[0]
    assert body["model"] == "mock-model" and body["stream"] is True and body["ignore_eos"] is True
    assert body["temperature"] == 0.0 and body["stream_options"] == {"include_usage": True}
    assert seen[1]["prompt"] == [1, 2, 3]
    s = summarize(records, duration, itl=True, goodput_slos={"ttft": 10.0})
    assert s["num_requests"] == 2 and s["num_failed"] == 1 and s["num_output_tokens"] == 5
    assert s["p50_itl_s"] is not None and s["goodput_requests_per_s"] == s["requests_per_s"]


def test_counts_chunks_without_usage_and_can_skip_ignore_eos():
    seen = []
    records, _, _ = _run([BenchRequest("hi", 1, 3)], _handler(seen, with_usage=False), ignore_eos=False,
                         request_rate=100.0)
    assert records[0].output_len == 3 and records[0].prompt_len == 1
    assert "ignore_eos" not in seen[0]
