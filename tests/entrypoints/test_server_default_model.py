"""End to end against the real default model (Gemma 3 270M) served by
``python -m pagedllm.entrypoints.openai.api_server``, with the official openai client and raw HTTP:
completions and chat, streaming or not, n=2, stop strings, logprobs, seeds, include_usage, client
disconnects (blocks return in /metrics), 32 concurrent streaming clients, parity with LLM.generate,
and a graceful SIGTERM."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import pytest

from pagedllm import SamplingParams
from pagedllm.entrypoints.chat_utils import GEMMA_CHAT_TEMPLATE_PATH, load_chat_template
from pagedllm.entrypoints.openai.serving_engine import readable_token

GEMMA_TEMPLATE = str(GEMMA_CHAT_TEMPLATE_PATH)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

KEY = "env-key"
MAX_MODEL_LEN = 512
PROMPTS = ["Hello, my name is", "The capital of France is", "The future of AI is",
           "def fibonacci(n):", "Paged attention splits the KV cache into"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
# The conformance issue's input: "<bos>Hello world " and then 3 of the 4 bytes of "𝔞" (F0 9D 94 9E).
TAIL_PROMPT = [2, 9259, 1902, 236743, 478, 395, 386]


def sse(lines) -> list:
    """SSE ``data:`` lines -> JSON objects, with the final ``[DONE]`` kept as a string."""
    events = []
    for line in lines:
        if line:
            assert line.startswith("data: "), line
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


@pytest.fixture(scope="module")
def offline_expected(free_memory):
    """``LLM.generate`` / ``LLM.chat`` results the server must reproduce, computed before the server
    starts and with the offline engine freed again, so that the test process and the server never
    hold the model at the same time (the suite's peak memory)."""
    from pagedllm import LLM, SamplingParams

    llm = LLM(None, dtype="float32", max_model_len=MAX_MODEL_LEN, kv_cache_memory_bytes=64 << 20)
    params = SamplingParams(temperature=0.0, max_tokens=12)
    tok = llm.get_tokenizer()
    last = tok.backend.token_to_id("<0x9E>")
    expected = {"generate": llm.generate(PROMPTS[:3], params, use_tqdm=False),
                "chat": llm.chat(CHAT, params, use_tqdm=False, chat_template=GEMMA_TEMPLATE)[0],
                "tokenizer": tok,
                "prompt_tail": llm.generate([TAIL_PROMPT], SamplingParams(temperature=0.0, max_tokens=1,
                                                                          allowed_token_ids=[last]),
                                            use_tqdm=False)[0]}
    del llm
    free_memory()
    return expected


@pytest.fixture(scope="module")
def server(launch_server, offline_expected):
    args = ["--dtype", "float32", "--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-memory-bytes", "256MiB",
            "--chat-template", GEMMA_TEMPLATE, "--disable-log-requests",
            "--trust-request-chat-template"]   # the tools test sends the gemma-tools template
    # The API key comes from the environment here (PAGEDLLM_API_KEY).
    return launch_server(args, "default_server", env={"PAGEDLLM_API_KEY": KEY})


@pytest.fixture(scope="module")
def model_name(server):
    return httpx.get(server.base_url + "/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]["id"]


@pytest.fixture(scope="module")
def client(server):
    return server.client(api_key=KEY)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=300) as c:
        yield c


def test_models_and_health(server, http, model_name):
    assert model_name == "gemma-3-270m-q4_k_m"
    card = http.get("/v1/models").json()["data"][0]
    assert card["max_model_len"] == MAX_MODEL_LEN and card["root"].endswith(".gguf")
    assert http.get("/health").status_code == 200
    assert http.get("/version").json()["version"]
    assert httpx.get(server.base_url + "/models").status_code == 401  # key from $PAGEDLLM_API_KEY


def test_greedy_completion_equals_llm_generate(client, model_name, offline_expected):
    expected = offline_expected["generate"]
    response = client.completions.create(model=model_name, prompt=PROMPTS[:3], max_tokens=12, temperature=0)
    assert response.object == "text_completion" and response.id.startswith("cmpl-")
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert [c.text for c in response.choices] == [e.outputs[0].text for e in expected]
    assert response.usage.prompt_tokens == sum(len(e.prompt_token_ids) for e in expected)
    assert response.usage.completion_tokens == sum(len(e.outputs[0].token_ids) for e in expected)
    # Token-id prompts give the same result.
    by_ids = client.completions.create(model=model_name, prompt=expected[0].prompt_token_ids, max_tokens=12,
                                       temperature=0)
    assert by_ids.choices[0].text == expected[0].outputs[0].text


def test_chat_greedy_equals_llm_chat(client, model_name, offline_expected):
    expected = offline_expected["chat"]
    response = client.chat.completions.create(model=model_name, messages=CHAT, max_completion_tokens=12,
                                              temperature=0)
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    choice = response.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content == expected.outputs[0].text
    assert choice.finish_reason == expected.outputs[0].finish_reason
    assert response.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_completion_stream_equals_non_stream(client, model_name, http):
    full = client.completions.create(model=model_name, prompt=PROMPTS[1], max_tokens=10, temperature=0)
    chunks = list(client.completions.create(model=model_name, prompt=PROMPTS[1], max_tokens=10, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all(c.id == chunks[0].id and c.object == "text_completion" for c in chunks)
    # Raw SSE framing: data: lines, blank separators, a final [DONE].
    body = {"model": model_name, "prompt": PROMPTS[1], "max_tokens": 3, "temperature": 0, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        raw = response.read().decode()
    assert raw.endswith("data: [DONE]\n\n")
    assert all(block.startswith("data: ") for block in raw.strip().split("\n\n"))


def test_chat_stream_role_first_then_content(client, model_name):
    full = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=10, temperature=0)
    chunks = list(client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=10, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.choices[0].delta.role is None for c in chunks[1:-1])
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    content = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert content == full.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == full.choices[0].finish_reason
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == full.usage.completion_tokens
    assert usage_chunk.usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_include_usage_completion(client, model_name):
    chunks = list(client.completions.create(model=model_name, prompt=PROMPTS[:2], max_tokens=5, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == []
    usage = chunks[-1].usage
    assert usage.completion_tokens == 10 and usage.total_tokens == usage.prompt_tokens + 10
    assert {c.choices[0].index for c in chunks[:-1]} == {0, 1}


def test_n2_and_seed_reproducibility(client, model_name):
    kwargs = dict(model=model_name, prompt=PROMPTS[2], max_tokens=8, temperature=1.0, n=2, seed=1234)
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1]
    assert [c.text for c in first.choices] == [c.text for c in second.choices]
    other = client.completions.create(**{**kwargs, "seed": 99})
    assert [c.text for c in other.choices] != [c.text for c in first.choices]
    streamed = list(client.completions.create(**kwargs, stream=True))
    texts = ["".join(c.choices[0].text for c in streamed if c.choices[0].index == i) for i in (0, 1)]
    assert texts == [c.text for c in first.choices]
    chat = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=6, temperature=1.0, n=2,
                                          seed=7)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.usage.completion_tokens <= 12


def test_stop_strings(client, model_name):
    full = client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=12, temperature=0).choices[0].text
    stop = full.strip().split()[1]  # a word from the middle of the greedy text
    cut = full[:full.index(stop)]
    response = client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                         stop=[stop])
    choice = response.choices[0]
    assert choice.text == cut and choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop
    kept = client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=12, temperature=0, stop=stop,
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == cut + stop
    streamed = list(client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                              stop=[stop], stream=True))
    assert "".join(c.choices[0].text for c in streamed) == cut
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs_and_echo(client, model_name):
    response = client.completions.create(model=model_name, prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=3)
    lp = response.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == response.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(6)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 3 <= len(top) <= 4 and token in top
        assert top[token] == pytest.approx(logprob)
        assert max(top.values()) == pytest.approx(logprob)  # greedy picks the most likely token
    echo = client.completions.create(model=model_name, prompt=PROMPTS[1], max_tokens=2, temperature=0, echo=True,
                                     logprobs=1)
    choice = echo.choices[0]
    assert choice.text.startswith(PROMPTS[1])
    n_prompt = echo.usage.prompt_tokens
    assert len(choice.logprobs.tokens) == n_prompt + 2
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert all(v is not None for v in choice.logprobs.token_logprobs[1:])
    streamed = list(client.completions.create(model=model_name, prompt=PROMPTS[1], max_tokens=6, temperature=0,
                                              logprobs=3, stream=True))
    assert sum((c.choices[0].logprobs.tokens for c in streamed), []) == lp.tokens


def test_chat_logprobs(client, model_name):
    response = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=5, temperature=0,
                                              logprobs=True, top_logprobs=2)
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].token == item.token  # greedy: the sampled token ranks first
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)
        assert readable_token(bytes(item.bytes)) == item.token
    streamed = list(client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=5, temperature=0,
                                                   logprobs=True, top_logprobs=2, stream=True))
    tokens = [t.token for c in streamed[1:] if c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert tokens == [t.token for t in content]


def test_stream_never_splits_multibyte_characters(client, model_name):
    prompt = "Emoji and CJK: 😀🚀✨ 你好，世界！ 日本語のテキスト 😀🚀✨ 你好"
    kwargs = dict(model=model_name, prompt=prompt, max_tokens=16, temperature=0)
    full = client.completions.create(**kwargs).choices[0].text
    deltas = [c.choices[0].text for c in client.completions.create(**kwargs, stream=True)]
    assert "".join(deltas) == full
    assert all("\ufffd" not in d for d in deltas) or "\ufffd" in full


def test_greedy_logit_bias_and_allowed_tokens(client, model_name, http):
    ids = http.post("/tokenize", json={"prompt": " Paris", "add_special_tokens": False}).json()["tokens"]
    response = client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=3, temperature=0,
                                         logit_bias={str(ids[0]): 100})
    assert response.choices[0].text.startswith(" Paris")
    only = client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=3, temperature=0,
                                     extra_body={"allowed_token_ids": ids[:1]})
    assert only.choices[0].text == " Paris" * 3


def test_client_disconnect_frees_blocks(server, http, model_name):
    total = server.metric("pagedllm:num_total_blocks")
    aborts = server.metric("pagedllm:request_success_total", finished_reason="abort")
    body = {"model": model_name, "prompt": PROMPTS[3], "max_tokens": 400, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        lines = response.iter_lines()  # (closing this iterator would already close the connection)
        events = [line for line in (next(lines) for _ in range(8)) if line]
        assert len(events) == 4 and all(e.startswith("data: {") for e in events)
        assert server.metric("pagedllm:num_free_blocks") < total  # the request holds blocks now
        assert server.metric("pagedllm:num_requests_running") == 1
    deadline = time.monotonic() + 30
    while server.metric("pagedllm:num_free_blocks") != total:
        assert time.monotonic() < deadline, "blocks did not return after the client disconnected"
        time.sleep(0.2)
    assert server.metric("pagedllm:request_success_total", finished_reason="abort") == aborts + 1
    assert server.metric("pagedllm:num_requests_running") == 0
    # Non-streaming request whose client gives up.
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/completions", json={**body, "stream": False}, timeout=2.0)
    deadline = time.monotonic() + 30
    while server.metric("pagedllm:request_success_total", finished_reason="abort") != aborts + 2:
        assert time.monotonic() < deadline, "non-streaming request was not aborted after the disconnect"
        time.sleep(0.2)
    assert server.metric("pagedllm:num_free_blocks") == total


def test_32_concurrent_streaming_clients_equal_sequential(server, model_name):
    prompts = [f"Question {i}: what is {i} plus {2 * i}? Answer:" if i % 2 else f"{PROMPTS[i % 5]} {i}"
               for i in range(32)]
    kwargs = dict(model=model_name, max_tokens=8, temperature=0)

    async def one(client, prompt):
        text, finish = "", None
        async for chunk in await client.completions.create(prompt=prompt, stream=True, **kwargs):
            text += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        return text, finish

    async def run_all():
        async with server.async_client(api_key=KEY) as client:
            return await asyncio.gather(*[one(client, p) for p in prompts])

    running_before = server.metric("pagedllm:iteration_tokens_total_count")
    concurrent = asyncio.run(run_all())
    sequential = []
    client = server.client(api_key=KEY)
    for prompt in prompts:
        choice = client.completions.create(prompt=prompt, **kwargs).choices[0]
        sequential.append((choice.text, choice.finish_reason))
    assert concurrent == sequential
    assert server.metric("pagedllm:iteration_tokens_total_count") > running_before
    metrics = server.metrics()
    assert metrics["pagedllm:time_to_first_token_seconds_count"] >= 64
    assert metrics["pagedllm:e2e_request_latency_seconds_count"] >= 64


def test_metrics_exposition(server):
    metrics = server.metrics()
    for name in ("pagedllm:num_requests_running", "pagedllm:num_requests_waiting", "pagedllm:kv_cache_usage_perc",
                 "pagedllm:num_free_blocks", "pagedllm:num_total_blocks", "pagedllm:num_preemptions_total",
                 "pagedllm:prompt_tokens_total", "pagedllm:generation_tokens_total",
                 "pagedllm:time_to_first_token_seconds_count", "pagedllm:inter_token_latency_seconds_count",
                 "pagedllm:e2e_request_latency_seconds_count", "pagedllm:iteration_tokens_total_count"):
        assert name in metrics, name
    assert metrics["pagedllm:generation_tokens_total"] > 0
    assert server.metric("pagedllm:request_success_total", finished_reason="length") > 0
    assert server.metric("pagedllm:request_success_total", finished_reason="stop") > 0
    assert metrics["pagedllm:kv_cache_usage_perc"] == 0.0
    assert not [name for name in metrics if "_created" in name]


def test_prompt_ending_inside_a_character(client, model_name, offline_expected):
    prompt = TAIL_PROMPT
    tok = offline_expected["tokenizer"]
    assert tok.convert_ids_to_tokens(prompt[-3:]) == ["<0xF0>", "<0x9D>", "<0x94>"]
    response = client.completions.create(model=model_name, prompt=prompt, max_tokens=1, temperature=0)
    assert response.usage.completion_tokens == 1
    token = response.choices[0].text
    assert "Hello" not in token and "world" not in token and "\ufffd" not in token
    last = tok.backend.token_to_id("<0x9E>")
    kwargs = dict(model=model_name, prompt=prompt, max_tokens=1, temperature=0,
                  extra_body={"allowed_token_ids": [last]})
    assert client.completions.create(**kwargs).choices[0].text == "𝔞"
    assert "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True)) == "𝔞"
    assert client.completions.create(**kwargs, echo=True).choices[0].text == "<bos>Hello world 𝔞"
    assert offline_expected["prompt_tail"].outputs[0].text == "𝔞"


def test_byte_fallback_tokens_in_chat_logprobs(client, model_name, offline_expected):
    tok = offline_expected["tokenizer"]
    byte_ids = [tok.backend.token_to_id(f"<0x{b:02X}>") for b in "𝔞".encode()]
    response = client.chat.completions.create(model=model_name, messages=CHAT, max_tokens=4, temperature=0,
                                              logprobs=True, top_logprobs=2,
                                              extra_body={"allowed_token_ids": byte_ids})
    content = response.choices[0].logprobs.content
    assert len(content) == 4
    for item in content:
        assert len(item.bytes) == 1 and item.bytes[0] in "𝔞".encode()
        assert item.token == f"bytes:\\x{item.bytes[0]:02x}"
    # The alternatives come from the raw distribution (any token): each names its exact bytes.
    for item in (t for c in content for t in c.top_logprobs):
        assert item.token == readable_token(bytes(item.bytes))


def test_issue_inputs_echo_max_tokens_zero_and_empty_prompt(http, model_name):
    body = {"model": model_name, "prompt": "Your answer: Yes", "max_tokens": 0, "echo": True, "logprobs": 1,
            "temperature": 0}
    data = http.post("/v1/completions", json=body).json()
    choice = data["choices"][0]
    assert choice["text"] == "Your answer: Yes" and choice["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == 0
    lp = choice["logprobs"]
    assert lp["tokens"][0] == "<bos>" and "".join(lp["tokens"][1:]) == "Your answer: Yes"
    assert lp["token_logprobs"][0] is None and all(v < 0 for v in lp["token_logprobs"][1:])
    assert len(lp["tokens"]) == data["usage"]["prompt_tokens"]
    # "" is [<bos>] on both routes.
    assert http.post("/tokenize", json={"prompt": ""}).json()["tokens"] == [2]
    empty = http.post("/v1/completions", json={"model": model_name, "prompt": "", "max_tokens": 2}).json()
    assert empty["usage"]["prompt_tokens"] == 1 and empty["usage"]["completion_tokens"] >= 1


# -- structured output and tools with the real clients (issue 17) ---------------------------------

def test_openai_parse_instructor_json_and_required_tool_round_trip(server, client, model_name):
    """``chat.completions.parse`` and instructor's JSON-schema mode each return a validated
    pydantic object from the default model; a ``tool_choice="required"`` call goes back with its
    result for a second turn."""
    import instructor
    import pydantic

    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        country: str = pydantic.Field(max_length=20)
        population_millions: float = pydantic.Field(ge=0, le=40)

    messages = [{"role": "user", "content": "Describe Paris as JSON."}]
    parsed = client.chat.completions.parse(model=model_name, messages=messages, response_format=City,
                                           temperature=1.0, seed=1, max_tokens=80)
    assert parsed.choices[0].finish_reason == "stop"
    assert isinstance(parsed.choices[0].message.parsed, City)

    patched = instructor.from_openai(server.client(api_key=KEY), mode=instructor.Mode.JSON_SCHEMA)
    city = patched.chat.completions.create(model=model_name, messages=messages, response_model=City,
                                           max_retries=0, temperature=1.0, seed=2, max_tokens=80)
    assert isinstance(city, City)

    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
        "additionalProperties": False}}}
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    # One call (parallel_tool_calls=False): a sampled array of calls can run past max_tokens.
    first = client.chat.completions.create(model=model_name, messages=ask, tools=[weather], tool_choice="required",
                                           parallel_tool_calls=False, temperature=1.0, seed=3, max_tokens=60)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = choice.message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    for c in calls:
        assert set(json.loads(c.function.arguments)) == {"city"}
    # The call and its result go back as OpenAI messages; the tool-aware template renders them.
    follow = ask + [choice.message.model_dump(exclude_none=True)] + [
        {"role": "tool", "tool_call_id": c.id, "content": "18 C, sunny"} for c in calls]
    second = client.chat.completions.create(model=model_name, messages=follow, tools=[weather], tool_choice="none",
                                            temperature=0.0, max_tokens=16,
                                            extra_body={"chat_template": load_chat_template("gemma-tools")})
    assert second.usage.prompt_tokens > first.usage.prompt_tokens
    assert second.choices[0].message.content and not second.choices[0].message.tool_calls


# Stops the module's server: keep it the last test of this file.
def test_graceful_shutdown_finishes_in_flight_stream(server, model_name):
    """SIGTERM while a stream runs: the stream completes, then the process exits with status 0."""
    lines: list[str] = []
    started = threading.Event()

    def stream():
        body = {"model": model_name, "prompt": PROMPTS[2], "max_tokens": 30, "temperature": 0, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=300,
                          headers={"Authorization": f"Bearer {KEY}"}) as response:
            for line in response.iter_lines():
                if line:
                    lines.append(line)
                    started.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert started.wait(120)
    server.proc.send_signal(signal.SIGTERM)
    thread.join(300)
    events = sse(lines)
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"][0]["finish_reason"] == "length"
    assert sum(1 for e in events[:-1] if e["choices"][0]["text"]) >= 20
    assert server.proc.wait(120) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=5)
