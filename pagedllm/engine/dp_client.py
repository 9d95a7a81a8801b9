"""Data parallelism: ``data_parallel_size`` engine replicas in their own processes behind one front
end (vLLM's DP engine-core client and ``AsyncLLM`` with ``data_parallel_size > 1``).

``EngineCoreClient`` (synchronous; ``LLM(data_parallel_size=D)`` uses it like an ``LLMEngine``):

- tokenizes and validates in the front end (one ``InputProcessor``), converts a GGUF model once,
  then spawns D replica processes (``engine/core_proc.py``), each an ``LLMEngine`` with its own
  scheduler, KV cache and executor (TP x PP ranks of its own);
- sends each request to the replica ``DPLoadBalancer`` picks (least load, prefix affinity;
  ``engine/dp_coordinator.py``) over pyzmq PUSH sockets (``ipc://`` in a private temporary folder),
  and receives every replica's outputs and stats on one PULL socket;
- watches the replicas' process sentinels: a replica that dies is taken out of rotation and its
  in-flight requests fail with ``EngineStepError`` naming it; the others keep serving. With every
  replica dead, ``EngineDeadError``.
- with ``data_parallel_size_local`` L < D (vLLM's multi-instance data parallelism,
  ``engine/dp_layout.py``) spawns ranks 0..L-1 only and waits for ranks L..D-1 to connect over tcp
  from ``--headless`` processes (``engine/dp_remote.py``); a remote rank that goes silent is
  handled like a local replica that died. One stopped on its machine (SIGTERM) drains: nothing new
  is routed to it, its requests finish, then it is marked departed ("stopped", not failed). A
  dead or departed remote rank started again rejoins (hello, then "ready": it is routed to again).
- ``data_parallel_rank`` on a request sends it to that rank instead of the balancer's choice.

``DPAsyncLLM`` wraps it for the server with ``AsyncLLM``'s interface: a receiver thread delivers
outputs to each caller's ``asyncio.Queue``; ``health()`` reports "ok" / "degraded" / "dead".
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import contextlib
import dataclasses
import itertools
import logging
import os
import shutil
import tempfile
import threading
import time
from typing import Any, Iterable

from pagedllm.core.sched_output import SchedulerStats
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.async_engine import (AsyncFrontEnd, EngineDeadError,
                                          EngineStepError, _Failure, _NewRequest, _send_to_loops, _Sink)
from pagedllm.engine.beam_search import BeamSearchParams, check_beam_search_request
from pagedllm.engine.dp_coordinator import DPLoadBalancer
from pagedllm.engine.input_processor import InputProcessor, ProcessedInput, PromptType
from pagedllm.executor.multiproc import stop_processes
from pagedllm.metrics.stats import IterationStats
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class _CallError:
    """A replica's answer to a call whose ``LLMEngine`` method raised ``ValueError`` (its message)."""

    message: str


# Seconds a replica may take to start (load the weights, allocate its KV cache).
REPLICA_START_TIMEOUT_S = 600.0
# Seconds replicas get to leave after "shutdown" before they are terminated.
REPLICA_STOP_TIMEOUT_S = 10.0


# The environment every engine-core process starts with, unless the user set either OpenMP wait
# variable: its OpenMP threads spin only briefly (10,000 spins) when a parallel region ends, then
# sleep. libgomp's default (300,000 spins) holds the cores the front end (the API server's event
# loop, tokenizer, SSE writes) needs on a small or shared machine; OMP_WAIT_POLICY=PASSIVE (no spin)
# wakes a sleeping thread for each of a step's ~80 parallel regions. docs/benchmarks.md has both.
ENGINE_PROCESS_ENV = {"GOMP_SPINCOUNT": "10000"}
# Variables by which a user chooses the wait policy; when either is set, nothing is added.
OPENMP_WAIT_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


@contextlib.contextmanager
def engine_process_env(environ=os.environ):
    """Within the block, ``environ`` holds ``ENGINE_PROCESS_ENV`` unless it has one of
    ``OPENMP_WAIT_VARS`` (a spawned process inherits it: libgomp reads it when torch loads there);
    afterwards the added variables are removed again. A variable the user set is left as it is."""
    user_set = any(key in environ for key in OPENMP_WAIT_VARS)
    added = [] if user_set else [key for key in ENGINE_PROCESS_ENV if key not in environ]
    for key in added:
        environ[key] = ENGINE_PROCESS_ENV[key]
    try:
        yield
    finally:
        for key in added:
            environ.pop(key, None)


def replica_threads(engine_args: EngineArgs, world_size: int, cpu_count: int | None) -> int:
    """torch threads per rank when D replicas of ``world_size`` ranks share this machine's CPUs:
    ``cpu_threads_per_rank`` if set, else max(1, cpu_count // (D x world_size)); D counts only the
    replicas on this machine (``data_parallel_size_local`` when set)."""
    if engine_args.cpu_threads_per_rank not in (None, ""):
        return int(engine_args.cpu_threads_per_rank)
    local = engine_args.data_parallel_size_local or engine_args.data_parallel_size
    return max(1, (cpu_count or 1) // (local * world_size))


class EngineCoreClient:
    """Spawns and drives ``engine_args.data_parallel_size`` engine-core processes (one for
    ``pagedllm serve``'s engine process too); vLLM's name for its client of engine cores.

    Args:
        engine_args: the engine settings; every replica gets them with ``data_parallel_size=1``.
    Attributes:
        num_replicas: D.
        balancer: the ``DPLoadBalancer`` (per-replica load, served counts, liveness).
        stat_loggers: per replica, the ``StatLogger``s its step stats go to.
        initial_stats: per replica, its ``SchedulerStats`` when it became ready.
    Raises:
        ValueError: bad engine arguments (before any replica starts).
        RuntimeError: a replica died or failed while starting.
    """

    def __init__(self, engine_args: EngineArgs) -> None:
        import zmq

        from pagedllm.loaders import load_config, resolve_model
        from pagedllm.tokenizer import Tokenizer

        from pagedllm.engine.dp_layout import DataParallelLayout

        self.args = engine_args
        self.num_replicas = engine_args.data_parallel_size
        self.layout = DataParallelLayout.from_engine_args(engine_args)   # ValueError: a bad DP flag
        files = resolve_model(engine_args.model)   # a GGUF is converted once, here, before the replicas
        self.model_files = files
        self.vllm_config = engine_args.create_engine_config(hf_config=load_config(files.folder),
                                                            model_folder=files.folder)
        model_cfg, cache_cfg, sched_cfg = (self.vllm_config.model_config, self.vllm_config.cache_config,
                                           self.vllm_config.scheduler_config)
        parallel_cfg = self.vllm_config.parallel_config
        self.model_config, self.cache_config, self.scheduler_config = model_cfg, cache_cfg, sched_cfg
        self.parallel_config, self.kernel_config = parallel_cfg, self.vllm_config.kernel_config
        self.tokenizer = Tokenizer.from_pretrained(engine_args.tokenizer or files.folder)
        self.vocab_size = model_cfg.vocab_size
        self.input_processor = InputProcessor(self.tokenizer, sched_cfg.max_model_len, self.vocab_size,
                                              engine_args.max_logprobs,
                                              self.vllm_config.structured_outputs_config,
                                              enable_trace_replay=engine_args.enable_trace_replay,
                                              enable_prompt_embeds=engine_args.enable_prompt_embeds,
                                              hidden_size=model_cfg.hidden_size,
                                              watermark_config=self.vllm_config.watermark_config)
        self.balancer = DPLoadBalancer(self.num_replicas, cache_cfg.block_size, cache_cfg.enable_prefix_caching)
        self.stat_loggers: list[list] = [[] for _ in range(self.num_replicas)]
        self.initial_stats: list = [None] * self.num_replicas
        self.death_reasons: dict[int, str] = {}
        self._ids = itertools.count()
        self._call_ids = itertools.count()
        self._results: dict[int, dict[int, Any]] = {}
        self._call_ranks: dict[int, set[int]] = {}   # call id -> the replicas it was sent to
        self._buffered: list = []
        self._send_lock = threading.Lock()
        self._shutdown_lock = threading.Lock()   # one shutdown at a time (zmq sockets are not thread-safe)

        threads = replica_threads(engine_args, parallel_cfg.world_size, os.cpu_count())
        replica_args = dataclasses.replace(engine_args, data_parallel_size=1, data_parallel_size_local=None,
                                           cpu_threads_per_rank=threads if parallel_cfg.world_size > 1 else None)
        self._tmpdir = tempfile.mkdtemp(prefix="pagedllm_dp_")
        import multiprocessing as mp

        from pagedllm.engine.core_proc import make_socket, run_engine_core

        self._ctx = zmq.Context()
        output_address = f"ipc://{self._tmpdir}/outputs"
        self._outputs = make_socket(self._ctx, zmq.PULL, output_address, bind=True)
        self._inputs: list = []
        self.processes: list = []   # by rank; None for a remote rank
        self._remote = None
        if self.layout.remote_ranks:
            from pagedllm.engine.dp_remote import RemoteRanks

            self._remote = RemoteRanks(self._ctx, self.layout.handshake_address, self.layout.remote_ranks,
                                       self.num_replicas)
            self._remote.is_alive = lambda rank: self.balancer.replicas[rank].alive
        # Stop the replicas at interpreter exit if nobody called shutdown(): registered after
        # multiprocessing's own exit hook, so it runs first (that hook joins non-daemon children,
        # which wait for us). multiprocessing.util registers that hook when first imported, which
        # may be only at the first Process.start() below: import it now. The hook holds this
        # client (a weak reference let a dropped client be collected with its replicas still
        # running, and the exit hung on them); shutdown() unregisters it.
        import multiprocessing.util  # noqa: F401

        atexit.register(self.shutdown)
        ctx = mp.get_context("spawn")
        for i in self.layout.local_ranks:
            address = f"ipc://{self._tmpdir}/input_{i}"
            self._inputs.append(make_socket(self._ctx, zmq.PUSH, address, bind=True))
            # Not a daemon: a replica with several ranks starts worker processes of its own, which
            # a daemonic process may not. It exits on "shutdown", with its parent, or is stopped
            # by stop_processes.
            proc = ctx.Process(target=run_engine_core, args=(replica_args, i, address, output_address, threads,
                                                             logging.getLogger("pagedllm").getEffectiveLevel()),
                               name=f"pagedllm-dp-{i}", daemon=False)
            with engine_process_env():
                proc.start()
            self.processes.append(proc)
        self._inputs.extend([None] * len(self.layout.remote_ranks))
        self.processes.extend([None] * len(self.layout.remote_ranks))
        if self.num_replicas == 1:
            logger.info("engine core process (pid %d): %d rank(s), %d thread(s) per rank",
                        self.processes[0].pid, parallel_cfg.world_size, threads)
        else:
            logger.info("data parallelism: %d replicas (pids %s; None: remote), %d rank(s) each, %d thread(s) "
                        "per rank", self.num_replicas, [p and p.pid for p in self.processes],
                        parallel_cfg.world_size, threads)
        try:
            self._wait_ready()
        except BaseException:
            self.shutdown()
            raise

    # -- LLMEngine-like interface (the offline LLM) -------------------------------------------

    @property
    def max_model_len(self) -> int:
        return self.scheduler_config.max_model_len

    def add_request(self, request_id: str | None, prompt: PromptType | ProcessedInput,
                    params: SamplingParams | None = None, arrival_time: float | None = None,
                    data_parallel_rank: int | None = None) -> str:
        """Validate, pick a replica (``data_parallel_rank`` when given), send the request to it.

        Returns:
            The request id.
        Raises:
            ValueError: a bad prompt or params, a duplicate id, logits processors (callables
                cannot cross processes), or ``data_parallel_rank`` outside [0, D).
            EngineDeadError: every replica is dead.
            EngineStepError: ``data_parallel_rank`` names a dead rank.
        """
        processed = prompt if isinstance(prompt, ProcessedInput) else self.input_processor.process(prompt, params)
        if isinstance(prompt, ProcessedInput) and params is not None:
            raise ValueError("params must be None when the prompt is a ProcessedInput (it carries its params)")
        if processed.params.logits_processors:
            raise ValueError("logits_processors are Python callables and cannot be sent to data-parallel "
                             "replica processes (use data_parallel_size=1)")
        return self._route(request_id, processed, arrival_time, data_parallel_rank=data_parallel_rank)

    def _route(self, request_id: str | None, processed: ProcessedInput, arrival_time: float | None,
               beam: BeamSearchParams | None = None, data_parallel_rank: int | None = None) -> str:
        """Pick a replica for the request (or beam search), record it, send it; its id."""
        request_id = f"dp-{next(self._ids)}" if request_id is None else str(request_id)
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.check_data_parallel_rank(data_parallel_rank)
        with self._send_lock:
            if self.balancer.owner(request_id) is not None:
                raise ValueError(f"request_id {request_id!r} is already running")
            if data_parallel_rank is not None:
                replica = data_parallel_rank
                if not self.balancer.replicas[replica].alive:
                    raise EngineStepError(f"data_parallel_rank={replica}: {self.death_reasons.get(replica, 'dead')}")
                if self.balancer.replicas[replica].draining:
                    raise EngineStepError(f"data_parallel_rank={replica}: {self.replica_name(replica)} is shutting "
                                          "down (stopped on its machine; it finishes its requests, takes no new ones)")
            else:
                try:
                    replica = self.balancer.choose(processed.prompt_token_ids)
                except RuntimeError as e:
                    raise EngineDeadError(f"{e}: {self._deaths()}") from None
            self.balancer.assign(request_id, replica, processed.prompt_token_ids)
            msg = (("add", request_id, processed, arrival_time) if beam is None
                   else ("beam", request_id, processed, arrival_time, beam))
            if not self._send(replica, msg):
                self.balancer.finish(request_id)
                raise EngineStepError(f"{self.replica_name(replica)} cannot be reached (its process is gone); "
                                      f"request {request_id!r} was not queued")
        return request_id

    def check_data_parallel_rank(self, data_parallel_rank: int | None) -> None:
        """Raises:
            ValueError: ``data_parallel_rank`` is neither None nor an int in [0, D)."""
        if data_parallel_rank is not None and (isinstance(data_parallel_rank, bool)
                                               or not isinstance(data_parallel_rank, int)
                                               or not 0 <= data_parallel_rank < self.num_replicas):
            raise ValueError(f"data_parallel_rank must be None or an int in [0, data_parallel_size="
                             f"{self.num_replicas}), got {data_parallel_rank!r}")

    def add_beam_search_request(self, request_id: str | None, prompt: PromptType | ProcessedInput,
                                params: BeamSearchParams, arrival_time: float | None = None,
                                data_parallel_rank: int | None = None) -> str:
        """Send a beam search to one replica (all its beams run there: they share KV blocks); its
        one final ``RequestOutput`` comes back like any other.

        Returns:
            The request id.
        Raises:
            ValueError: a bad prompt or params, a duplicate id, ``beam_width`` above
                ``max_num_seqs`` or no room within ``max_model_len``.
            EngineDeadError: every replica is dead.
        """
        processed = prompt if isinstance(prompt, ProcessedInput) else self.input_processor.process(prompt, params)
        check_beam_search_request(len(processed.prompt_token_ids), params, self.scheduler_config.max_num_seqs,
                                  self.scheduler_config.max_model_len, processed.prompt_embeds)
        return self._route(request_id, processed, arrival_time, params, data_parallel_rank)

    def abort_request(self, request_ids: str | Iterable[str]) -> list[RequestOutput]:
        """Abort requests on their replicas (their blocks are freed there). Returns [] (the
        replicas send no output for an abort)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        by_replica: dict[int, list[str]] = {}
        with self._send_lock:
            for rid in ids:
                replica = self.balancer.owner(rid)
                if replica is not None:
                    by_replica.setdefault(replica, []).append(rid)
                    self.balancer.finish(rid)
            for replica, rids in by_replica.items():
                if self.balancer.replicas[replica].alive:
                    self._send(replica, ("abort", rids))
        return []

    def has_unfinished_requests(self) -> bool:
        return any(r.in_flight for r in self.balancer.replicas)

    def get_num_unfinished_requests(self) -> int:
        return sum(len(r.in_flight) for r in self.balancer.replicas)

    def step(self) -> list[RequestOutput]:
        """Wait for the next outputs of any replica.

        Raises:
            EngineStepError: a replica failed or died with requests of this caller in flight.
        """
        outputs = []
        for event in self.get_events(timeout_s=None):
            if isinstance(event, _Failure):
                raise event.error
            outputs.append(event)
        return outputs

    def call_replicas(self, method: str, **kwargs) -> dict[int, Any]:
        """Run ``LLMEngine.<method>(**kwargs)`` on every live replica and wait for the answers
        (outputs that arrive meanwhile are kept for ``step``). Returns the answers by replica."""
        call_id = self.send_call(method, **kwargs)
        while self.call_results(call_id, pop=False) is None:
            self._buffered.extend(self.get_events(timeout_s=None))
        return self.call_results(call_id)

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Reset every live replica's prefix cache (``LLMEngine.reset_prefix_cache``); True when
        all were cleared."""
        return all(self.call_replicas("reset_prefix_cache", reset_running_requests=reset_running_requests).values())

    def start_profile(self) -> None:
        """``LLMEngine.start_profile`` on every replica (each checks its ``profiler_config``)."""
        if not self.args.create_profiler_config().enabled:
            raise RuntimeError("the profiler is not configured (profiler_config)")
        self.call_replicas("start_profile")

    def stop_profile(self) -> None:
        """``LLMEngine.stop_profile`` on every replica: each writes its workers' traces."""
        if not self.args.create_profiler_config().enabled:
            raise RuntimeError("the profiler is not configured (profiler_config)")
        self.call_replicas("stop_profile")

    # -- events ---------------------------------------------------------------------------

    def send_call(self, method: str, **kwargs) -> int:
        """Ask every live replica to run ``LLMEngine.<method>(**kwargs)`` (picklable keyword
        arguments); the answers arrive as results (``call_results``). Returns the call id."""
        call_id = next(self._call_ids)
        self._results[call_id] = {}
        self._call_ranks[call_id] = set(self.balancer.alive())
        with self._send_lock:
            for i in self.balancer.alive():
                self._send(i, ("call", call_id, method, kwargs))
        return call_id

    def call_results(self, call_id: int, pop: bool = True) -> dict[int, Any] | None:
        """Answers to ``call_id`` by replica, once every replica it was sent to that is still alive
        answered (else None); ``pop``: forget the call then."""
        got = self._results.get(call_id, {})
        if any(i not in got and self.balancer.replicas[i].alive for i in self._call_ranks.get(call_id, ())):
            return None
        if pop:
            self._call_ranks.pop(call_id, None)
            return self._results.pop(call_id, {})
        return got

    def get_events(self, timeout_s: float | None) -> list:
        """The next ``RequestOutput``s and ``_Failure``s from any replica (empty on timeout).

        A replica whose process ended, or a remote rank silent for ``HEARTBEAT_TIMEOUT_S``, is
        taken out of rotation here: its in-flight requests come back as ``_Failure(EngineStepError)``.
        """
        if self._buffered:
            events, self._buffered = self._buffered, []
            return events
        if self._remote is None:
            return self._poll_events(timeout_s)
        from pagedllm.engine.dp_remote import HEARTBEAT_INTERVAL_S

        # Remote ranks are checked at least every heartbeat interval, also while waiting with no timeout.
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = HEARTBEAT_INTERVAL_S if deadline is None else min(HEARTBEAT_INTERVAL_S,
                                                                      max(0.0, deadline - time.monotonic()))
            events = self._poll_events(left)
            alive = [r for r in self.layout.remote_ranks if self.balancer.replicas[r].alive]
            for rank in self._remote.silent(alive):
                events.extend(self._replica_died(rank, f"{self.replica_name(rank)} sent nothing for "
                                                       f"{time.monotonic() - self._remote.last_seen[rank]:.0f} s "
                                                       "(killed, its machine or the network down)"))
            if events or (deadline is not None and time.monotonic() >= deadline):
                return events

    def _poll_events(self, timeout_s: float | None) -> list:
        """One poll of the output sockets and the local replicas' sentinels (see ``get_events``)."""
        import zmq

        poller = zmq.Poller()
        poller.register(self._outputs, zmq.POLLIN)
        if self._remote is not None:
            poller.register(self._remote.sock, zmq.POLLIN)
        sentinels = {}
        for i, proc in enumerate(self.processes):
            if proc is not None and self.balancer.replicas[i].alive:
                sentinels[proc.sentinel] = i
                poller.register(proc.sentinel, zmq.POLLIN)
        ready = dict(poller.poll(None if timeout_s is None else int(timeout_s * 1000)))
        events: list = []
        if self._outputs in ready:
            while self._outputs.poll(0):
                events.extend(self._handle(self._outputs.recv_pyobj()))
        if self._remote is not None and self._remote.sock in ready:
            for msg in self._remote.receive():
                events.extend(self._handle(msg))
        for fd, i in sentinels.items():
            if fd in ready and self.balancer.replicas[i].alive:
                proc = self.processes[i]
                proc.join(timeout=1.0)
                events.extend(self._replica_died(i, f"{self.replica_name(i)} (pid {proc.pid}) died "
                                                    f"(exit code {proc.exitcode})"))
        return events

    def _handle(self, msg: tuple) -> list:
        kind, index = msg[0], msg[1]
        if kind == "outputs":
            _, _, outputs, records, stats = msg
            with self._send_lock:
                for out in outputs:
                    if out.finished:
                        self.balancer.finish(out.request_id)
                self.balancer.update_kv_usage(index, stats.kv_cache_usage)
            for sched_stats, it_stats in records:
                for stat_logger in self.stat_loggers[index]:
                    stat_logger.record(sched_stats, it_stats)
            # Outputs of requests aborted meanwhile are dropped by the caller (unknown ids).
            return outputs
        if kind == "failed":
            _, _, ids, message = msg
            with self._send_lock:
                for rid in ids:
                    self.balancer.finish(rid)
            error = EngineStepError(f"{self.replica_name(index)}: {message}")
            return [_Failure(rid, error) for rid in ids]
        if kind in ("result", "call_error"):
            _, _, call_id, value = msg
            self._results.setdefault(call_id, {})[index] = value if kind == "result" else _CallError(value)
            return []
        if kind == "dead":
            if not self.balancer.replicas[index].alive:   # a rejoining rank that failed while loading
                logger.error("%s failed while rejoining:\n%s", self.replica_name(index), msg[2])
                last = msg[2].strip().splitlines()[-1] if msg[2].strip() else "unknown error"
                self.death_reasons[index] = f"{self.replica_name(index)} failed while rejoining: {last}"
                return []
            logger.error("%s failed:\n%s", self.replica_name(index), msg[2])
            last = msg[2].strip().splitlines()[-1] if msg[2].strip() else "unknown error"
            return self._replica_died(index, f"{self.replica_name(index)} failed: {last}")
        if kind == "draining" and self.balancer.replicas[index].alive:
            with self._send_lock:
                self.balancer.replicas[index].draining = True
            logger.info("%s is shutting down (stopped on its machine): no new requests go to it; its %d "
                        "request(s) finish first", self.replica_name(index),
                        len(self.balancer.replicas[index].in_flight))
            return []
        if kind == "bye" and self.balancer.replicas[index].alive:
            return self._replica_left(index)
        if kind == "ready" and index in self.layout.remote_ranks and not self.balancer.replicas[index].alive:
            with self._send_lock:
                self.balancer.revive(index)
            for ranks in self._call_ranks.values():   # calls sent before it rejoined never reach it
                ranks.discard(index)
            self.death_reasons.pop(index, None)
            self.initial_stats[index] = msg[2]
            logger.info("%s rejoined and is ready; requests go to it again", self.replica_name(index))
            return []
        # Never raise here: the receiver thread must live on (a late or stray message is not fatal).
        logger.warning("dropped an unexpected %r message from %s", kind, self.replica_name(index))
        return []

    def _replica_left(self, index: int) -> list:
        """A remote rank stopped on its machine said "bye" after draining: out of rotation, not an error."""
        with self._send_lock:
            lost = self.balancer.mark_dead(index)
        self.death_reasons[index] = (f"{self.replica_name(index)} stopped (it was shut down on its machine and "
                                     "left; start it again to rejoin)")
        for stat_logger in self.stat_loggers[index]:
            stat_logger.record(SchedulerStats(), IterationStats())
        logger.warning("%s stopped and left; %d replica(s) still serving", self.replica_name(index),
                       len(self.balancer.alive()))
        error = EngineStepError(f"{self.replica_name(index)} stopped before the request finished; it was aborted")
        return [_Failure(rid, error) for rid in lost]

    def _replica_died(self, index: int, reason: str) -> list:
        with self._send_lock:
            lost = self.balancer.mark_dead(index)
        self.death_reasons[index] = reason
        proc = self.processes[index]
        if proc is None:   # a remote rank: tell it to go, in case it still listens
            self._send(index, ("shutdown",))
        elif proc.is_alive():
            proc.kill()   # it ignores SIGTERM (a group-wide signal is the front end's to handle)
        # Its gauges (running / waiting requests, KV usage and blocks) go to 0: it holds nothing.
        for stat_logger in self.stat_loggers[index]:
            stat_logger.record(SchedulerStats(), IterationStats())
        alive = self.balancer.alive()
        logger.error("%s; %d request(s) it still held failed now (a failed step fails its own at once); "
                     "%d replica(s) still serving", reason, len(lost), len(alive))
        error = EngineStepError(f"{reason}; the request was aborted")
        return [_Failure(rid, error) for rid in lost]

    def _send(self, replica: int, msg: tuple) -> bool:
        """Send without blocking (callers hold ``_send_lock``); False when the replica cannot take
        it. The socket's high-water mark is unlimited (``core_proc.make_socket``), so a send fails
        only when no replica process is connected: it has died, and its process sentinel fails its
        requests at the next ``get_events`` (a request that was not sent fails at once, in
        ``_route``)."""
        import zmq

        if self._inputs[replica] is None:   # a remote rank
            if self._remote.send(replica, msg):
                return True
            logger.warning("%s cannot take a %r message (not connected)", self.replica_name(replica), msg[0])
            return False
        try:
            self._inputs[replica].send_pyobj(msg, flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            logger.warning("%s cannot take a %r message (its process is gone)", self.replica_name(replica), msg[0])
            return False

    def replica_name(self, index: int) -> str:
        """How messages name replica ``index``: "the engine process" when there is one (a plain
        ``pagedllm serve``), else "data-parallel replica <index>"."""
        if self.num_replicas == 1:
            return "the engine process"
        if index in self.layout.remote_ranks:
            return f"data-parallel replica {index} (remote, at {self.layout.handshake_address})"
        return f"data-parallel replica {index}"

    def _deaths(self) -> str:
        return "; ".join(self.death_reasons.values()) or "no replica started"

    def _wait_ready(self) -> None:
        """Wait until every rank, local and remote, sent "ready".

        Raises:
            RuntimeError: a replica failed or died while starting, or ranks are missing after
                ``REPLICA_START_TIMEOUT_S`` (remote ones named with the address they should reach).
        """
        import zmq

        deadline = time.monotonic() + REPLICA_START_TIMEOUT_S
        pending = set(range(self.num_replicas))
        while pending:
            poller = zmq.Poller()
            poller.register(self._outputs, zmq.POLLIN)
            if self._remote is not None:
                poller.register(self._remote.sock, zmq.POLLIN)
            sentinels = {self.processes[i].sentinel: i for i in pending if self.processes[i] is not None}
            for fd in sentinels:
                poller.register(fd, zmq.POLLIN)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(self._not_ready_message(pending))
            ready = dict(poller.poll(int(remaining * 1000)))
            messages = []
            while self._outputs.poll(0):
                messages.append(self._outputs.recv_pyobj())
            if self._remote is not None:
                messages.extend(self._remote.receive())
            for msg in messages:
                if msg[0] == "ready":
                    self.initial_stats[msg[1]] = msg[2]
                    pending.discard(msg[1])
                    if self._remote is not None and msg[1] in self.layout.remote_ranks:
                        logger.info("remote data-parallel rank %d is ready", msg[1])
                elif msg[0] == "dead":
                    raise RuntimeError(f"{self.replica_name(msg[1])} failed while starting:\n{msg[2]}")
            for fd, i in sentinels.items():
                if fd in ready and i in pending:
                    proc = self.processes[i]
                    proc.join(timeout=1.0)
                    raise RuntimeError(f"{self.replica_name(i)} (pid {proc.pid}) died while starting "
                                       f"(exit code {proc.exitcode})")

    def _not_ready_message(self, pending: set[int]) -> str:
        local = sorted(i for i in pending if self.processes[i] is not None)
        remote = sorted(i for i in pending if self.processes[i] is None)
        parts = []
        if local:
            parts.append(f"data-parallel replica(s) {local} did not start within {REPLICA_START_TIMEOUT_S:.0f} s")
        if remote:
            silent = [r for r in remote if r not in self._remote.last_seen]
            loading = [r for r in remote if r in self._remote.last_seen]
            if silent:
                layout = self.layout
                parts.append(f"remote data-parallel rank(s) {silent} did not connect to {layout.handshake_address} "
                             f"within {REPLICA_START_TIMEOUT_S:.0f} s (start them with `pagedllm serve MODEL "
                             f"--headless -dp {layout.size} -dpr R --data-parallel-address {layout.address} "
                             f"--data-parallel-rpc-port {layout.rpc_port}` and the same engine flags)")
            if loading:
                parts.append(f"remote data-parallel rank(s) {loading} connected to {self.layout.handshake_address} "
                             f"but were not ready within {REPLICA_START_TIMEOUT_S:.0f} s")
        return "; ".join(parts)

    def health(self) -> dict:
        """``{"status": "ok" | "degraded" | "dead", "engines": {index: "ok" | reason}}`` (a
        draining remote rank: "draining: ..."; a departed one: "... stopped ...")."""
        alive = self.balancer.alive()
        serving = [i for i in alive if not self.balancer.replicas[i].draining]
        status = "ok" if len(serving) == self.num_replicas else ("degraded" if alive else "dead")

        def state(i: int) -> str:
            if i in serving:
                return "ok"
            if i in alive:
                return f"draining: {self.replica_name(i)} is shutting down"
            return self.death_reasons.get(i, "dead")
        return {"status": status, "engines": {str(i): state(i) for i in range(self.num_replicas)}}

    def shutdown(self) -> None:
        """Stop every replica (graceful, then terminate) and close the sockets (idempotent; a call
        while another thread's is under way waits for it and returns)."""
        with self._shutdown_lock:
            if not self.processes:
                return
            with self._send_lock:
                for i, proc in enumerate(self.processes):
                    if proc.is_alive() if proc is not None else self.balancer.replicas[i].alive:
                        self._send(i, ("shutdown",))
            stop_processes([p for p in self.processes if p is not None], REPLICA_STOP_TIMEOUT_S)
            self.processes = []
            for sock in self._inputs + [self._outputs]:
                if sock is not None:
                    sock.close(linger=0)
            if self._remote is not None:
                self._remote.close()   # lingers up to 1 s so the remote ranks get their "shutdown"
            atexit.unregister(self.shutdown)
            self._ctx.term()
            shutil.rmtree(self._tmpdir, ignore_errors=True)





class DPAsyncLLM(AsyncFrontEnd):
    """``AsyncLLM``'s interface over ``EngineCoreClient``: many asyncio callers, D replicas.

    Args:
        client: the started replicas.
    """

    def __init__(self, client: EngineCoreClient) -> None:
        self.client = client
        self._lock = threading.Lock()
        self._sinks: dict[str, _Sink] = {}
        self._calls: dict[int, concurrent.futures.Future] = {}
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()
        self.log_requests = False   # log each request when it is added (enable_log_requests)
        # At interpreter exit without shutdown(), stop the receiver before the client's own exit
        # hook (registered earlier, so run later) closes the sockets it polls.
        atexit.register(self._stop_receiver)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "DPAsyncLLM":
        return cls(EngineCoreClient(args))

    @property
    def _core(self) -> EngineCoreClient:
        return self.client

    @property
    def data_parallel_size(self) -> int:
        """D, the replicas (each beam search runs whole in one of them)."""
        return self.client.num_replicas

    @property
    def errored(self) -> bool:
        return self._stopping or not self.client.balancer.alive()

    @property
    def dead_reason(self) -> str | None:
        """Why nothing more can be served (every replica is dead), or None (see
        ``AsyncLLM.dead_reason``; one dead replica of several is "degraded", not dead)."""
        if self._stopping or self.client.balancer.alive():
            return None
        return (f"every data-parallel replica is dead: {self.client._deaths()}" if self.client.num_replicas > 1
                else self.client._deaths())

    def health(self) -> dict:
        """See ``EngineCoreClient.health``."""
        return self.client.health()

    def check_health(self) -> None:
        """Raises:
            EngineDeadError: shutting down, or every replica is dead (one dead replica is
                "degraded", not an error: the others serve)."""
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")
        if not self.client.balancer.alive():
            raise EngineDeadError(self.dead_reason or "the engine is dead")

    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._receive, name="pagedllm-dp-receiver", daemon=True)
                self._thread.start()

    def _submit(self, prepared: list[_NewRequest], sinks: dict[str, _Sink]) -> None:
        """Each request goes to its ``data_parallel_rank`` or the replica the balancer picks
        (``EngineCoreClient.add_request``)."""
        with self._lock:
            self._claim_request_ids(sinks)
        self.start()
        try:
            for r in prepared:
                if r.beam_params is not None:
                    self.client.add_beam_search_request(r.request_id, r.processed, r.beam_params,
                                                        arrival_time=r.arrival_time,
                                                        data_parallel_rank=r.data_parallel_rank)
                else:
                    self.client.add_request(r.request_id, r.processed, arrival_time=r.arrival_time,
                                            data_parallel_rank=r.data_parallel_rank)
                if self.log_requests:
                    logger.info("Added request %s to data-parallel replica %s: %d prompt tokens, params: %s",
                                r.request_id, self.client.balancer.owner(r.request_id),
                                len(r.processed.prompt_token_ids), r.beam_params or r.processed.params)
        except BaseException:
            self.abort(list(sinks))
            raise

    def _check_data_parallel_rank(self, data_parallel_rank: int | None) -> None:
        self.client.check_data_parallel_rank(data_parallel_rank)

    def _check_request(self, processed: ProcessedInput, beam: BeamSearchParams | None) -> None:
        if beam is not None:
            config = self.client.scheduler_config
            check_beam_search_request(len(processed.prompt_token_ids), beam, config.max_num_seqs, config.max_model_len,
                                      processed.prompt_embeds)
            return
        if processed.params.logits_processors:
            raise ValueError("logits_processors are Python callables and cannot be sent to data-parallel "
                             "replica processes")

    def abort(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests (thread-safe, non-blocking; unknown ids ignored)."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        with self._lock:
            removed = [rid for rid in ids if self._sinks.pop(rid, None) is not None]
        if removed and not self._stopping:
            self.client.abort_request(removed)

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Reset every live replica's prefix cache; True when all were cleared."""
        return all(await self._engine_call("reset_prefix_cache", reset_running_requests=reset_running_requests))

    async def _engine_call(self, method: str, **kwargs) -> list:
        """``LLMEngine.<method>(**kwargs)`` on every live replica; their answers. (A replica sends
        the outputs ``pause_generation`` aborted as ordinary outputs first.)"""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            call_id = self.client.send_call(method, **kwargs)
            self._calls[call_id] = future
        self.start()
        return list((await asyncio.wrap_future(future)).values())

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Fail what is running with ``EngineDeadError``, stop the receiver and the replicas."""
        with self._lock:
            self._stopping = True
            ids = list(self._sinks)
        self._deliver([_Failure(rid, EngineDeadError("the server is shutting down")) for rid in ids])
        self.close_tracer()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        atexit.unregister(self._stop_receiver)
        self.client.shutdown()

    def _stop_receiver(self) -> None:
        """Stop the receiver thread (waits up to 5 s); outputs still on the way are not delivered."""
        self._stopping = True
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(5.0)

    def _receive(self) -> None:
        while not self._stopping:
            try:
                events = self.client.get_events(timeout_s=0.2)
            except Exception:
                if self._stopping:
                    return
                logger.exception("the data-parallel receiver failed")
                continue
            self._deliver(events)
            with self._lock:
                done = [(cid, f) for cid, f in self._calls.items()]
            for call_id, future in done:
                results = self.client.call_results(call_id)
                if results is not None:
                    with self._lock:
                        self._calls.pop(call_id, None)
                    errors = [r.message for r in results.values() if isinstance(r, _CallError)]
                    if errors:
                        future.set_exception(ValueError(errors[0]))
                    else:
                        future.set_result(results)

    def _deliver(self, events: list) -> None:
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        with self._lock:
            for event in events:
                sink = self._sinks.get(event.request_id)
                if isinstance(event, _Failure) or event.finished:
                    self._sinks.pop(event.request_id, None)
                if sink is not None:
                    batches.setdefault(sink.loop, []).append((sink.queue, event))
        _send_to_loops(batches)
