"""No request is lost (issue 26): more requests than zmq's default queue holds (1,000 messages a
side) reach the engine while it cannot read them, in one HTTP request and in many, on the
in-process engine, the engine process and two data-parallel replicas; every one is answered. Then
64 streaming clients that disconnect at random leave 0 requests running and 0 KV blocks in use.

Real ``pagedllm serve`` processes on a tiny float32 Llama; slow tier (several processes)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import httpx
import psutil
import pytest

pytestmark = pytest.mark.multiprocess

NUM_PROMPTS = 2500       # one request, more prompts than the old 1,000 + 1,000 message queues held
NUM_SEPARATE = 300       # and this many requests of one prompt each, at the same time
NUM_STREAMS = 64


def _args(folder: str, *flags: str) -> list[str]:
    return ["serve", folder, "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "128",
            "--block-size", "8", "--kv-cache-memory-bytes", "4MiB", "--disable-log-requests", *flags]


def _replicas(server) -> list[psutil.Process]:
    return [p for p in psutil.Process(server.proc.pid).children()
            if "spawn_main" in " ".join(p.cmdline()) and "resource_tracker" not in " ".join(p.cmdline())]


async def _burst(server, replicas: list[psutil.Process]) -> tuple[list[int], list[int]]:
    """With the replicas stopped (SIGSTOP: nothing reads their queues), send one request of
    NUM_PROMPTS prompts and NUM_SEPARATE one-prompt requests; resume the replicas once every request
    was handed to the engine front end. Returns (the big request's choice indexes, each separate
    request's status)."""
    limits = httpx.Limits(max_connections=NUM_SEPARATE + 10)
    async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=limits) as client:
        for p in replicas:
            p.suspend()
        try:
            big = asyncio.create_task(client.post("/v1/completions", json={
                "model": "tiny", "prompt": [[5 + i % 50, 7, 9 + i % 7] for i in range(NUM_PROMPTS)], "max_tokens": 1,
                "ignore_eos": True}))
            separate = [asyncio.create_task(client.post("/v1/completions", json={
                "model": "tiny", "prompt": [11, 5 + i % 90], "max_tokens": 2, "ignore_eos": True})) for i in range(NUM_SEPARATE)]
            # Every request reached the front end (it counts them as waiting once they are queued,
            # but a stopped replica reports nothing): give the server time to hand them all on.
            await asyncio.sleep(6.0 if replicas else 0.0)
        finally:
            for p in replicas:
                p.resume()
        r = await big
        assert r.status_code == 200, r.text
        statuses = [(await t).status_code for t in separate]
        return sorted(c["index"] for c in r.json()["choices"]), statuses


async def _disconnecting_streams(server, seed: int) -> int:
    """NUM_STREAMS streaming clients; about half drop the connection after a random number of
    chunks. Returns how many streams finished with [DONE]."""
    rng = random.Random(seed)
    done = 0

    async def one(i: int) -> None:
        nonlocal done
        drop_after = rng.randint(1, 20) if rng.random() < 0.5 else None
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            async with client.stream("POST", "/v1/completions", json={
                    "model": "tiny", "prompt": [13, 5 + i], "max_tokens": 40, "ignore_eos": True,
                    "stream": True}) as r:
                assert r.status_code == 200
                chunks = 0
                async for line in r.aiter_lines():
                    if line == "data: [DONE]":
                        done += 1
                        return
                    if line.startswith("data: "):
                        chunks += 1
                        if drop_after is not None and chunks >= drop_after:
                            return   # leaving the context manager closes the connection

    await asyncio.gather(*(one(i) for i in range(NUM_STREAMS)))
    return done


def _wait_idle(server, engines: list[str]) -> None:
    deadline = time.monotonic() + 30
    while True:
        running = [server.metric("pagedllm:num_requests_running", engine=e) for e in engines]
        waiting = [server.metric("pagedllm:num_requests_waiting", engine=e) for e in engines]
        usage = [server.metric("pagedllm:kv_cache_usage_perc", engine=e) for e in engines]
        if not any(running + waiting + usage):
            return
        assert time.monotonic() < deadline, (running, waiting, usage, server.log_tail())
        time.sleep(0.2)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("form", ["engine-in-process", "engine-process", "dp2"])
def test_every_request_answered_and_disconnects_free_everything(form, make_tiny_checkpoint, launch_server):
    folder = make_tiny_checkpoint("llama")
    flags = {"engine-in-process": ["--engine-in-process"], "engine-process": [], "dp2": ["-dp", "2"]}[form]
    server = launch_server(_args(folder, *flags), form, module="pagedllm.entrypoints.cli")
    replicas = _replicas(server) if form != "engine-in-process" else []
    assert len(replicas) == {"engine-in-process": 0, "engine-process": 1, "dp2": 2}[form]
    indexes, statuses = asyncio.run(_burst(server, replicas))
    assert indexes == list(range(NUM_PROMPTS))
    assert statuses == [200] * NUM_SEPARATE
    engines = [str(i) for i in range(max(1, len(replicas)))]
    successes = sum(server.metric("pagedllm:request_success_total", engine=e, finished_reason="length")
                    for e in engines)
    assert successes == NUM_PROMPTS + NUM_SEPARATE
    assert "cannot take" not in server.log_tail(400)
    done = asyncio.run(_disconnecting_streams(server, seed=len(form)))
    assert 0 < done < NUM_STREAMS
    _wait_idle(server, engines)
    # And it still serves.
    r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": [5, 6], "max_tokens": 3,
                                                              "ignore_eos": True}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert server.terminate(signal.SIGTERM) == 0


@pytest.mark.timeout(300)
def test_engine_client_delivers_a_burst_to_a_stopped_replica(make_tiny_checkpoint):
    """The offline front end (``EngineCoreClient``, as ``LLM(data_parallel_size=...)`` drives it):
    3,000 separate ``add_request`` calls while its replica is stopped; every one finishes."""
    from pagedllm import SamplingParams
    from pagedllm.engine.arg_utils import EngineArgs
    from pagedllm.engine.dp_client import EngineCoreClient

    folder = make_tiny_checkpoint("llama")
    client = EngineCoreClient(EngineArgs(model=folder, dtype="float32", max_model_len=128, block_size=8,
                                       kv_cache_memory_bytes=4 << 20, data_parallel_size=1))
    try:
        replica = psutil.Process(client.processes[0].pid)
        replica.suspend()
        try:
            ids = [client.add_request(f"r{i}", [5 + i % 50, 7], SamplingParams(max_tokens=1)) for i in range(3000)]
        finally:
            replica.resume()
        finished = set()
        deadline = time.monotonic() + 120
        while len(finished) < len(ids):
            assert time.monotonic() < deadline, len(finished)
            finished.update(out.request_id for out in client.step() if out.finished)
        assert finished == set(ids)
        assert not client.has_unfinished_requests()
    finally:
        client.shutdown()
    assert not os.path.exists(client._tmpdir)
