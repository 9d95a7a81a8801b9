"""vLLM's RL routes ``/pause`` ``/resume`` ``/is_paused`` and the default model's ``"default"``
name (issue 28: vLLM's example scripts run unchanged). The app in-process on a tiny checkpoint,
driven through the openai client; the engine in this process and in its own (``pagedllm serve``'s
default)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import httpx
import openai
import pytest

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.openai.api_server import build_app, build_state, default_served_model_names


@pytest.fixture(scope="module", params=[False, pytest.param(True, marks=pytest.mark.multiprocess)],
                ids=["in-process", "engine-process"])
def state(request, make_tiny_checkpoint):
    args = EngineArgs(model=make_tiny_checkpoint("llama"), dtype="float32", max_model_len=256,
                      kv_cache_memory_bytes=8 << 20, seed=0)
    st = build_state(args, ["tiny"], log_stats_interval_s=None, engine_process=request.param)
    yield st
    st.engine.shutdown()


def run_with_clients(state, coro_fn):
    async def main():
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=60) as http:
            client = openai.AsyncOpenAI(api_key="EMPTY", base_url="http://test/v1", http_client=http, max_retries=0)
            return await coro_fn(http, client)
    return asyncio.run(main())


def test_pause_keep_holds_requests_until_resume(state):
    async def calls(http, client):
        paused = await http.post("/pause", params={"mode": "keep"})
        is_paused = (await http.get("/is_paused")).json()
        task = asyncio.ensure_future(client.completions.create(
            model="tiny", prompt="The quick brown fox", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}))
        await asyncio.sleep(0.5)
        held = not task.done()
        resumed = await http.post("/resume")
        return paused, is_paused, held, resumed, await task, (await http.get("/is_paused")).json()

    paused, is_paused, held, resumed, completion, after = run_with_clients(state, calls)
    assert paused.status_code == 200 and paused.json() == {"status": "paused"}
    assert is_paused == {"is_paused": True} and held
    assert resumed.json() == {"status": "resumed"} and after == {"is_paused": False}
    assert completion.usage.completion_tokens == 12 and completion.choices[0].finish_reason == "length"


def test_pause_abort_refuses_requests_with_503_until_resume(state):
    async def calls(http, client):
        # Frozen first (keep mode), so that the request is surely unfinished when the abort comes.
        await http.post("/pause", params={"mode": "keep"})
        long = asyncio.ensure_future(client.completions.create(
            model="tiny", prompt="Once upon a time", max_tokens=220, temperature=0, extra_body={"ignore_eos": True}))
        await asyncio.sleep(0.3)
        paused = await http.post("/pause")                       # vLLM's default mode: abort
        done = await long
        aborted = (done.choices[0].finish_reason, done.usage.completion_tokens)
        with pytest.raises(openai.APIStatusError) as refused:
            await client.completions.create(model="tiny", prompt="hi", max_tokens=2)
        await http.post("/resume")
        ok = await client.completions.create(model="tiny", prompt="hi", max_tokens=2, temperature=0,
                                             extra_body={"ignore_eos": True})
        return paused, aborted, refused.value, ok

    paused, aborted, refused, ok = run_with_clients(state, calls)
    assert paused.json() == {"status": "paused"}
    assert aborted[0] == "abort" and aborted[1] < 220, aborted
    assert refused.status_code == 503
    body = refused.response.json()["error"]
    assert set(body) == {"message", "type", "param", "code"} and "paused" in body["message"]
    assert ok.usage.completion_tokens == 2


def test_pause_with_a_bad_mode_is_a_400_naming_mode(state):
    async def calls(http, client):
        return await http.post("/pause", params={"mode": "freeze"}), (await http.get("/is_paused")).json()

    bad, is_paused = run_with_clients(state, calls)
    assert bad.status_code == 400
    error = bad.json()["error"]
    assert error["param"] == "mode" and "freeze" in error["message"] and error["type"] == "invalid_request_error"
    assert is_paused == {"is_paused": False}


def test_the_default_model_is_served_also_as_default():
    files = SimpleNamespace(gguf_path="/cache/gemma-3-270m-q4_k_m.gguf", folder="/cache/x")
    assert default_served_model_names(EngineArgs(model="default"), files) == ["gemma-3-270m-q4_k_m", "default"]
    assert default_served_model_names(EngineArgs(model=None), files) == ["gemma-3-270m-q4_k_m", "default"]
    assert default_served_model_names(EngineArgs(model="/models/tiny"), files) == ["/models/tiny"]


# -- /v1/chat/completions/batch ---------------------------------------------------------------

@pytest.fixture(scope="module")
def chat_state(make_tiny_checkpoint):
    args = EngineArgs(model=make_tiny_checkpoint("llama"), dtype="float32", max_model_len=256,
                      kv_cache_memory_bytes=8 << 20, seed=0)
    st = build_state(args, ["tiny"], chat_template="{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                     "{% endfor %}assistant:", log_stats_interval_s=None)
    yield st
    st.engine.shutdown()


CONVERSATIONS = [[{"role": "user", "content": "What is the capital of France?"}],
                 [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
                 [{"role": "user", "content": "Count to three."}]]


def test_batch_chat_answers_each_conversation_as_chat_completions_does(chat_state):
    params = {"max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 2}

    async def calls(http, client):
        singles = [await client.chat.completions.create(model="tiny", messages=c, max_tokens=5, temperature=0,
                                                        logprobs=True, top_logprobs=2,
                                                        extra_body={"ignore_eos": True})
                   for c in CONVERSATIONS]
        batch = await http.post("/v1/chat/completions/batch",
                                json={"model": "tiny", "messages": CONVERSATIONS, **params})
        return singles, batch

    singles, batch = run_with_clients(chat_state, calls)
    assert batch.status_code == 200
    body = batch.json()
    assert body["object"] == "chat.completion" and body["model"] == "tiny" and body["id"].startswith("chatcmpl-")
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    for choice, single in zip(body["choices"], singles):
        assert choice["message"]["content"] == single.choices[0].message.content
        assert choice["finish_reason"] == "length"
        assert [t["token"] for t in choice["logprobs"]["content"]] == \
            [t.token for t in single.choices[0].logprobs.content]
    assert body["usage"]["prompt_tokens"] == sum(s.usage.prompt_tokens for s in singles)
    assert body["usage"]["completion_tokens"] == 15 and body["usage"]["total_tokens"] == \
        body["usage"]["prompt_tokens"] + 15


def test_batch_chat_refuses_what_it_cannot_do_with_400s(chat_state):
    one = [CONVERSATIONS[0]]
    cases = [({"messages": one, "stream": True}, "stream"), ({"messages": one, "n": 2}, "n"),
             ({"messages": one, "use_beam_search": True}, "use_beam_search"),
             ({"messages": one, "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
             ({"messages": [CONVERSATIONS[0], []]}, "messages"),
             ({"messages": one, "temperature": -1}, "temperature")]

    async def calls(http, client):
        answers = [await http.post("/v1/chat/completions/batch", json={"model": "tiny", **body})
                   for body, _ in cases]
        empty = await http.post("/v1/chat/completions/batch", json={"model": "tiny", "messages": []})
        unknown = await http.post("/v1/chat/completions/batch", json={"model": "nope", "messages": one})
        return answers, empty, unknown

    answers, empty, unknown = run_with_clients(chat_state, calls)
    for (body, field), answer in zip(cases, answers):
        assert answer.status_code == 400, (field, answer.text)
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["param"] == field, (field, error)
    assert empty.status_code == 400 and "messages" in empty.text
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    kv = chat_state.engine.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.num_blocks
