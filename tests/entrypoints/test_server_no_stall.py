"""No one client stalls the others (issue 26): tokenizing and chat-template rendering run in the
server's thread pool, so the event loop answers ``/health`` while they run; a body over
``--max-request-body-bytes`` is a 413 (declared or chunked); a request ``chat_template`` is a 400
unless ``--trust-request-chat-template``; with ``--api-key`` the compute routes need the key.

In-process (httpx ASGI transport) for the loop checks, a real ``pagedllm serve`` for the HTTP ones."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import threading
import time

import httpx
import pytest
from error_utils import assert_error

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.chat_utils import load_chat_template
from pagedllm.entrypoints.openai.api_server import DEFAULT_MAX_REQUEST_BODY_BYTES, build_state
from pagedllm.tokenizer import _GIL_FREE_MIN_CHARS, _GIL_FREE_MIN_IDS

pytestmark = pytest.mark.timeout(600)

KEY = "no-stall-key"
LIMIT = 64 << 10   # --max-request-body-bytes of the real server below
TEMPLATE = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
MESSAGES = [{"role": "user", "content": "The quick brown fox"}]


def engine_args(path: str) -> EngineArgs:
    return EngineArgs(model=path, dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 << 20, seed=0)


@pytest.fixture(scope="module")
def tiny_path(make_tiny_checkpoint):
    return make_tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def state(tiny_path):
    """The server's handlers in this process; trusts request templates (the tiny model has none)."""
    st = build_state(engine_args(tiny_path), ["tiny"], chat_template=load_chat_template("gemma"),
                     log_stats_interval_s=None, trust_request_chat_template=True)
    yield st
    st.engine.shutdown()
    st.pool.shutdown()


# -- the event loop keeps answering ---------------------------------------------------------------

ROUTES = {
    "completion": ("/v1/completions", {"model": "tiny", "prompt": "The quick brown fox", "max_tokens": 2}),
    "chat": ("/v1/chat/completions", {"model": "tiny", "messages": MESSAGES, "max_tokens": 2}),
    "tokenize": ("/tokenize", {"prompt": "The quick brown fox"}),
    "tokenize_messages": ("/tokenize", {"messages": MESSAGES}),
    "detokenize": ("/detokenize", {"tokens": [5, 6, 7]}),
}


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_health_answers_while_a_request_is_tokenized(asgi_run, state, monkeypatch, route):
    """The tokenizer call of each route blocks in its thread until ``/health`` has been answered:
    the route's work runs in the pool (a thread of ``pagedllm-tokenize``), and the loop answered
    ``/health`` while that thread was busy. Tokenizing on the loop would block the loop in the
    wait, and ``/health`` could only answer after it (the wait then times out: False)."""
    tokenizer = state.engine.tokenizer
    method = "decode" if route == "detokenize" else "encode"
    real = getattr(tokenizer, method)
    health_answered = threading.Event()
    seen: dict = {}

    def gated(*args, **kwargs):
        if "thread" not in seen:
            seen["thread"] = threading.current_thread().name
            seen["health_answered_meanwhile"] = health_answered.wait(timeout=30)
        return real(*args, **kwargs)

    monkeypatch.setattr(tokenizer, method, gated)
    path, body = ROUTES[route]

    async def calls(client):
        slow = asyncio.create_task(client.post(path, json=body))
        while "thread" not in seen and not slow.done():
            await asyncio.sleep(0.005)
        health = await client.get("/health")
        health_answered.set()
        return health, await slow

    health, slow = asgi_run(state, calls)
    assert health.status_code == 200
    assert slow.status_code == 200, slow.text
    assert seen["thread"].startswith("pagedllm-tokenize"), seen
    assert seen["health_answered_meanwhile"] is True


def test_health_answers_during_a_multi_megabyte_tokenize(asgi_run, state, monkeypatch):
    """A real several-MB prompt (no gate): a ``/health`` sent after the tokenizer started is
    answered before the tokenizer finishes, so the tokenizer neither runs on the loop nor holds
    the GIL (``Tokenizer.encode`` takes the GIL-free batch call for long texts)."""
    tokenizer = state.engine.tokenizer
    real = tokenizer.encode
    times: dict[str, float] = {}

    def timed(text, *args, **kwargs):
        times["start"] = time.monotonic()
        try:
            return real(text, *args, **kwargs)
        finally:
            times["end"] = time.monotonic()

    monkeypatch.setattr(tokenizer, "encode", timed)
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9)))
             for _ in range(400_000)]
    prompt = " ".join(words)   # ~2.4 MB of words the tiny vocabulary mostly lacks: seconds of BPE
    assert len(prompt) > 2_000_000

    async def calls(client):
        big = asyncio.create_task(client.post("/tokenize", json={"prompt": prompt}))
        while "start" not in times and not big.done():
            await asyncio.sleep(0.002)
        sent = time.monotonic()
        statuses = []
        for _ in range(5):   # each sleep needs the GIL back: a tokenizer holding it would delay them all
            await asyncio.sleep(0.02)
            statuses.append((await client.get("/health")).status_code)
        answered = time.monotonic()
        return sent, statuses, answered, await big

    sent, statuses, answered, big = asgi_run(state, calls)
    assert big.status_code == 200 and big.json()["count"] > 100_000
    assert statuses == [200] * 5
    assert times["start"] <= sent and answered < times["end"], (times, sent, answered)


def test_gil_free_encode_and_decode_match_the_plain_calls(state):
    """Long inputs take the batch calls (which release the GIL); the ids and text are the same."""
    tokenizer = state.engine.tokenizer
    text = "Über café naïve — 你好，世界！ 😀 The quick brown fox. " * 400
    assert len(text) >= _GIL_FREE_MIN_CHARS
    for special in (True, False):
        ids = tokenizer.encode(text, add_special_tokens=special)
        assert ids == tokenizer.backend.encode(text, add_special_tokens=special).ids
    ids = ids * 4
    assert len(ids) >= _GIL_FREE_MIN_IDS
    for skip in (True, False):
        assert tokenizer.decode(ids, skip_special_tokens=skip) == \
            tokenizer.backend.decode(ids, skip_special_tokens=skip)


# -- a request chat_template when trusted ----------------------------------------------------------

def test_trusted_request_chat_template_is_rendered(asgi_run, state):
    async def calls(client):
        chat = await client.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES,
                                                                "chat_template": TEMPLATE, "max_tokens": 2})
        tokenized = await client.post("/tokenize", json={"messages": MESSAGES, "chat_template": TEMPLATE})
        via_kwargs = await client.post("/tokenize", json={"messages": MESSAGES,
                                                          "chat_template_kwargs": {"chat_template": TEMPLATE}})
        plain = await client.post("/tokenize", json={"prompt": "The quick brown fox\n", "add_special_tokens": False})
        return chat, tokenized, via_kwargs, plain

    chat, tokenized, via_kwargs, plain = asgi_run(state, calls)
    assert chat.status_code == 200, chat.text
    assert tokenized.status_code == 200 and via_kwargs.status_code == 200
    # The request's template, not the server's gemma one: the message text and a newline.
    assert tokenized.json()["tokens"] == via_kwargs.json()["tokens"] == plain.json()["tokens"]
    assert chat.json()["usage"]["prompt_tokens"] == plain.json()["count"]


def test_untrusted_request_chat_template_is_400_in_process(asgi_run, tiny_path):
    st = build_state(engine_args(tiny_path), ["tiny"], chat_template=load_chat_template("gemma"),
                     log_stats_interval_s=None)
    try:
        async def calls(client):
            return await client.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES,
                                                                    "chat_template": TEMPLATE, "max_tokens": 2})
        response = asgi_run(st, calls)
    finally:
        st.engine.shutdown()
        st.pool.shutdown()
    assert response.status_code == 400
    assert response.json()["error"]["param"] == "chat_template"


def test_max_request_body_bytes_is_checked(tiny_path):
    with pytest.raises(ValueError, match="max-request-body-bytes"):
        build_state(engine_args(tiny_path), ["tiny"], log_stats_interval_s=None, max_request_body_bytes=-1)


def test_serve_help_names_the_new_flags_and_defaults():
    out = subprocess.run([sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", "--help"], capture_output=True,
                         text=True, timeout=300, check=True).stdout
    flat = " ".join(out.split())
    assert "--trust-request-chat-template" in flat
    assert f"--max-request-body-bytes MAX_REQUEST_BODY_BYTES largest request body accepted, in bytes; a larger " \
           f"one is a 413 (default: {DEFAULT_MAX_REQUEST_BODY_BYTES} = 32 MiB" in flat
    assert "/tokenize, /detokenize, /reset_prefix_cache" in flat


# -- the real server: body limit, API key, untrusted templates -------------------------------------

@pytest.fixture(scope="module")
def server(launch_server, tiny_path):
    args = ["serve", tiny_path, "--served-model-name", "tiny", "--api-key", KEY, "--max-model-len", "128",
            "--kv-cache-memory-bytes", "4MiB", "--dtype", "float32", "--block-size", "4",
            "--max-request-body-bytes", str(LIMIT), "--chat-template", "gemma"]
    return launch_server(args, "no_stall_server", module="pagedllm.entrypoints.cli")


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as client:
        yield client


def tokenize_body(size: int) -> bytes:
    """A /tokenize JSON body of exactly ``size`` bytes (padded with JSON whitespace)."""
    body = json.dumps({"model": "tiny", "prompt": "The quick brown fox"}).encode()
    return body[:-1] + b" " * (size - len(body)) + b"}"


def chunks(data: bytes, size: int = 4096):
    for i in range(0, len(data), size):
        yield data[i:i + size]


def test_body_over_the_limit_is_413_declared_or_chunked(http):
    headers = {"Content-Type": "application/json"}
    for size in (LIMIT + 1, 4 * LIMIT):
        over = tokenize_body(size)
        declared = http.post("/tokenize", content=over, headers=headers)
        assert_error(declared, 413, str(size), str(LIMIT), "--max-request-body-bytes", code="request_too_large")
        chunked = http.post("/tokenize", content=chunks(over), headers=headers)
        assert chunked.request.headers.get("transfer-encoding") == "chunked"
        assert "content-length" not in chunked.request.headers
        assert_error(chunked, 413, f"more than {LIMIT} bytes", "--max-request-body-bytes", code="request_too_large")
    # At the limit, both ways, the request goes through.
    at_limit = tokenize_body(LIMIT)
    for content in (at_limit, chunks(at_limit)):
        ok = http.post("/tokenize", content=content, headers=headers)
        assert ok.status_code == 200, ok.text
        assert ok.json()["count"] > 0
    # The connection is still usable after a 413.
    assert http.get("/health").status_code == 200


def test_body_limit_covers_the_v1_routes(http):
    big = "fox " * LIMIT
    assert_error(http.post("/v1/completions", json={"model": "tiny", "prompt": big, "max_tokens": 1}), 413,
                 "--max-request-body-bytes")
    assert_error(http.post("/v1/chat/completions", json={"model": "tiny", "max_tokens": 1,
                                                         "messages": [{"role": "user", "content": big}]}), 413)


def test_api_key_guards_the_compute_routes(server, http):
    anonymous = httpx.Client(base_url=server.url, timeout=60)
    wrong = httpx.Client(base_url=server.url, timeout=60, headers={"Authorization": "Bearer nope"})
    calls = [("POST", "/tokenize", {"prompt": "The quick brown fox"}), ("POST", "/detokenize", {"tokens": [5, 6]}),
             ("POST", "/reset_prefix_cache", None), ("GET", "/v1/models", None)]
    for method, path, body in calls:
        assert_error(anonymous.request(method, path, json=body), 401, "API key", code="invalid_api_key")
        assert_error(wrong.request(method, path, json=body), 401, "Incorrect API key", code="invalid_api_key")
        assert http.request(method, path, json=body).status_code == 200, path
    # The key is checked before the body is read: no key and a huge body is a 401, not a 413.
    assert_error(anonymous.post("/tokenize", content=tokenize_body(4 * LIMIT),
                                headers={"Content-Type": "application/json"}), 401)
    for path in ("/health", "/metrics", "/version"):
        assert anonymous.get(path).status_code == 200, path
    assert http.post("/tokenize", json={"prompt": "x"}).json()["count"] >= 1


def test_request_chat_template_is_400_by_default(http):
    chat = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2,
                                                   "chat_template": TEMPLATE})
    assert_error(chat, 400, "--trust-request-chat-template", "untrusted chat template", param="chat_template")
    via_kwargs = http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2,
                                                         "chat_template_kwargs": {"chat_template": TEMPLATE}})
    assert_error(via_kwargs, 400, "--trust-request-chat-template", param="chat_template")
    tokenized = http.post("/tokenize", json={"messages": MESSAGES, "chat_template": TEMPLATE})
    assert_error(tokenized, 400, "--trust-request-chat-template", param="chat_template")
    # The server's own template (--chat-template gemma) still serves both routes.
    assert http.post("/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES,
                                                   "max_tokens": 2}).status_code == 200
    assert http.post("/tokenize", json={"messages": MESSAGES}).status_code == 200
