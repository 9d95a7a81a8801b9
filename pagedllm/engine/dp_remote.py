"""The tcp link between a front end and its remote data-parallel ranks (vLLM's multi-node DP
handshake, ``--headless``), over pyzmq.

The front end binds one ROUTER socket at ``tcp://data_parallel_address:data_parallel_rpc_port``
(``RemoteRanks``); each remote rank connects one DEALER socket to it (``FrontEndLink``) whose
identity names the rank (``b"dp-rank-<r>"``), and both directions share that connection:

- rank -> front end: ``("hello", rank, data_parallel_size)`` as soon as it connects (before its
  model loads), then the messages of ``engine/core_proc.py`` (``("ready", ...)`` once it has loaded,
  outputs, failures, results, ``("dead", ...)``), and ``("heartbeat", rank)`` every
  ``HEARTBEAT_INTERVAL_S``; on SIGTERM / SIGINT ``("draining", rank)`` (the front end routes nothing
  new to it), its in-flight requests finish (at most the headless ``--shutdown-timeout``), then
  ``("bye", rank)``: the front end marks it departed (stopped, not crashed);
- front end -> rank: ``core_proc``'s requests (add, beam, abort, call, shutdown), and
  ``("refused", reason)`` to a hello for a rank that is connected and alive (the new process exits
  non-zero).

Rejoining: a hello for a rank the front end holds dead or departed is accepted (the process with the
new identity replaces the old one: fresh load-balancer state, nothing in flight); after its "ready"
it is routed to again. Messages from an identity that is not the rank's current one are dropped.

Each message is one **pickled** Python tuple (requests carry ``ProcessedInput``: token ids and
``SamplingParams``; outputs carry ``RequestOutput`` and stats), as on the local ``ipc://`` path.
Unpickling runs code of the sender's choosing: anyone who can reach the port can run code in the
front end, and a fake front end can run code in a rank. Bind it to a private network only, never to
an untrusted one (vLLM's engine-core sockets are the same).

Liveness: the front end fails a rank that has sent nothing for ``HEARTBEAT_TIMEOUT_S`` after it was
ready (killed, its machine gone, the network cut) like a local replica whose process died; a rank
leaves when its connection to the front end drops (a zmq socket monitor), on "shutdown", or (draining
first) when its headless process gets SIGTERM / SIGINT.
"""

from __future__ import annotations

import logging
import os
import pickle
import time

logger = logging.getLogger(__name__)

# Seconds between a remote rank's heartbeats (it sends one per idle poll as well).
HEARTBEAT_INTERVAL_S = 1.0
# Seconds of silence after which the front end declares a ready remote rank dead.
HEARTBEAT_TIMEOUT_S = 10.0


def rank_identity(rank: int) -> bytes:
    """A fresh zmq identity for a process serving remote rank ``rank`` (a restarted rank gets
    another one, so that the front end tells it from the one it replaces)."""
    return b"dp-rank-%d-%s" % (rank, os.urandom(6).hex().encode())


def _rank_of(identity: bytes) -> int | None:
    prefix = b"dp-rank-"
    if not identity.startswith(prefix):
        return None
    rank = identity[len(prefix):].split(b"-", 1)[0]
    return int(rank) if rank.isdigit() else None


class RemoteRanks:
    """The front end's side: the ROUTER socket remote ranks connect to.

    Args:
        ctx: the front end's ``zmq.Context``.
        address: ``tcp://host:port`` to bind (``DataParallelLayout.handshake_address``).
        ranks: the ranks expected there.
        size: ``data_parallel_size`` (a rank started with another one is refused).
        is_alive: rank -> whether the front end holds it alive (a hello for such a rank from another
            process is refused); set by the owner, by default every rank that said hello is.
    Attributes:
        last_seen: rank -> ``time.monotonic()`` of its last message (only ranks that said hello).
        identities: rank -> the zmq identity of the process now serving it.
    Raises:
        RuntimeError: the address cannot be bound (in use, not this machine's), naming it.
    """

    def __init__(self, ctx, address: str, ranks: range, size: int) -> None:
        import zmq

        self.address = address
        self.ranks = ranks
        self.size = size
        self.last_seen: dict[int, float] = {}
        self.identities: dict[int, bytes] = {}
        self.is_alive = lambda rank: True
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)   # a send to a gone rank raises, is not dropped
        try:
            self.sock.bind(address)
        except zmq.ZMQError as e:
            self.sock.close(linger=0)
            raise RuntimeError(f"cannot listen for remote data-parallel ranks at {address}: {e}") from None
        logger.info("waiting for remote data-parallel rank(s) %s at %s", list(ranks), address)

    def send(self, rank: int, msg: tuple) -> bool:
        """Send ``msg`` to ``rank`` without blocking; False when it is not connected."""
        identity = self.identities.get(rank)
        return identity is not None and self._send_to(identity, msg)

    def _send_to(self, identity: bytes, msg: tuple) -> bool:
        import zmq

        try:
            self.sock.send_multipart([identity, pickle.dumps(msg)], flags=zmq.NOBLOCK)
            return True
        except zmq.ZMQError:   # EHOSTUNREACH (not connected) or EAGAIN
            return False

    def receive(self) -> list[tuple]:
        """Every message waiting, as ``core_proc`` tuples; hellos and heartbeats only update
        ``last_seen``. A hello from an unexpected rank or with another ``data_parallel_size``
        comes back as ``("dead", rank, reason)`` when the rank is expected, else is logged and dropped.
        A hello for a rank that another process serves and ``is_alive`` is answered "refused"; for
        one that is not alive (dead, departed) the new process replaces the old one (a rejoin).
        Messages from a process that does not (or no longer) serve its rank are logged and dropped."""
        import zmq

        messages = []
        while self.sock.poll(0):
            identity, payload = self.sock.recv_multipart(flags=zmq.NOBLOCK)
            rank = _rank_of(identity)
            if rank not in self.ranks:
                logger.warning("a data-parallel rank with identity %r connected to %s; expected ranks %s; ignored",
                               identity, self.address, list(self.ranks))
                continue
            msg = pickle.loads(payload)
            current = self.identities.get(rank)
            if msg[0] == "hello":
                if current is not None and current != identity and self.is_alive(rank):
                    reason = (f"data-parallel rank {rank} is already served by a live process connected to "
                              f"{self.address} (last heard from {time.monotonic() - self.last_seen[rank]:.0f} s "
                              "ago); stop it first, or if it is gone wait until the front end declares it dead")
                    logger.warning("refused a second process for %s", reason)
                    self._send_to(identity, ("refused", reason))
                    continue
                self.identities[rank] = identity
                self.last_seen[rank] = time.monotonic()
                if msg[2] != self.size:
                    messages.append(("dead", rank, f"it was started with data_parallel_size={msg[2]}, "
                                                   f"the front end has {self.size}"))
                else:
                    logger.info("remote data-parallel rank %d connected to %s%s; loading", rank, self.address,
                                "" if current is None or current == identity else " again (a rejoin)")
                continue
            if identity != current:
                logger.warning("dropped a %r message from %r: it does not serve data-parallel rank %d (now)",
                               msg[0], identity, rank)
                continue
            self.last_seen[rank] = time.monotonic()
            if msg[0] != "heartbeat":
                messages.append(msg)
        return messages

    def silent(self, ranks, now: float | None = None) -> list[int]:
        """Those of ``ranks`` that sent nothing for ``HEARTBEAT_TIMEOUT_S``."""
        now = time.monotonic() if now is None else now
        return [r for r in ranks if now - self.last_seen.get(r, now) > HEARTBEAT_TIMEOUT_S]

    def close(self) -> None:
        self.sock.close(linger=1000)


class FrontEndLink:
    """A remote rank's side: its DEALER socket to the front end (both directions) and a monitor
    that sees the connection drop. Sends the hello at once (zmq queues it until connected).

    Args:
        ctx: the rank's ``zmq.Context``.
        address: the front end's ``tcp://host:port``.
        rank: this rank.
        size: ``data_parallel_size`` as this rank was started with.
    """

    def __init__(self, ctx, address: str, rank: int, size: int) -> None:
        import zmq

        self.rank = rank
        self.address = address
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, rank_identity(rank))
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.sock.connect(address)
        self._connected = False
        self._last_heartbeat = time.monotonic()
        self.sock.send_pyobj(("hello", rank, size))

    def heartbeat(self, now: float) -> None:
        """Send a heartbeat when ``HEARTBEAT_INTERVAL_S`` has passed since the last one."""
        if now - self._last_heartbeat >= HEARTBEAT_INTERVAL_S:
            self._last_heartbeat = now
            self.sock.send_pyobj(("heartbeat", self.rank))

    def front_end_gone(self) -> bool:
        """True once the connection, after it was made, has dropped (the front end exited or is unreachable)."""
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor, flags=zmq.NOBLOCK)["event"]
            if event == zmq.EVENT_CONNECTED:
                self._connected = True
            elif event == zmq.EVENT_DISCONNECTED and self._connected:
                return True
        return False

    def close(self) -> None:
        self.sock.disable_monitor()
        self._monitor.close(linger=0)
        self.sock.close(linger=1000)
