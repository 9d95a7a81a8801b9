"""One data-parallel replica in its own process (vLLM's ``EngineCoreProc``): an ``LLMEngine`` (its
own scheduler, KV cache and executor, possibly TP x PP) driven by messages from the front end.

Channel: pyzmq. The replica PULLs its inbox at ``input_address`` and PUSHes to the front end's one
PULL socket at ``output_address``; every message is one pickled tuple (``send_pyobj``):

- in: ``("add", request_id, ProcessedInput, arrival_time)``, ``("beam", request_id, ProcessedInput,
  arrival_time, BeamSearchParams)`` (a beam search: all its beams in this replica, one final
  output), ``("abort", [request_id, ...])``,
  ``("call", call_id, method, kwargs)`` (an ``LLMEngine`` method with keyword arguments, e.g.
  ``reset_prefix_cache``), ``("shutdown",)``;
- out: ``("ready", index, SchedulerStats)`` once, then per step ``("outputs", index,
  [RequestOutput], [(SchedulerStats, IterationStats)], SchedulerStats)``, ``("failed", index,
  [request_id], message)`` when a step raised (those requests are aborted, the replica goes on),
  ``("result", index, call_id, value)``, ``("call_error", index, call_id, message)`` when the
  method raised ``ValueError`` (a bad argument: the replica goes on, the caller gets the error);
  ``("dead", index, traceback)`` if it cannot go on (also after a step that raised because its executor lost a worker: ``LLMEngine.check_health``).

No message is ever dropped: both directions use zmq's unlimited high-water mark (``SNDHWM`` /
``RCVHWM`` 0, as vLLM's engine-core sockets), so a burst of requests queues in memory instead of
meeting a full queue, and sends block only while no peer is connected.

A remote rank (``--headless``) talks to the front end over tcp instead (``engine/dp_remote.py``):
the same messages, plus a hello, heartbeats, and on its headless process's SIGTERM / SIGINT
``("draining", index)`` then, once its requests finished (or ``drain_timeout_s`` passed: those left
get ``("failed", ...)``), ``("bye", index)``; it exits non-zero when the front end answers its hello
with ``("refused", reason)`` (its rank is served by a live process already).

The replica exits on "shutdown", when its parent is gone (checked every ``IDLE_POLL_MS`` while
idle and while busy; its workers then exit with it, their pipes closed), or on a fatal error.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import time
import traceback

logger = logging.getLogger(__name__)

# Engine calls that abort requests and return their final outputs (finish_reason "abort"): the
# outputs go to the requests' callers as ordinary outputs, the call's result is their number.
ABORTING_CALLS = frozenset({"pause_generation", "abort_request"})
# pause_generation's modes (vLLM's names).
PAUSE_MODES = ("abort", "wait", "keep")

# How long an idle replica waits for a message before checking that its parent still lives (ms);
# a busy one checks as often.
IDLE_POLL_MS = 1000


def make_socket(ctx, kind: int, address: str, bind: bool):
    """A zmq socket that never drops a message: unlimited send and receive high-water marks (the
    default 1000 makes a non-blocking send fail, and a burst of requests was lost that way)."""
    import zmq

    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock


class _StatsCollector:
    """A ``StatLogger`` that keeps each step's stats until they are sent to the front end."""

    def __init__(self) -> None:
        self.records: list = []

    def record(self, scheduler_stats, iteration_stats) -> None:
        self.records.append((scheduler_stats, iteration_stats))


def run_engine_core(*args, **kwargs) -> None:
    """Process entry point of an engine process: ``serve_engine_core(*args, **kwargs)``, then the
    process ends (``utils.process_exit.exit_process``, without the interpreter's ~1 s finalization
    of torch and the model: a server's stop waits for it) with status 0, or the status of a
    ``SystemExit`` (3: the front end refused this rank)."""
    from pagedllm.utils.process_exit import exit_process

    try:
        serve_engine_core(*args, **kwargs)
    except SystemExit as e:   # as multiprocessing's own bootstrap reads it
        if e.code is None or isinstance(e.code, int):
            exit_process(e.code or 0)
        print(e.code, file=sys.stderr)
        exit_process(1)
    exit_process(0)


def serve_engine_core(engine_args, index: int, input_address: str, output_address: str | None, num_threads: int,
                      log_level: int = logging.WARNING, data_parallel_size: int | None = None,
                      stop_event=None, drain_timeout_s: float = 0.0) -> None:
    """Replica ``index``'s work: build the engine, then serve messages until shutdown.
    ``log_level``: the front end's ``pagedllm`` level, so each replica's start-up lines (dtype,
    attention backend, KV blocks and max concurrency, engine ready) show, prefixed ``dp<index>``.

    A remote rank (``--headless``, ``engine/dp_remote.py``) passes ``output_address`` None,
    the front end's ``tcp://`` address as ``input_address`` and its ``data_parallel_size``: one
    DEALER socket carries both directions, with heartbeats; the rank also leaves when that
    connection drops or ``stop_event`` (a ``multiprocessing.Event``; the headless process's
    SIGTERM) is set: it then drains (tells the front end, finishes its requests within
    ``drain_timeout_s``) and says "bye"."""
    # The front end stops us in order: a signal sent to the whole process group (Ctrl-C, `timeout`,
    # `kill -- -PGID`) must not kill us under it. Its death is noticed (the parent pid changes).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format=f"%(asctime)s dp{index} %(levelname)s %(name)s: %(message)s")
    import torch
    import zmq

    from pagedllm.engine.llm_engine import LLMEngine

    torch.set_num_threads(num_threads)
    parent = os.getppid()
    ctx = zmq.Context()
    link = None
    if output_address is None:   # a remote rank: one tcp connection both ways
        from pagedllm.engine.dp_remote import FrontEndLink

        link = FrontEndLink(ctx, input_address, index, data_parallel_size)
        inbox = outbox = link.sock
    else:
        inbox = make_socket(ctx, zmq.PULL, input_address, bind=False)
        outbox = make_socket(ctx, zmq.PUSH, output_address, bind=False)
    parent_checked = time.monotonic()
    engine = None
    drain_deadline = None   # set once the headless process was told to stop: finish, then leave
    said_bye = False
    try:
        if link is not None and link.sock.poll(1000):   # a refusal comes at once; nothing else before "ready"
            msg = link.sock.recv_pyobj()
            if msg[0] == "refused":
                logger.error("replica %d: the front end at %s refused this process: %s", index, input_address, msg[1])
                raise SystemExit(3)
        engine = LLMEngine(engine_args, data_parallel_rank=index)   # KV-cache event ports: + index
        collector = _StatsCollector()
        engine.stat_loggers.append(collector)
        outbox.send_pyobj(("ready", index, engine.scheduler.make_stats()))
        in_engine: set[str] = set()
        while True:
            busy = engine.has_work()
            now = time.monotonic()
            if now - parent_checked >= IDLE_POLL_MS / 1000:
                parent_checked = now
                if os.getppid() != parent:
                    logger.warning("replica %d: the front end (pid %d) is gone; exiting", index, parent)
                    break
            # The stop event is read every iteration (a semaphore read, ~1 us): a drain starts within one
            # step of the signal, before requests that were running when it came can finish unannounced.
            if stop_event is not None and drain_deadline is None and stop_event.is_set():
                if link is None:
                    logger.info("replica %d: asked to stop; exiting", index)
                    break
                drain_deadline = now + drain_timeout_s
                logger.info("replica %d: stopping; finishing %d request(s) (at most %.0f s), then leaving",
                            index, len(in_engine), drain_timeout_s)
                outbox.send_pyobj(("draining", index))
            if drain_deadline is not None and (not engine.has_work() or now >= drain_deadline):
                if in_engine:
                    ids = sorted(in_engine)
                    logger.warning("replica %d: %d request(s) did not finish within %.0f s; failing them",
                                   index, len(ids), drain_timeout_s)
                    outbox.send_pyobj(("failed", index, ids, f"data-parallel rank {index} was stopped and its "
                                                             f"requests did not finish within {drain_timeout_s:.0f} s"))
                    engine.abort_request(ids)
                outbox.send_pyobj(("bye", index))
                said_bye = True
                logger.info("replica %d: left the front end; exiting", index)
                break
            if link is not None:
                link.heartbeat(now)
                if link.front_end_gone():
                    logger.warning("replica %d: the connection to the front end at %s dropped; exiting",
                                   index, input_address)
                    break
            if not inbox.poll(0 if busy else IDLE_POLL_MS):
                messages = []
            else:
                messages = [inbox.recv_pyobj()]
                while inbox.poll(0):
                    messages.append(inbox.recv_pyobj())
            stop = False
            for msg in messages:
                kind = msg[0]
                if kind in ("add", "beam"):
                    _, rid, processed, arrival = msg[:4]
                    try:
                        if kind == "add":
                            engine.add_request(rid, processed, arrival_time=arrival)
                        else:
                            engine.add_beam_search_request(rid, processed, msg[4], arrival_time=arrival)
                        in_engine.add(rid)
                    except Exception as e:
                        outbox.send_pyobj(("failed", index, [rid], f"{type(e).__name__}: {e}"))
                elif kind == "abort":
                    known = [rid for rid in msg[1] if rid in in_engine]
                    in_engine.difference_update(known)
                    if known:
                        engine.abort_request(known)
                elif kind == "call":
                    _, call_id, method, kwargs = msg
                    try:
                        value = getattr(engine, method)(**kwargs)
                    except ValueError as e:   # the caller's bad argument (an adapter folder): the replica goes on
                        outbox.send_pyobj(("call_error", index, call_id, str(e)))
                        continue
                    if method in ABORTING_CALLS:   # the aborted requests' final outputs
                        in_engine.difference_update(out.request_id for out in value)
                        if value:
                            outbox.send_pyobj(("outputs", index, value, [], engine.scheduler.make_stats()))
                        value = len(value)
                    outbox.send_pyobj(("result", index, call_id, value))
                elif kind == "shutdown":
                    stop = True
                elif kind == "refused":
                    logger.error("replica %d: the front end at %s refused this process: %s", index,
                                 input_address, msg[1])
                    raise SystemExit(3)
            if stop:
                break
            outputs = []
            if engine.has_work():
                try:
                    outputs = engine.step()
                except Exception as e:   # fail this replica's requests, keep serving if it can
                    ids = sorted(in_engine)
                    in_engine.clear()
                    logger.exception("replica %d: step failed; failing its %d request(s)", index, len(ids))
                    outbox.send_pyobj(("failed", index, ids, f"the engine step failed: {type(e).__name__}: {e}"))
                    engine.check_health()   # a lost worker: fatal (the "dead" message below)
                    engine.abort_request(ids)
            for out in outputs:
                if out.finished:
                    in_engine.discard(out.request_id)
            if outputs or collector.records:
                outbox.send_pyobj(("outputs", index, outputs, collector.records, engine.scheduler.make_stats()))
                collector.records = []
    except Exception:
        if not said_bye:
            outbox.send_pyobj(("dead", index, traceback.format_exc()))
    finally:
        if engine is not None:
            try:
                engine.shutdown()   # its worker processes go with it
            except Exception:
                logger.exception("replica %d: shutting the engine down failed", index)
        if link is not None:
            link.close()
        else:
            outbox.close(linger=1000)
            inbox.close(linger=0)
        ctx.term()
