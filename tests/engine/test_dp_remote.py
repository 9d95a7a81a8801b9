"""vLLM's multi-instance data parallelism: a front end with ``data_parallel_size=2,
data_parallel_size_local=1`` and rank 1 in a real ``pagedllm serve ... --headless`` process.

Checked: bad flags are ValueErrors naming them; requests with ``data_parallel_rank=1`` equal a
single engine's greedy float32 tokens and are finished by rank 1 (its own stats, sent over tcp);
requests without a rank go to both; the front end without its remote rank fails with a timeout
naming the rank and address; a killed headless rank fails its in-flight requests and rank 0 keeps
serving; the headless process exits 0 when the front end shuts down and on SIGTERM; SIGTERM to a
headless rank with requests running drains it (they finish, nothing new goes to it, the front end
marks it stopped, not failed); the same command started again rejoins; a second process for a live
rank is refused and the front end serves on.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from pagedllm import SamplingParams
from pagedllm.engine import dp_client, dp_remote
from pagedllm.engine.arg_utils import AsyncEngineArgs, EngineArgs
from pagedllm.engine.async_engine import EngineStepError
from pagedllm.engine.dp_layout import DataParallelLayout

KWARGS = dict(dtype="float32", max_model_len=512, block_size=8, kv_cache_memory_bytes=8 << 20)
CLI_FLAGS = ["--dtype", "float32", "--max-model-len", "512", "--block-size", "8", "--kv-cache-memory-bytes", "8MiB"]
PROMPTS = [[5 + i, 9, 13, 200 - i, 17, 3, 40 + i] for i in range(4)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("kwargs, headless, flag", [
    (dict(data_parallel_size=2, data_parallel_start_rank=2, data_parallel_address="h"), True, "-dpr"),
    (dict(data_parallel_size=2, data_parallel_address="h"), True, "-dpr"),
    (dict(data_parallel_size=2, data_parallel_start_rank=1), True, "--data-parallel-address"),
    (dict(data_parallel_size=2, data_parallel_size_local=3), False, "data_parallel_size_local"),
    (dict(data_parallel_size=2, data_parallel_size_local=0), False, "data_parallel_size_local"),
    (dict(data_parallel_size=2, data_parallel_start_rank=1, data_parallel_size_local=1), False, "hybrid"),
    (dict(data_parallel_size=2, data_parallel_start_rank=1, data_parallel_size_local=2,
          data_parallel_address="h"), True, "exceeds data_parallel_size=2"),
    (dict(data_parallel_size=2, data_parallel_external_lb=True), False, "data_parallel_external_lb"),
    (dict(data_parallel_size=2, data_parallel_hybrid_lb=True), False, "data_parallel_hybrid_lb"),
    (dict(data_parallel_size=2, data_parallel_rpc_port=70000), False, "data_parallel_rpc_port"),
])
def test_bad_data_parallel_flags_name_the_flag(kwargs, headless, flag):
    with pytest.raises(ValueError, match=flag):
        DataParallelLayout.from_engine_args(EngineArgs(model="m", **kwargs), headless=headless)


def test_layout_ranks_and_address():
    front = DataParallelLayout.from_engine_args(EngineArgs(model="m", data_parallel_size=3, data_parallel_size_local=1,
                                                           data_parallel_rpc_port=62300))
    assert (list(front.local_ranks), list(front.remote_ranks)) == ([0], [1, 2])
    assert front.handshake_address == "tcp://127.0.0.1:62300"
    rank = DataParallelLayout.from_engine_args(EngineArgs(model="m", data_parallel_size=3, data_parallel_start_rank=1,
                                                          data_parallel_size_local=2, data_parallel_address="::1"),
                                               headless=True)
    assert (list(rank.local_ranks), list(rank.remote_ranks)) == ([1, 2], [])
    assert rank.handshake_address == "tcp://[::1]:29550"
    everything_local = DataParallelLayout.from_engine_args(EngineArgs(model="m", data_parallel_size=2))
    assert list(everything_local.remote_ranks) == []


def test_cli_headless_without_start_rank_is_exit_2(capsys):
    from pagedllm.entrypoints.cli import main

    assert main(["serve", "m", "-dp", "2", "--data-parallel-address", "127.0.0.1", "--headless"]) == 2
    assert "--data-parallel-start-rank (-dpr)" in capsys.readouterr().err


@pytest.fixture
def folder_port(make_tiny_checkpoint) -> tuple[str, int]:
    """A tiny random Llama checkpoint and a free tcp port for the front end."""
    return make_tiny_checkpoint("llama"), _free_port()


def _start_headless(folder: str, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pagedllm.entrypoints.cli", "serve", folder, "-dp", "2", "-dpr", "1",
           "--data-parallel-address", "127.0.0.1", "--data-parallel-rpc-port", str(port),
           "--data-parallel-size-local", "1", "--enforce-eager", "--headless", *CLI_FLAGS]
    log = tempfile.NamedTemporaryFile("w+", prefix="headless_", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    proc.log_path = log.name   # a file, not a pipe: nobody reads while it runs
    return proc


def _log(proc: subprocess.Popen) -> str:
    with open(proc.log_path) as f:
        return f.read()


def _front_end(folder: str, port: int):
    from pagedllm.engine.async_llm_engine import AsyncLLMEngine
    from pagedllm.v1.metrics.loggers import AggregatedLoggingStatLogger

    args = AsyncEngineArgs(model=folder, data_parallel_size=2, data_parallel_size_local=1,
                           data_parallel_address="127.0.0.1", data_parallel_rpc_port=port, **KWARGS)
    engine = AsyncLLMEngine.from_engine_args(args, stat_loggers=[AggregatedLoggingStatLogger])
    return engine, engine.extra_stat_loggers[0]


async def _tokens(engine, prompt, params, request_id, rank=None) -> list[int]:
    final = None
    async for out in engine.generate({"prompt_token_ids": prompt}, params, request_id, data_parallel_rank=rank):
        final = out
    return list(final.outputs[0].token_ids)


@pytest.mark.multiprocess   # a replica process and a headless server process (~15 s each start)
@pytest.mark.timeout(300)
def test_headless_rank_serves_its_requests_and_leaves_with_the_front_end(folder_port):
    from pagedllm.entrypoints.llm import LLM

    folder, port = folder_port
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    single = LLM(folder, **KWARGS)
    want = [list(o.outputs[0].token_ids) for o in single.generate([{"prompt_token_ids": p} for p in PROMPTS],
                                                                  greedy, use_tqdm=False)]
    del single
    headless = _start_headless(folder, port)
    try:
        engine, stats = _front_end(folder, port)
        try:
            async def on_rank_1():
                return await asyncio.gather(*[_tokens(engine, p, greedy, f"r1-{i}", rank=1)
                                              for i, p in enumerate(PROMPTS)])
            assert asyncio.run(on_rank_1()) == want
            assert stats.num_finished == {0: 0, 1: len(PROMPTS)}   # rank 1's own stats, over tcp

            async def spread():
                return await asyncio.gather(*[_tokens(engine, PROMPTS[i % 4], greedy, f"any-{i}") for i in range(8)])
            assert asyncio.run(spread()) == [want[i % 4] for i in range(8)]
            assert stats.num_finished[0] > 0 and stats.num_finished[1] > len(PROMPTS)
            assert sum(stats.num_finished.values()) == len(PROMPTS) + 8
            assert asyncio.run(engine.do_log_stats()) is None
            with pytest.raises(ValueError, match=r"data_parallel_rank must be None or an int in \[0, "
                                                 r"data_parallel_size=2\), got 2"):
                asyncio.run(_tokens(engine, PROMPTS[0], greedy, "bad", rank=2))
        finally:
            engine.shutdown()
        assert headless.wait(timeout=30) == 0   # the front end's "shutdown" ends the headless process
    finally:
        if headless.poll() is None:
            os.killpg(headless.pid, signal.SIGKILL)
        print(_log(headless))


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_killed_headless_rank_fails_its_requests_and_rank_0_serves_on(folder_port, monkeypatch):
    monkeypatch.setattr(dp_remote, "HEARTBEAT_TIMEOUT_S", 3.0)
    folder, port = folder_port
    headless = _start_headless(folder, port)
    try:
        engine, stats = _front_end(folder, port)
        try:
            long = SamplingParams(temperature=0.0, max_tokens=480, ignore_eos=True)

            async def kill_while_running():
                streams = [engine.generate({"prompt_token_ids": p}, long, f"long-{i}", data_parallel_rank=1)
                           for i, p in enumerate(PROMPTS)]
                first = await streams[0].__anext__()
                assert not first.finished
                os.killpg(headless.pid, signal.SIGKILL)
                started = time.monotonic()
                with pytest.raises(EngineStepError, match=r"data-parallel replica 1 \(remote, at "
                                                          rf"tcp://127.0.0.1:{port}\) sent nothing for"):
                    async for _ in streams[0]:
                        pass
                return time.monotonic() - started
            assert asyncio.run(kill_while_running()) < 15
            assert engine.health()["status"] == "degraded"
            greedy = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
            assert len(asyncio.run(_tokens(engine, PROMPTS[0], greedy, "after"))) == 4   # rank 0 serves on
            with pytest.raises(EngineStepError, match="data_parallel_rank=1: data-parallel replica 1"):
                asyncio.run(_tokens(engine, PROMPTS[0], greedy, "after-1", rank=1))
        finally:
            engine.shutdown()
    finally:
        if headless.poll() is None:
            os.killpg(headless.pid, signal.SIGKILL)
        headless.wait(timeout=10)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_front_end_without_its_remote_rank_times_out_naming_it(folder_port, monkeypatch):
    monkeypatch.setattr(dp_client, "REPLICA_START_TIMEOUT_S", 5.0)
    folder, port = folder_port
    with pytest.raises(RuntimeError, match=rf"remote data-parallel rank\(s\) \[1\] did not connect to "
                                           rf"tcp://127.0.0.1:{port} within 5 s"):
        _front_end(folder, port)


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_headless_exits_0_on_sigterm(folder_port):
    headless = _start_headless(*folder_port)
    try:
        deadline = time.monotonic() + 60   # its signal handlers are set once it says where it connects
        while "connect to the front end at" not in _log(headless) and time.monotonic() < deadline:
            time.sleep(0.2)
        os.kill(headless.pid, signal.SIGTERM)
        assert headless.wait(timeout=60) == 0
    finally:
        if headless.poll() is None:
            os.killpg(headless.pid, signal.SIGKILL)


FRONT_END_WITHOUT_SHUTDOWN = """
import asyncio, faulthandler, sys
faulthandler.dump_traceback_later(60, exit=True)
from pagedllm import SamplingParams
from pagedllm.engine.arg_utils import AsyncEngineArgs
from pagedllm.engine.async_llm_engine import AsyncLLMEngine

folder, port = sys.argv[1], int(sys.argv[2])

async def main():   # the engine is a local, dropped when main returns (as in vLLM's example script)
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=folder, data_parallel_size=2, data_parallel_size_local=1, data_parallel_address="127.0.0.1",
        data_parallel_rpc_port=port, dtype="float32", max_model_len=512, block_size=8,
        kv_cache_memory_bytes=8 << 20))
    async for out in engine.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, ignore_eos=True),
                                     "a", data_parallel_rank=1):
        pass
    print("tokens", len(out.outputs[0].token_ids), flush=True)

asyncio.run(main())   # no shutdown(): the exit hooks stop the receiver, the replicas and the remote rank
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_front_end_exiting_without_shutdown_stops_the_headless_rank(folder_port):
    folder, port = folder_port
    headless = _start_headless(folder, port)
    try:
        front = subprocess.run([sys.executable, "-c", FRONT_END_WITHOUT_SHUTDOWN, folder, str(port)],
                               capture_output=True, text=True, timeout=120)
        assert front.returncode == 0, front.stderr[-3000:]
        assert "tokens 4" in front.stdout and "Traceback" not in front.stderr
        assert headless.wait(timeout=30) == 0
    finally:
        if headless.poll() is None:
            os.killpg(headless.pid, signal.SIGKILL)


def _wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


@pytest.mark.multiprocess   # three headless processes one after another (~15 s each start)
@pytest.mark.timeout(420)
def test_sigterm_drains_the_headless_rank_which_rejoins_and_is_not_doubled(folder_port, caplog):
    from pagedllm.entrypoints.llm import LLM

    caplog.set_level(logging.INFO, logger="pagedllm")
    folder, port = folder_port
    long = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)   # max_model_len 512
    short = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    single = LLM(folder, **KWARGS)
    want = [list(o.outputs[0].token_ids) for o in single.generate([{"prompt_token_ids": p} for p in PROMPTS[:3]],
                                                                  long, use_tqdm=False)]
    first = single.generate([{"prompt_token_ids": PROMPTS[0]}], short, use_tqdm=False)[0]
    want_short = list(first.outputs[0].token_ids)
    del single
    headless = _start_headless(folder, port)
    procs = [headless]
    try:
        engine, stats = _front_end(folder, port)
        try:
            async def sigterm_while_running():
                streams = [engine.generate({"prompt_token_ids": p}, long, f"drain-{i}", data_parallel_rank=1)
                           for i, p in enumerate(PROMPTS[:3])]
                for s in streams:
                    assert not (await s.__anext__()).finished
                os.kill(headless.pid, signal.SIGTERM)
                while engine.health()["engines"]["1"] == "ok":
                    await asyncio.sleep(0.02)
                assert engine.health()["engines"]["1"].startswith("draining")
                with pytest.raises(EngineStepError, match=r"data_parallel_rank=1: data-parallel replica 1 .*"
                                                          r"is shutting down"):
                    await _tokens(engine, PROMPTS[0], short, "pinned-while-draining", rank=1)
                finals = []
                for s in streams:
                    async for out in s:
                        final = out
                    finals.append(list(final.outputs[0].token_ids))
                return finals
            assert asyncio.run(sigterm_while_running()) == want   # finished in full, not failed
            assert headless.wait(timeout=60) == 0
            _wait_for(lambda: "stopped" in engine.health()["engines"]["1"], 10, "rank 1 to be marked stopped")
            assert engine.health()["status"] == "degraded"
            assert stats.num_finished[1] == 3
            before = stats.num_finished[0]
            assert asyncio.run(_tokens(engine, PROMPTS[0], short, "after")) == want_short
            assert stats.num_finished[0] == before + 1   # rank 0 serves what is not pinned
            with pytest.raises(EngineStepError, match="data_parallel_rank=1: data-parallel replica 1 .*stopped"):
                asyncio.run(_tokens(engine, PROMPTS[0], short, "after-1", rank=1))
            assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text
            assert "cannot take" not in caplog.text

            rejoined = _start_headless(folder, port)   # the same command again: it rejoins
            procs.append(rejoined)
            _wait_for(lambda: engine.health()["status"] == "ok", 120, "rank 1 to rejoin")
            assert asyncio.run(_tokens(engine, PROMPTS[0], short, "rejoined", rank=1)) == want_short
            _wait_for(lambda: stats.num_finished[1] == 4, 10, "rank 1's stats")

            doubled = _start_headless(folder, port)   # a second process for the live rank 1: refused
            procs.append(doubled)
            assert doubled.wait(timeout=120) != 0
            assert "refused this process: data-parallel rank 1 is already served by a live process" in _log(doubled)
            assert engine.health()["status"] == "ok"
            assert asyncio.run(_tokens(engine, PROMPTS[0], short, "still-1", rank=1)) == want_short
            assert "the data-parallel receiver failed" not in caplog.text
        finally:
            engine.shutdown()
        assert rejoined.wait(timeout=30) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            print(_log(proc))


def test_receiver_drops_an_unexpected_message(caplog):
    client = dp_client.EngineCoreClient.__new__(dp_client.EngineCoreClient)
    client.num_replicas = 2
    client.layout = DataParallelLayout.from_engine_args(EngineArgs(model="m", data_parallel_size=2,
                                                                   data_parallel_size_local=1))
    from pagedllm.engine.dp_coordinator import DPLoadBalancer

    client.balancer = DPLoadBalancer(2, 8)
    assert client._handle(("nonsense", 1)) == []
    assert client._handle(("ready", 1, None)) == []   # rank 1 is alive: a stray "ready" is dropped
    assert "dropped an unexpected 'nonsense' message" in caplog.text


def test_remote_identities_name_their_rank_and_differ_per_process():
    a, b = dp_remote.rank_identity(3), dp_remote.rank_identity(3)
    assert a != b and dp_remote._rank_of(a) == dp_remote._rank_of(b) == 3
    assert dp_remote._rank_of(b"dp-rank-x") is None and dp_remote._rank_of(b"other") is None


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_killed_headless_rank_rejoins_when_started_again(folder_port, monkeypatch, caplog):
    monkeypatch.setattr(dp_remote, "HEARTBEAT_TIMEOUT_S", 3.0)
    folder, port = folder_port
    short = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    procs = [_start_headless(folder, port)]
    try:
        engine, stats = _front_end(folder, port)
        try:
            want = asyncio.run(_tokens(engine, PROMPTS[1], short, "before", rank=1))
            os.killpg(procs[0].pid, signal.SIGKILL)
            _wait_for(lambda: engine.health()["status"] == "degraded", 30, "rank 1 to be declared dead")
            procs.append(_start_headless(folder, port))
            _wait_for(lambda: engine.health()["status"] == "ok", 120, "rank 1 to rejoin")
            assert engine.health()["engines"] == {"0": "ok", "1": "ok"}
            assert engine.client.balancer.replicas[1].num_served == 0   # fresh load-balancer state
            assert asyncio.run(_tokens(engine, PROMPTS[1], short, "after", rank=1)) == want
            _wait_for(lambda: stats.num_finished[1] == 2, 10, "rank 1's stats")
            assert "unknown message" not in caplog.text and "receiver failed" not in caplog.text
        finally:
            engine.shutdown()
        assert procs[1].wait(timeout=30) == 0
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
