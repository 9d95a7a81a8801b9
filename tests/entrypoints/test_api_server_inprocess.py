"""The FastAPI app in-process (httpx ASGI transport) on a tiny checkpoint: a failing engine step
answers 500 (or an error event mid-stream) and the server keeps serving."""

from __future__ import annotations

import json

import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.openai.api_server import build_state


@pytest.fixture(scope="module")
def state(make_tiny_checkpoint):
    args = EngineArgs(model=make_tiny_checkpoint("qwen2"), dtype="float32", max_model_len=128,
                      kv_cache_memory_bytes=4 << 20, seed=0)
    st = build_state(args, ["tiny"], chat_template=None, log_stats_interval_s=None)
    yield st
    st.engine.shutdown()


def test_failing_step_gives_500_then_server_recovers(asgi_run, state, monkeypatch):
    runner = state.engine.engine.executor.driver_worker.model_runner
    real = runner.execute_model
    failures = {"left": 1}

    def flaky(sched_out):
        if failures["left"]:
            failures["left"] -= 1
            raise RuntimeError("injected kernel failure")
        return real(sched_out)

    monkeypatch.setattr(runner, "execute_model", flaky)
    body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}

    async def calls(client):
        failed = await client.post("/v1/completions", json=body)
        ok = await client.post("/v1/completions", json=body)
        failures["left"] = 1
        streamed = await client.post("/v1/completions", json={**body, "stream": True})
        after = await client.post("/v1/completions", json=body)
        return failed, ok, streamed, after

    failed, ok, streamed, after = asgi_run(state, calls)
    assert failed.status_code == 500
    error = failed.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "server_error" and "injected kernel failure" in error["message"]
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
    # Mid-stream failure: an error event, then [DONE], status already 200.
    assert streamed.status_code == 200
    events = [line[len("data: "):] for line in streamed.text.splitlines() if line]
    assert events[-1] == "[DONE]"
    assert "injected kernel failure" in json.loads(events[-2])["error"]["message"]
    assert after.status_code == 200
    kv = state.engine.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks


def test_model_without_chat_template_gets_400(asgi_run, state):
    async def call(client):
        return await client.post("/v1/chat/completions",
                                 json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}]})
    response = asgi_run(state, call)
    assert response.status_code == 400
    assert "no chat template" in response.json()["error"]["message"]
    assert "--chat-template" in response.json()["error"]["message"]


@pytest.mark.multiprocess   # spawns the engine-core process
def test_engine_process_serves_and_logs_its_stats_line(asgi_run, make_tiny_checkpoint, caplog):
    """``pagedllm serve``'s default layout: the engine in its own process; the periodic stats
    line still comes (from the stats that arrive with the outputs) and the answers are the
    in-process engine's."""
    args = EngineArgs(model=make_tiny_checkpoint("qwen2"), dtype="float32", max_model_len=128,
                      kv_cache_memory_bytes=4 << 20, seed=0)
    body = {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    texts = []
    for engine_process in (False, True):
        st = build_state(args, ["tiny"], chat_template=None, log_stats_interval_s=0.01, engine_process=engine_process)
        try:
            assert (type(st.engine).__name__ == "DPAsyncLLM") == engine_process

            async def calls(client):
                return [(await client.post("/v1/completions", json=body)).json() for _ in range(3)]

            with caplog.at_level("INFO", logger="pagedllm"):
                caplog.clear()
                answers = asgi_run(st, calls)
            texts.append([a["choices"][0]["text"] for a in answers])
            assert any("Avg prompt throughput" in r.getMessage() for r in caplog.records), engine_process
        finally:
            st.engine.shutdown()
    assert texts[0] == texts[1]
