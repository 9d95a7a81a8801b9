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


def test_conversation_turns_are_sent_in_order_and_hit_rate_comes_from_usage():
    from pagedllm.benchmarks.serving import prefix_cache_hit_rate

    log = []

    async def handle_async(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "m"}]})
        body = json.loads(request.content)
        log.append(("start", body["prompt"]))
        await asyncio.sleep(0.01)
        log.append(("end", body["prompt"]))
        cached = 4 * (len(body["prompt"]) // 8)
        chunks = [{"choices": [{"index": 0, "text": "x"}]},
                  {"choices": [], "usage": {"prompt_tokens": len(body["prompt"]), "completion_tokens": 1,
                                            "prompt_tokens_details": {"cached_tokens": cached}}}]
        return httpx.Response(200, content=_sse(chunks), headers={"content-type": "text/event-stream"})

    reqs = [BenchRequest([1] * 8, 8, 1, conversation_id=0), BenchRequest([2] * 8, 8, 1, conversation_id=1),
            BenchRequest([1] * 16, 16, 1, conversation_id=0), BenchRequest([2] * 16, 16, 1, conversation_id=1)]
    records, _, _ = _run(reqs, handle_async)
    # Turn 2 of a conversation starts only after its turn 1 ended; the two users overlap.
    for conv in (1, 2):
        prompts = [p for _, p in log if p[0] == conv]
        assert len(prompts) == 4
        first_end = log.index(("end", [conv] * 8))
        assert log.index(("start", [conv] * 16)) > first_end
    assert log[0][0] == log[1][0] == "start"
    assert [r.num_cached_tokens for r in records] == [4, 4, 8, 8]
    assert prefix_cache_hit_rate(records) == 24 / 48
    assert prefix_cache_hit_rate([records[0].__class__(8, 1, 0.0, 0.1, 0.1)]) is None
