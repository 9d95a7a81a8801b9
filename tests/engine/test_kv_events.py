"""KV-cache events end to end (vLLM's ``kv_events_config``): an offline ``LLM`` on the tiny Llama
with prefix caching and a small KV pool publishes on a real ZeroMQ PUB socket; a SUB socket and
REQ / DEALER replay sockets in the test read what it sent.

One engine, one scenario, in order: prompt A stores its two full blocks; prompt B (A's first 8
tokens, then others) hits them and stores one more; prompt C needs the whole pool and evicts all
three; ``reset_prefix_cache`` clears. Hashes are checked against the engine's own (the pool's
hash -> block map and ``hash_request_tokens``), tokens against the prompts.
"""

from __future__ import annotations

import socket
import time

import msgspec
import pytest
import zmq

from pagedllm import LLM, SamplingParams
from pagedllm.config import KVEventsConfig
from pagedllm.core.kv_cache_utils import hash_request_tokens
from pagedllm.distributed.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, EventPublisherFactory,
                                            KVEventBatch, NullEventPublisher, ZmqEventPublisher,
                                            offset_endpoint_port)
from pagedllm.engine.arg_utils import EngineArgs

BS = 4
A = list(range(100, 110))                  # 10 tokens: 2 full blocks
B = A[:8] + list(range(200, 206))         # 14 tokens: A's 2 blocks, then 1 new full block
C = list(range(300, 329))                  # 29 tokens: 7 full blocks, the whole 8-block pool
TOPIC = "kv-events"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ports():
    return _free_port(), _free_port()


@pytest.fixture(scope="module")
def llm(make_tiny_checkpoint, ports):
    pub, replay = ports
    llm = LLM(make_tiny_checkpoint("llama"), dtype="float32", block_size=BS, num_gpu_blocks_override=8,
              max_model_len=32, enable_prefix_caching=True, seed=0,
              kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
                                "replay_endpoint": f"tcp://*:{replay}", "topic": TOPIC, "buffer_steps": 16})
    yield llm
    llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def zmq_ctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def _recv_all(sub, timeout_ms: int = 2000) -> list[list[bytes]]:
    """Every message waiting on ``sub`` (waits up to ``timeout_ms`` for the first)."""
    msgs = []
    while sub.poll(timeout_ms if not msgs else 200):
        msgs.append(sub.recv_multipart())
    return msgs


def _generate(llm: LLM, prompt: list[int]) -> None:
    llm.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False)


def test_events_follow_the_prefix_cache(llm, ports, zmq_ctx):
    pub_port, replay_port = ports
    sub = zmq_ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{pub_port}")
    sub.setsockopt_string(zmq.SUBSCRIBE, TOPIC)
    time.sleep(0.5)   # the SUB's subscription reaches the PUB (ZeroMQ's slow joiner)
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    pool = llm.llm_engine.kv_cache_manager.block_pool
    hash_a, hash_b, hash_c = (hash_request_tokens(BS, p) for p in (A, B, C))
    assert hash_b[:2] == hash_a   # B shares A's first two blocks

    _generate(llm, A)
    _generate(llm, B)
    assert set(pool.cached_block_hash_to_block) == {*hash_a, hash_b[2]}   # the engine's own hashes
    _generate(llm, C)
    assert set(pool.cached_block_hash_to_block) == set(hash_c)
    assert llm.reset_prefix_cache() is True

    msgs = _recv_all(sub)
    assert [m[0] for m in msgs] == [TOPIC.encode()] * len(msgs)
    seqs = [int.from_bytes(m[1], "big") for m in msgs]
    assert seqs == list(range(len(msgs)))   # consecutive from 0
    batches = [decoder.decode(m[2]) for m in msgs]
    assert all(b.data_parallel_rank == 0 and b.events for b in batches)
    assert all(b0.ts <= b1.ts for b0, b1 in zip(batches, batches[1:]))
    events = [e for b in batches for e in b.events]

    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [e.block_hashes for e in stored] == [hash_a, hash_b[2:], hash_c]
    assert [e.parent_block_hash for e in stored] == [None, hash_a[-1], None]
    assert [e.token_ids for e in stored] == [A[:8], B[8:12], C[:28]]
    for e in stored:
        assert (e.block_size, e.medium, e.lora_id, e.lora_name, e.group_idx) == (BS, "GPU", None, None, 0)
        assert all(len(h) == 32 for h in e.block_hashes)
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert sorted(h for e in removed for h in e.block_hashes) == sorted([*hash_a, hash_b[2]])
    assert all(len(e.block_hashes) == 1 and e.medium == "GPU" and e.group_idx == 0 for e in removed)
    # In order: A, B, C's evictions before C's blocks are stored, then the reset.
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["BlockStored", "BlockStored"] + ["BlockRemoved"] * 3 + ["BlockStored", "AllBlocksCleared"]
    assert isinstance(batches[-1].events[-1], AllBlocksCleared) and len(batches[-1].events) == 1

    # Replay from seq 1. A REQ socket (vLLM's example) gets the first reply only (REQ takes one
    # message per request); a DEALER gets every buffered batch from seq 1 on and the end marker.
    req = zmq_ctx.socket(zmq.REQ)
    req.connect(f"tcp://127.0.0.1:{replay_port}")
    req.send((1).to_bytes(8, "big"))
    assert req.poll(2000)
    assert req.recv_multipart() == msgs[1]
    dealer = zmq_ctx.socket(zmq.DEALER)
    dealer.connect(f"tcp://127.0.0.1:{replay_port}")
    dealer.send_multipart([b"", (1).to_bytes(8, "big")])
    replies = []
    while dealer.poll(2000):
        frames = dealer.recv_multipart()
        assert frames[0] == b""   # the REQ envelope's delimiter
        replies.append(frames[1:])
        if frames[-1] == b"":
            break
    assert replies[:-1] == msgs[1:]   # the missed batches, byte for byte
    assert replies[-1] == [b"", (-1).to_bytes(8, "big", signed=True), b""]   # the end marker
    for s in (sub, req, dealer):
        s.close(linger=0)


def test_config_errors_name_the_key(make_tiny_checkpoint):
    with pytest.raises(ValueError, match=r"kv_events_config has unknown key\(s\) \['bogus'\]"):
        KVEventsConfig.from_any({"enable_kv_cache_events": True, "bogus": 1})
    with pytest.raises(ValueError, match=r"kv_events_config\.buffer_steps must be an int >= 1, got 0"):
        KVEventsConfig.from_any({"buffer_steps": 0})
    with pytest.raises(ValueError, match=r"kv_events_config\.publisher must be one of \('null', 'zmq'\), got 'kafka'"):
        KVEventsConfig.from_any({"publisher": "kafka"})
    with pytest.raises(ValueError, match=r"kv_events_config\.endpoint must be a ZeroMQ address"):
        KVEventsConfig(endpoint="localhost:5557")
    with pytest.raises(ValueError, match=r"kv_events_config\.enable_kv_cache_events must be a bool, got 'yes'"):
        KVEventsConfig.from_any({"enable_kv_cache_events": "yes"})
    with pytest.raises(ValueError, match=r"kv_events_config must be a dict or KVEventsConfig, got str"):
        EngineArgs(kv_events_config="on").create_kv_events_config()
    # Data parallelism: replica r binds both ports + r, so they must be dp apart.
    dp_config = {"enable_kv_cache_events": True, "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}
    with pytest.raises(ValueError, match=r"data_parallel_size=2.*ports 5557 and 5558 must be at least 2 apart "
                                         r"\(e\.g\. replay_endpoint tcp://\*:5559\)"):
        EngineArgs(data_parallel_size=2, kv_events_config=dp_config).create_kv_events_config()
    assert EngineArgs(data_parallel_size=2, kv_events_config={**dp_config, "replay_endpoint": "tcp://*:5559"}) \
        .create_kv_events_config().replay_endpoint == "tcp://*:5559"
    # vLLM's default publisher: zmq when enabled, else null
    assert KVEventsConfig(enable_kv_cache_events=True).publisher == "zmq"
    assert KVEventsConfig().publisher == "null"
    # Through LLM(...): the engine fails before any weight loads.
    with pytest.raises(ValueError, match=r"kv_events_config\.hwm must be an int >= 0, got -1"):
        LLM(make_tiny_checkpoint("llama"), kv_events_config={"enable_kv_cache_events": True, "hwm": -1})


def test_endpoint_offset_per_data_parallel_rank():
    assert offset_endpoint_port("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint_port("tcp://*:5557", 2) == "tcp://*:5559"
    assert offset_endpoint_port("tcp://10.0.0.1:5558", 1) == "tcp://10.0.0.1:5559"
    assert offset_endpoint_port("inproc://kv", 1) == "inproc://kv_dp1"
    assert offset_endpoint_port(None, 3) is None
    with pytest.raises(ValueError, match="no numeric port"):
        offset_endpoint_port("tcp://*:abc", 1)


def test_factory_and_shutdown():
    assert isinstance(EventPublisherFactory.create(None), NullEventPublisher)
    assert isinstance(EventPublisherFactory.create(KVEventsConfig(publisher="zmq")), NullEventPublisher)  # disabled
    config = KVEventsConfig(enable_kv_cache_events=True, endpoint="inproc://kv-test",
                            replay_endpoint="inproc://kv-test-replay")
    publisher = EventPublisherFactory.create(config, data_parallel_rank=1)
    assert isinstance(publisher, ZmqEventPublisher)
    assert (publisher.endpoint, publisher.replay_endpoint) == ("inproc://kv-test_dp1", "inproc://kv-test-replay_dp1")
    batch = KVEventBatch(ts=1.0, events=[AllBlocksCleared()])
    publisher.publish(batch)
    assert batch.data_parallel_rank == 1
    publisher.shutdown()
    publisher.shutdown()   # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        publisher.publish(batch)
