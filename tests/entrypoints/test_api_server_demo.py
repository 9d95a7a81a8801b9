"""vLLM's demo ``/generate`` server (``pagedllm.entrypoints.api_server``, issue 28), started for
real as a subprocess on a tiny float32 Llama, driven with ``requests`` as vLLM's example client
does: non-streaming and streaming (prompt + text, n=2), 400s for bad bodies, and clients that
disconnect (streaming or not) abort their request and free its blocks."""

from __future__ import annotations

import json
import signal
import time

import pytest
import requests

pytestmark = pytest.mark.multiprocess

PROMPT = "San Francisco is a"


@pytest.fixture(scope="module")
def demo(make_tiny_checkpoint, launch_server):
    folder = make_tiny_checkpoint("llama")
    server = launch_server(["--model", folder, "--dtype", "float32", "--max-model-len", "512", "--block-size", "8",
                            "--kv-cache-memory-bytes", "16MiB", "--log-level", "warning"], "demo",
                           module="pagedllm.entrypoints.api_server")
    return folder, server


def _post(server, stream: bool = False, timeout=120, **body) -> requests.Response:
    """vLLM's client's request: the prompt, "stream", and sampling parameters."""
    return requests.post(server.url + "/generate", json={"prompt": PROMPT, "stream": stream, **body}, stream=stream,
                         timeout=timeout, headers={"User-Agent": "Test Client"})


def test_generate_non_streaming_and_streaming_n2(demo):
    from pagedllm import LLM, SamplingParams

    folder, server = demo
    body = dict(n=2, temperature=0.0, max_tokens=16, ignore_eos=True)
    r = _post(server, **body)
    assert r.status_code == 200, r.text
    texts = r.json()["text"]
    llm = LLM(folder, dtype="float32", max_model_len=512, kv_cache_memory_bytes=8 << 20)
    try:
        want = PROMPT + llm.generate(PROMPT, SamplingParams(**body), use_tqdm=False)[0].outputs[0].text
    finally:
        llm.llm_engine.shutdown()
    assert texts == [want, want]    # greedy: both samples are the offline engine's text, prompt first
    r = _post(server, stream=True, **body)
    assert r.status_code == 200
    lines = [json.loads(line) for line in r.iter_lines(delimiter=b"\n") if line]
    assert len(lines) >= 2
    for earlier, later in zip(lines, lines[1:]):
        assert len(later["text"]) == 2
        assert all(b.startswith(a) for a, b in zip(earlier["text"], later["text"]))   # cumulative
    assert all(t.startswith(PROMPT) for t in lines[0]["text"])
    assert lines[-1]["text"] == texts


def test_bad_bodies_are_400(demo):
    _, server = demo
    r = _post(server, temperature=-1.0)
    assert r.status_code == 400 and "temperature" in r.json()["error"]
    r = _post(server, no_such_field=1)
    assert r.status_code == 400 and "no_such_field" in r.json()["error"]
    r = requests.post(server.url + "/generate", json={"text": "no prompt"}, timeout=30)
    assert r.status_code == 400 and "prompt" in r.json()["error"]
    r = requests.post(server.url + "/generate", json={"prompt": "word " * 600}, timeout=30)
    assert r.status_code == 400 and "512" in r.json()["error"]   # longer than max_model_len


def _idle(server) -> tuple[float, float, float]:
    return (server.metric("pagedllm:num_requests_running"), server.metric("pagedllm:num_requests_waiting"),
            server.metric("pagedllm:kv_cache_usage_perc"))


def test_disconnected_clients_free_their_blocks(demo):
    _, server = demo
    aborted = server.metric("pagedllm:request_success_total", finished_reason="abort")
    long = dict(n=2, temperature=1.0, max_tokens=500, ignore_eos=True)
    # A streaming client that leaves after two chunks.
    r = _post(server, stream=True, **long)
    chunks = r.iter_lines(delimiter=b"\n")
    next(chunks), next(chunks)
    assert server.metric("pagedllm:kv_cache_usage_perc") > 0
    r.close()
    # A non-streaming client that gives up after 0.5 s.
    with pytest.raises(requests.exceptions.ReadTimeout):
        _post(server, timeout=(10, 0.5), **long)
    deadline = time.monotonic() + 30
    while _idle(server) != (0.0, 0.0, 0.0):
        assert time.monotonic() < deadline, (_idle(server), server.log_tail())
        time.sleep(0.1)
    assert server.metric("pagedllm:request_success_total", finished_reason="abort") == aborted + 2
    r = _post(server, max_tokens=3, ignore_eos=True)   # and it still serves
    assert r.status_code == 200 and len(r.json()["text"]) == 1
    assert server.terminate(signal.SIGTERM) == 0
