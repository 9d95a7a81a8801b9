"""KV-cache events from a real ``pagedllm serve --kv-events-config`` with two data-parallel
replicas (tiny checkpoint): each replica publishes on its own ports (the configured ones + its
rank, as vLLM), and the batches decode with the structs vLLM's subscriber example
(``examples/features/kv_events/kv_events_subscriber.py``, vLLM 0.33) defines, copied below as
the example has them, so a router written against vLLM reads pagedllm unchanged."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from msgspec.msgpack import Decoder

from pagedllm.core.kv_cache_utils import hash_request_tokens
from pagedllm.v1.core.kv_cache_utils import ExternalBlockHash

BS = 8
TOPIC = "kv-events"
PROMPTS = [[5 + i, 11, 13, 17, 19, 23, 29, 31] + list(range(40 + 20 * i, 52 + 20 * i)) for i in range(8)]  # 20 tokens


# -- the vLLM example's structs, as it defines them ------------------------------------------------
# A deliberate copy (the duplicates tool pairs it with pagedllm/distributed/kv_events.py): importing
# pagedllm's own structs here would test the wire format against itself, not against vLLM's client.
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class for all KV cache-related events."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
# ---------------------------------------------------------------------------------------------------


def _free_port_run(n: int) -> int:
    """A tcp port ``p`` with ``p .. p + n - 1`` all free."""
    for _ in range(50):
        with socket.socket() as a:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
        try:
            for q in range(port, port + n):
                with socket.socket() as b:
                    b.bind(("127.0.0.1", q))
            return port
        except OSError:
            continue
    raise RuntimeError(f"no {n} consecutive free ports")


def _drain(sock, first_wait_ms: int) -> list[list[bytes]]:
    msgs = []
    while sock.poll(first_wait_ms if not msgs else 500):
        msgs.append(sock.recv_multipart())
    return msgs


async def _complete(server) -> None:
    client = server.async_client()
    await asyncio.gather(*(client.completions.create(model="tiny", prompt=p, max_tokens=1, temperature=0)
                           for p in PROMPTS))


@pytest.mark.multiprocess   # two replica processes
@pytest.mark.timeout(400)
def test_serve_dp2_publishes_per_replica(make_tiny_checkpoint, launch_server):
    pub = _free_port_run(4)
    replay = pub + 2   # replica r: PUB on pub + r, replay on replay + r
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
              "replay_endpoint": f"tcp://*:{replay}", "topic": TOPIC}
    server = launch_server(["serve", make_tiny_checkpoint("llama"), "--served-model-name", "tiny", "--dtype", "float32",
                            "--max-model-len", "128", "--block-size", str(BS), "--kv-cache-memory-bytes", "4MiB",
                            "--data-parallel-size", "2", "--kv-events-config", json.dumps(config)],
                           "kv_events", module="pagedllm.entrypoints.cli")
    ctx = zmq.Context()
    subs = []
    for rank in (0, 1):
        sub = ctx.socket(zmq.SUB)
        sub.connect(f"tcp://127.0.0.1:{pub + rank}")
        sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
        subs.append(sub)
    time.sleep(1.0)   # the subscriptions reach the publishers
    decoder = Decoder(type=KVEventBatch)

    asyncio.run(_complete(server))
    stored: dict[bytes, tuple] = {}
    first_msgs = []
    for rank, sub in enumerate(subs):
        msgs = _drain(sub, 5000)
        assert msgs, f"replica {rank} published nothing"
        first_msgs.append(msgs[0])
        assert [int.from_bytes(m[1], "big") for m in msgs] == list(range(len(msgs)))
        for _, _, payload in msgs:
            assert msgspec.msgpack.decode(payload)[2] == rank   # vLLM's data_parallel_rank, 3rd item
            for event in decoder.decode(payload).events:
                assert isinstance(event, BlockStored)
                assert (event.block_size, event.medium, event.lora_name, event.group_idx) == (BS, "GPU", None, 0)
                stored[tuple(event.block_hashes)] = (event.parent_block_hash, event.token_ids)
    # Each prompt's two full blocks, stored once in the replica that ran it, with their tokens.
    want = {tuple(hash_request_tokens(BS, p)): (None, p[:16]) for p in PROMPTS}
    assert stored == want

    # Replay from seq 0 on rank 1's replay port: its first batch again (a REQ takes one reply).
    req = ctx.socket(zmq.REQ)
    req.connect(f"tcp://127.0.0.1:{replay + 1}")
    req.send((0).to_bytes(8, "big"))
    assert req.poll(5000)
    assert req.recv_multipart() == first_msgs[1]

    assert httpx.post(server.url + "/reset_prefix_cache", timeout=60).status_code == 200
    for sub in subs:
        (msg,) = _drain(sub, 5000)
        assert decoder.decode(msg[2]).events == [AllBlocksCleared()]

    assert server.terminate() == 0
    for sock in (*subs, req):
        sock.close(linger=0)
    ctx.term()
    # The replicas closed their sockets on the way out: the ports bind again.
    probe = zmq.Context()
    for port in (pub, pub + 1, replay, replay + 1):
        s = probe.socket(zmq.PUB)
        s.bind(f"tcp://127.0.0.1:{port}")
        s.close(linger=0)
    probe.term()
