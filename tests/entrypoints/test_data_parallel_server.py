"""Data parallelism behind one server (tiny checkpoint, real ``pagedllm serve`` subprocess):
32 concurrent clients at --data-parallel-size 2 give DP=1's greedy outputs and spread 40-60% to
each replica (per-replica counters, ``engine`` label); ``use_beam_search`` runs in one replica and
equals DP=1's beams; a replica killed with requests in flight
fails those requests with a clear error, /health says "degraded", the other replica keeps serving."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time

import httpx
import psutil
import pytest

NUM_CLIENTS = 32
PROMPTS = [[7 + i % 5, 11, 13 + i, 200 - i, 17, 3 + i % 3, 40, 41, 42, 50 + i] for i in range(NUM_CLIENTS)]


def _args(folder: str, dp: int) -> list[str]:
    return [folder, "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "128", "--block-size", "8",
            "--kv-cache-memory-bytes", "4MiB", "--data-parallel-size", str(dp)]


async def _complete_all(server) -> list[list[int] | str]:
    client = server.async_client()

    async def one(prompt):
        r = await client.completions.create(model="tiny", prompt=prompt, max_tokens=8, temperature=0,
                                            extra_body={"ignore_eos": True}, logprobs=1)
        return r.choices[0].text, r.choices[0].logprobs.tokens

    return await asyncio.gather(*(one(p) for p in PROMPTS))


def _replicas(server) -> list[psutil.Process]:
    children = psutil.Process(server.proc.pid).children()
    return sorted((p for p in children if "spawn_main" in " ".join(p.cmdline())), key=lambda p: p.pid)


@pytest.mark.multiprocess   # spawns replica processes (~15 s each start on two shared cores)
@pytest.mark.timeout(400)
def test_dp2_spreads_32_clients_and_equals_dp1(make_tiny_checkpoint, launch_server):
    folder = make_tiny_checkpoint("llama")
    single = launch_server(_args(folder, 1), "dp1")
    want = asyncio.run(_complete_all(single))
    want_beams = _beam_searches(single)
    single.terminate()
    server = launch_server(_args(folder, 2), "dp2")
    assert httpx.get(server.url + "/health").json() == {"status": "ok", "engines": {"0": "ok", "1": "ok"}}
    # Each replica's start-up lines reach the server's log, prefixed with the replica.
    log = server.log_path.read_text(errors="replace")
    for i in (0, 1):
        assert re.search(rf"dp{i} INFO pagedllm\.worker\.worker: KV cache: \d+ blocks x 8 tokens .*maximum "
                         rf"concurrency for 128-token requests", log), log
        assert re.search(rf"dp{i} INFO pagedllm\.engine\.llm_engine: Engine ready", log), log
    got = asyncio.run(_complete_all(server))
    assert got == want
    served = [server.metric("pagedllm:request_success_total", engine=str(i), finished_reason="length")
              for i in (0, 1)]
    assert sum(served) == NUM_CLIENTS
    assert all(0.4 * NUM_CLIENTS <= s <= 0.6 * NUM_CLIENTS for s in served), served
    gen = [server.metric("pagedllm:generation_tokens_total", engine=str(i)) for i in (0, 1)]
    assert gen == [8 * s for s in served]
    # A beam search runs whole in one replica (its beams share KV blocks there): DP=1's beams.
    assert _beam_searches(server) == want_beams


def _beam_searches(server) -> list:
    """use_beam_search (width 3) on two prompts: each choice's text and finish reason."""
    out = []
    for prompt in PROMPTS[:2]:
        r = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 5,
                                                             "n": 3, "use_beam_search": True, "ignore_eos": True},
                       timeout=60)
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert len(choices) == 3
        out.append([(c["text"], c["finish_reason"]) for c in choices])
    return out


@pytest.mark.multiprocess   # spawns replica processes (~15 s each start on two shared cores)
@pytest.mark.timeout(400)
def test_killed_replica_fails_its_requests_others_keep_serving(make_tiny_checkpoint, launch_server):
    folder = make_tiny_checkpoint("llama")
    server = launch_server(_args(folder, 2), "dp2_kill")
    replicas = _replicas(server)
    assert len(replicas) == 2
    victim = replicas[1]
    victim.send_signal(signal.SIGSTOP)   # its requests stay in flight until it is killed

    async def run():
        client = httpx.AsyncClient(base_url=server.url, timeout=120)
        body = {"model": "tiny", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
        tasks = [asyncio.create_task(client.post("/v1/completions", json={**body, "prompt": p})) for p in PROMPTS[:4]]
        await asyncio.sleep(2.0)   # replica 0 answers its share; replica 1's wait
        victim.send_signal(signal.SIGKILL)
        responses = await asyncio.gather(*tasks)
        health = (await client.get("/health")).json()
        after = [await client.post("/v1/completions", json={**body, "prompt": p}) for p in PROMPTS[4:8]]
        await client.aclose()
        return responses, health, after

    responses, health, after = asyncio.run(run())
    codes = sorted(r.status_code for r in responses)
    assert codes == [200, 200, 500, 500], [r.text for r in responses]
    for r in responses:
        if r.status_code == 500:
            assert "data-parallel replica 1" in r.json()["error"]["message"] and "died" in r.json()["error"]["message"]
    assert health["status"] == "degraded" and health["engines"]["0"] == "ok"
    assert "replica 1" in health["engines"]["1"]
    assert [r.status_code for r in after] == [200] * 4
    assert server.metric("pagedllm:request_success_total", engine="0", finished_reason="length") == 6
