"""KV-cache events: what entered and left the prefix cache, published for an external router
(llm-d, Dynamo) that routes requests by cache content. Semantics, struct and field names, and
wire format follow vLLM's ``vllm/distributed/kv_events.py`` (0.33), so vLLM's subscriber example
(``examples/features/kv_events/kv_events_subscriber.py``) decodes them with its own copies of the
structs.

Events (msgspec Structs, tagged maps in msgpack: ``{"type": "BlockStored", ...}``, fields with
their default value left out):

- ``BlockStored``: full blocks registered in the prefix cache (``BlockPool.cache_full_blocks``):
  their chained hashes, the hash of the block before the first (None at the prompt start), their
  tokens, ``block_size`` and the LoRA adapter.
- ``BlockRemoved``: a registered block evicted (its hash dropped) for reuse.
- ``AllBlocksCleared``: the prefix cache reset.

Per engine step with events, one ``KVEventBatch(ts, events, data_parallel_rank)`` (a msgpack
array; ``ts`` in seconds since the epoch). ``ZmqEventPublisher`` sends it on a PUB socket as the
multipart message ``[topic, seq, payload]``: ``seq`` an 8-byte big-endian counter from 0, one per
batch; ``payload`` the msgpack batch. Its ROUTER socket (``replay_endpoint``) answers a request
whose frame is a start ``seq`` (8 bytes, big-endian) with one message ``[topic, seq, payload]``
per buffered batch from that ``seq`` on, then the end marker ``[b"", seq -1 (8 bytes, signed),
b""]`` (an empty payload).

Block hashes are the 32-byte SHA-256 ``BlockHash`` of ``core/kv_cache_utils.py`` (msgpack bin);
with a hybrid KV cache, ``group_idx`` says which group's table holds the block. No torch here.
"""

from __future__ import annotations

import logging
import queue
import threading
from abc import ABC, abstractmethod
from collections import deque
from itertools import count
from types import MappingProxyType
from typing import Any

import msgspec
import zmq

from pagedllm.config import KVEventsConfig
from pagedllm.core.kv_cache_utils import ExternalBlockHash

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"
"""vLLM's name of the engine's own KV pool (``BlockPool``), on whatever device it lives."""


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One engine step's events (a msgpack array ``[ts, events, data_parallel_rank]``).

    Attributes:
        ts: [s] wall-clock time the batch was made (``time.time()``).
        events: the step's events, in the order they happened.
        data_parallel_rank: the replica that published it (set by the publisher).
    """

    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of the KV-cache events (msgpack maps tagged ``"type": <class name>``)."""


class BlockStored(KVCacheEvent):
    """Consecutive full blocks of one request registered in the prefix cache.

    Attributes:
        block_hashes: their chained hashes, in logical order (32 bytes each).
        parent_block_hash: the hash of the block before the first, or None at the prompt start.
        token_ids: their tokens, ``len(block_hashes) * block_size`` of them.
        block_size: tokens per block.
        lora_id: the adapter's ``lora_int_id`` (deprecated in vLLM; kept for old consumers).
        medium: where the blocks live (``MEDIUM_GPU``: the engine's KV pool).
        lora_name: the adapter's name, or None on the base model.
        extra_keys: per block, what its hash covers besides the tokens
            (``Request.block_hash_extra_keys``), or None when nothing does.
        group_idx: the KV cache group whose table holds the blocks (0 with one group).
        kv_cache_spec_kind, kv_cache_spec_sliding_window: vLLM's group metadata (not sent).
    """

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


class BlockRemoved(KVCacheEvent):
    """Registered blocks evicted from the prefix cache (their hashes no longer hit).

    Attributes:
        block_hashes: the dropped hashes.
        medium: as ``BlockStored.medium``.
        group_idx: as ``BlockStored.group_idx``.
    """

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    """The prefix cache was reset: every hash is gone."""


class KVEventBatch(EventBatch):
    """An ``EventBatch`` of KV-cache events (what subscribers decode)."""

    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def offset_endpoint_port(endpoint: str | None, data_parallel_rank: int) -> str | None:
    """The endpoint data-parallel rank ``data_parallel_rank`` publishes on (vLLM's
    ``ZmqEventPublisher.offset_endpoint_port``): rank 0 the endpoint itself; rank ``r`` a tcp
    port ``+ r`` (``tcp://*:5557`` -> ``tcp://*:5558`` for rank 1), an inproc or ipc name with
    ``_dp<r>`` appended (vLLM rejects ipc here).

    Raises:
        ValueError: for a tcp endpoint without a numeric port, or another scheme.
    """
    if not endpoint or data_parallel_rank == 0:
        return endpoint
    if endpoint.startswith(("inproc://", "ipc://")):
        return f"{endpoint}_dp{data_parallel_rank}"
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if not port.isdigit() or base == "tcp":
            raise ValueError(f"kv_events_config endpoint {endpoint!r} has no numeric port to offset "
                             f"for data-parallel rank {data_parallel_rank}")
        return f"{base}:{int(port) + data_parallel_rank}"
    raise ValueError(f"kv_events_config endpoint must be tcp://, ipc:// or inproc://, got {endpoint!r}")


class EventPublisher(ABC):
    """Publishes one replica's event batches, in order (vLLM's ``EventPublisher``).

    Args:
        data_parallel_rank: the replica; written into each batch's ``data_parallel_rank``.
    """

    def __init__(self, data_parallel_rank: int = 0) -> None:
        self.data_parallel_rank = data_parallel_rank

    @abstractmethod
    def publish(self, events: EventBatch) -> None:
        """Send ``events`` after every batch published before it.

        Raises:
            RuntimeError: after ``shutdown``.
        """

    @abstractmethod
    def shutdown(self) -> None:
        """Send what is queued, then release the sockets (idempotent)."""


class NullEventPublisher(EventPublisher):
    """Drops every batch (``publisher="null"``, or events disabled)."""

    def publish(self, events: EventBatch) -> None:
        return

    def shutdown(self) -> None:
        return


class ZmqEventPublisher(EventPublisher):
    """PUB socket plus a ROUTER replay socket, served by one background thread (vLLM's
    ``ZmqEventPublisher``; wire format in the module docstring).

    The engine thread only puts batches on a bounded queue; the publisher thread encodes them
    (msgpack), numbers them, sends them and keeps the last ``buffer_steps`` payloads for
    replay, and answers replay requests between batches. The sockets are made and bound here,
    so a taken port fails the engine's start, and then used by that thread alone.

    Args:
        data_parallel_rank: the replica; its endpoints are offset by it (``offset_endpoint_port``).
        endpoint, replay_endpoint, buffer_steps, hwm, max_queue_size, topic: as ``KVEventsConfig``.
    Raises:
        zmq.ZMQError: if an endpoint cannot be bound (e.g. the port is taken) or connected.
        ValueError: for an endpoint whose port cannot be offset.
    """

    SHUTDOWN_TIMEOUT_S = 2.0
    """[s] how long ``shutdown`` waits for the thread to send what is queued."""
    END_SEQ = (-1).to_bytes(8, "big", signed=True)
    """The seq frame of the replay's end marker."""
    _POLL_S = 0.02   # [s] the thread's wait for a batch before it looks at the replay socket again

    def __init__(self, data_parallel_rank: int = 0, endpoint: str = "tcp://*:5557",
                 replay_endpoint: str | None = None, buffer_steps: int = 10_000, hwm: int = 100_000,
                 max_queue_size: int = 100_000, topic: str = "") -> None:
        super().__init__(data_parallel_rank)
        self.endpoint = offset_endpoint_port(endpoint, data_parallel_rank)
        self.replay_endpoint = offset_endpoint_port(replay_endpoint, data_parallel_rank)
        self._topic = topic.encode("utf-8")
        self._queue: queue.Queue[EventBatch | None] = queue.Queue(maxsize=max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay = None
        try:
            self._pub.set_hwm(hwm)
            if _binds(self.endpoint):
                self._pub.bind(self.endpoint)
            else:
                self._pub.connect(self.endpoint)
            if self.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                # room for a whole replay and its end marker
                self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))
                self._replay.bind(self.replay_endpoint)
        except Exception:
            self._close_sockets()
            raise
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=f"kv-events-dp{data_parallel_rank}", daemon=True)
        self._thread.start()
        logger.info("KV cache events: publishing on %s (topic %r)%s", self.endpoint, topic,
                    "" if self.replay_endpoint is None else f", replay on {self.replay_endpoint}")

    def publish(self, events: EventBatch) -> None:
        """Queue ``events`` for the thread; blocks while ``max_queue_size`` batches wait.

        Raises:
            RuntimeError: after ``shutdown``.
        """
        if self._closed:
            raise RuntimeError("the KV events publisher is shut down")
        if events.data_parallel_rank is None:
            events.data_parallel_rank = self.data_parallel_rank
        self._queue.put(events)

    def shutdown(self) -> None:
        """Let the thread send what is queued (up to ``SHUTDOWN_TIMEOUT_S``), then close the
        sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            self._queue.put(None, timeout=self.SHUTDOWN_TIMEOUT_S)
        except queue.Full:
            logger.warning("KV events publisher: %d batches still queued at shutdown", self._queue.qsize())
        self._thread.join(self.SHUTDOWN_TIMEOUT_S)
        if self._thread.is_alive():   # its sockets are still in use: leave them to the process exit
            logger.warning("KV events publisher thread did not stop in %.1f s", self.SHUTDOWN_TIMEOUT_S)
            return
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    def _run(self) -> None:
        """The publisher thread: send queued batches in order, serve replay requests."""
        encoder = msgspec.msgpack.Encoder()
        seqs = count()
        while True:
            while self._replay is not None and self._replay.poll(0):
                try:
                    self._serve_replay()
                except Exception:
                    logger.exception("KV events publisher: a replay request failed")
            try:
                batch = self._queue.get(timeout=self._POLL_S)
            except queue.Empty:
                continue
            if batch is None:
                return
            try:
                seq = next(seqs)
                payload = encoder.encode(batch)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
            except Exception:
                logger.exception("KV events publisher: sending a batch failed")

    def _serve_replay(self) -> None:
        """Answer one replay request ``[identity, b"", start_seq]`` (a REQ client's envelope)."""
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events publisher: bad replay request with %d frame(s)", len(frames))
            return
        identity, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in self._buffer:
            if seq >= start_seq:
                self._replay.send_multipart((identity, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((identity, b"", b"", self.END_SEQ, b""))


def _binds(endpoint: str) -> bool:
    """vLLM's rule: bind a wildcard, ipc or inproc endpoint; connect to any other."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


_PUBLISHERS = MappingProxyType({"null": NullEventPublisher, "zmq": ZmqEventPublisher})


class EventPublisherFactory:
    """Builds the publisher a ``KVEventsConfig`` names (vLLM's ``EventPublisherFactory``)."""

    @staticmethod
    def create(config: KVEventsConfig | None, data_parallel_rank: int = 0) -> EventPublisher:
        """A ``NullEventPublisher`` when ``config`` is None, disabled or names "null"; else the
        configured one, for replica ``data_parallel_rank``.

        Raises:
            zmq.ZMQError, ValueError: as ``ZmqEventPublisher``.
        """
        if config is None or not config.enable_kv_cache_events or config.publisher == "null":
            return NullEventPublisher(data_parallel_rank)
        return _PUBLISHERS[config.publisher](
            data_parallel_rank=data_parallel_rank, endpoint=config.endpoint,
            replay_endpoint=config.replay_endpoint, buffer_steps=config.buffer_steps, hwm=config.hwm,
            max_queue_size=config.max_queue_size, topic=config.topic)
