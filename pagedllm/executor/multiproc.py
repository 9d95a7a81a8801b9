"""``MultiprocExecutor``: one worker process per rank, joined in one torch.distributed process group
(vLLM V1's ``MultiprocExecutor``, over multiprocessing pipes instead of a shared-memory queue).

Processes and groups:
- The engine process starts ``world_size`` workers (torch.multiprocessing) from a fork server
  (``WORKER_START_METHOD``): a clean single-threaded process, started once per engine process, that
  imports torch and the worker code once (``WORKER_PRELOAD``) and forks each worker from that state,
  so a worker starts in a fraction of a second instead of importing torch again (~3 s of CPU each;
  an engine built a second time in the same process starts its workers without any import). No
  OpenMP thread exists in the fork server, so forking it is safe where forking an engine process
  that has run torch ops would not be; the environment the workers see is the one the engine
  process had when the fork server started. Where no fork server exists (Windows), ``spawn``. The workers
  form the process group (gloo on the CPU, NCCL on CUDA; rendezvous through a file in a private
  temporary folder). The engine process is NOT a member: tensors move between ranks only
  (all-reduce, all-gather, pipeline send/recv), never to the engine.
- Each worker has one duplex ``multiprocessing.Pipe`` to the engine. A call (``collective_rpc``) is
  pickled ONCE and the same bytes are written to every rank's pipe; every rank answers on its
  pipe (``("ok", result)`` or ``("error", traceback)``). Per step this is one
  ``SchedulerOutput`` out and, from the driver rank (tensor rank 0 of the last pipeline stage), one
  ``ModelRunnerOutput`` back; the other ranks answer ``None``.
- Batches in flight (pipeline parallelism): ``execute_model(..., non_block=True)`` writes the step
  and returns a ``PendingCall`` at once; the engine writes up to ``pipeline_parallel_size`` steps
  before reading the oldest answer, so stage 0 starts step k+1 while stage 1 runs step k. Ranks
  run their calls in order and answer in order, so answers are read oldest first. Each worker
  reads its pipe in a thread, so the engine's writes never wait for a busy rank (no deadlock
  with a rank writing a large answer nobody reads yet).
- A step with constrained rows is two calls (vLLM V1's split): ``execute_model`` with
  ``grammar_bitmask_follows`` (every rank answers None once its forward is done), then, as soon
  as the engine has filled the bitmask, ``sample_tokens`` with it (the driver answers the step's
  output). Both go through the same pipes and failure handling.

Failures: while waiting, the executor also waits on every worker's process sentinel, so a worker
that dies (killed, out of memory, a crash in C++) is noticed at once, and one that raises answers
with its traceback. Either way the executor raises ``RuntimeError`` naming the rank, stops every
worker (the survivors may be blocked in a collective with the dead one) and refuses later calls;
the async engine turns that into failed requests (HTTP 500, then 503 once it is shut down).

Workers ignore SIGINT (Ctrl-C reaches the whole process group; the engine shuts them down in
order) and exit when their pipe closes, i.e. when the engine process exits for any reason.
"""

from __future__ import annotations

import logging
import os
import pickle
import shutil
import signal
import queue
import tempfile
import threading
import time
import traceback
import weakref
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any

from pagedllm.config import CacheConfig, KernelConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.executor.abstract import MultiRankExecutor

logger = logging.getLogger(__name__)

# Seconds a worker may take to start (import torch, join the process group) before the engine
# gives up on it; a worker that dies sooner is reported at once.
WORKER_START_TIMEOUT_S = 300.0
# How workers start (see the module docstring); ``spawn`` where the platform has no fork server.
WORKER_START_METHOD = "forkserver"
# Imported once by the fork server, so that each forked worker has them already.
WORKER_PRELOAD = ("torch", "pagedllm.worker.worker")
# Seconds the engine waits for workers to leave after "shutdown" before terminating them.
WORKER_STOP_TIMEOUT_S = 10.0
# The calls that run (part of) a step: only the driver rank's answer is sent back whole.
STEP_METHODS = ("execute_model", "sample_tokens")


def threads_per_rank(parallel_config: ParallelConfig, cpu_count: int | None) -> int:
    """torch threads each worker process uses on the CPU.

    Returns:
        ``parallel_config.cpu_threads_per_rank`` if set, else ``max(1, cpu_count // world_size)``.
        More ranks than CPUs still run (vLLM's behaviour: ``tensor_parallel_size=4`` on a 2-CPU
        machine works, slowly): each rank gets one thread, the ranks share the cores, and a
        WARNING says so.
    """
    if parallel_config.cpu_threads_per_rank is not None:
        return parallel_config.cpu_threads_per_rank
    world = parallel_config.world_size
    cpus = cpu_count or 1
    if cpus < world:
        logger.warning("%d ranks (tensor_parallel_size x pipeline_parallel_size) on %d CPU(s): one thread each, "
                       "%d ranks share each core, which is slower than fewer ranks", world, cpus, -(-world // cpus))
    return max(1, cpus // world)


def worker_log_settings(rank: int, driver_rank: int) -> tuple[int, str]:
    """(level, line prefix) for a worker process's log, from the engine process's: the driver
    rank logs at the engine's ``pagedllm`` level (its start-up lines: dtype, attention backend,
    weights, KV blocks and max concurrency), the other ranks only warnings and errors (the same
    lines again would add nothing). The prefix names the rank, after the data-parallel replica
    (``dp1 rank0``) when the engine runs in one."""
    import multiprocessing

    level = logging.getLogger("pagedllm").getEffectiveLevel()
    parent = multiprocessing.current_process().name
    replica = parent.removeprefix("pagedllm-").replace("-", "")   # "pagedllm-dp-1" -> "dp1"
    prefix = f"{replica} rank{rank}" if parent.startswith("pagedllm-dp-") else f"rank{rank}"
    return (level if rank == driver_rank else max(level, logging.WARNING)), prefix


class _InheritedFd:
    """An open file descriptor of the engine process, handed to a worker when it starts: pickled
    while ``Process.start`` runs, it becomes ``multiprocessing.reduction.DupFd`` (sent over the fork
    server's socket, or inherited by a spawned child); ``detach()`` in the worker gives its copy."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return _detach_fd, (reduction.DupFd(self.fd),)


def _detach_fd(dup_fd) -> int:
    return dup_fd.detach()


def _engine_stdio() -> tuple["_InheritedFd | None", "_InheritedFd | None"]:
    """This process's stdout and stderr (file descriptors 1 and 2) to hand to a worker; None for
    one that is closed (a daemon's), which the worker then leaves as it is."""
    def open_fd(fd: int) -> "_InheritedFd | None":
        try:
            os.fstat(fd)
        except OSError:
            return None
        return _InheritedFd(fd)
    return open_fd(1), open_fd(2)


def _redirect_stdio(stdio_fds: tuple[int | None, int | None] | None) -> None:
    """Point this worker's stdout / stderr (file descriptors 1 and 2) at the engine process's
    current ones. A forked worker would otherwise write where the fork server's were when it
    started (e.g. a file that a test or a caller redirected to once)."""
    if stdio_fds is None:
        return
    for target, fd in zip((1, 2), stdio_fds):
        if fd is not None and fd != target:
            os.dup2(fd, target)
            os.close(fd)


def _worker_main(rank: int, configs: tuple, init_method: str, conn: Connection, num_threads: int,
                 log_settings: tuple[int, str] = (logging.WARNING, ""),
                 stdio_fds: tuple[int | None, int | None] | None = None) -> None:
    """A worker process: build the ``Worker``, answer calls from the engine until "shutdown" or EOF.
    ``log_settings``: (level, line prefix) from ``worker_log_settings``; ``stdio_fds``: the engine
    process's stdout and stderr (``_InheritedFd``), made this process's."""
    _redirect_stdio(stdio_fds)
    # The engine stops us in order (a group-wide SIGINT / SIGTERM must not kill us under it); its
    # death closes the pipe, and EOF ends this process.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    level, prefix = log_settings
    logging.basicConfig(level=level, format=f"%(asctime)s {prefix or f'rank{rank}'} %(levelname)s %(name)s: %(message)s")
    import torch

    from pagedllm.worker.worker import Worker

    torch.set_num_threads(num_threads)
    worker = None
    # A thread reads the engine's calls as they come, so the engine never blocks writing a call
    # while this process is busy (or writing a large answer): with batches in flight the engine
    # writes the next step before reading this one's answer. None: the pipe closed.
    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def read_calls() -> None:
        try:
            while True:
                inbox.put(conn.recv_bytes())
        except (EOFError, OSError):   # the engine is gone (or we closed the pipe)
            inbox.put(None)

    threading.Thread(target=read_calls, name="pagedllm-worker-inbox", daemon=True).start()
    try:
        model_config, cache_config, scheduler_config, parallel_config, kernel_config = configs
        worker = Worker(model_config, cache_config, scheduler_config, parallel_config, kernel_config, rank=rank,
                        distributed_init_method=init_method)
        worker.init_device()   # joins the process group
        conn.send(("ok", None))
        while True:
            payload = inbox.get()
            if payload is None:
                break
            method, args, kwargs = pickle.loads(payload)
            if method == "shutdown":
                break
            try:
                result = getattr(worker, method)(*args, **kwargs)
                if method in STEP_METHODS and not worker.parallel.is_driver:
                    result = None   # only the driver's sampled tokens go back
                conn.send(("ok", result))
            except Exception:
                conn.send(("error", traceback.format_exc()))
    except Exception:
        try:
            conn.send(("error", traceback.format_exc()))
        except (OSError, ValueError):
            pass
    finally:
        if worker is not None:
            try:
                worker.shutdown()
            except Exception:   # leaving a broken process group: nothing left to do
                pass
        conn.close()


class MultiprocExecutor(MultiRankExecutor):
    """One worker process per rank (``tensor_parallel_size x pipeline_parallel_size``).

    Args:
        model_config, cache_config, scheduler_config, parallel_config, kernel_config: see ``Executor``;
            ``model_config.model_folder`` must be a safetensors folder (the engine converts a
            GGUF file once, before the workers start).
    Attributes:
        driver_rank: the rank whose ``ModelRunnerOutput`` is returned.
        processes: the worker processes, by rank.
        max_num_batches_in_flight: the most steps ever written to the ranks while none of their
            outputs had been read (up to ``max_concurrent_batches`` with pipeline parallelism).
    Raises:
        ValueError: (at construction, before anything starts) if the CPU has fewer threads than
            ranks and ``cpu_threads_per_rank`` is not set.
    """

    uses_in_process_worker = False

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig, scheduler_config: SchedulerConfig,
                 parallel_config: ParallelConfig, kernel_config: KernelConfig) -> None:
        super().__init__(model_config, cache_config, scheduler_config, parallel_config, kernel_config)
        from pagedllm.distributed.parallel_state import driver_rank

        self.world_size = parallel_config.world_size
        self.driver_rank = driver_rank(parallel_config)
        on_cpu = model_config.device in (None, "cpu")
        self.num_threads = threads_per_rank(parallel_config, os.cpu_count()) if on_cpu else 1
        self.processes: list = []
        self.conns: list[Connection] = []
        self._tmpdir: str | None = None
        self._finalizer = None
        # Calls written to the ranks whose answers are not read yet, oldest first (the ranks
        # answer in call order).
        self._pending: deque[PendingCall] = deque()
        self.max_num_batches_in_flight = 0

    # -- lifecycle ------------------------------------------------------------------------

    def initialize(self) -> None:
        """Spawn the workers, join them in the process group, load the weights on every rank.

        Raises:
            RuntimeError: if a worker dies or fails while starting (naming the rank).
        """
        import torch.multiprocessing as mp

        if WORKER_START_METHOD in mp.get_all_start_methods():
            ctx = mp.get_context(WORKER_START_METHOD)
            ctx.set_forkserver_preload(list(WORKER_PRELOAD))
        else:
            ctx = mp.get_context("spawn")
        self._tmpdir = tempfile.mkdtemp(prefix="pagedllm_dist_")
        init_method = "file://" + os.path.join(self._tmpdir, "rendezvous")
        configs = (self.model_config, self.cache_config, self.scheduler_config, self.parallel_config,
                   self.kernel_config)
        for rank in range(self.world_size):
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=_worker_main, args=(rank, configs, init_method, child, self.num_threads,
                                                          worker_log_settings(rank, self.driver_rank),
                                                          _engine_stdio()),
                               name=f"pagedllm-worker-{rank}", daemon=True)
            proc.start()
            child.close()
            self.processes.append(proc)
            self.conns.append(parent)
        # Stop the workers if the engine is dropped without shutdown().
        self._finalizer = weakref.finalize(self, _stop_workers, list(self.processes), list(self.conns),
                                           self._tmpdir)
        logger.info("MultiprocExecutor: %d worker processes (tensor_parallel_size=%d, pipeline_parallel_size=%d, "
                    "%d threads each), driver rank %d", self.world_size, self.parallel_config.tensor_parallel_size,
                    self.parallel_config.pipeline_parallel_size, self.num_threads, self.driver_rank)
        self._collect(timeout_s=WORKER_START_TIMEOUT_S, what="start")
        # Every rank has joined every group: the rendezvous file is no longer read, and removing
        # it now leaves nothing behind even if this process is killed later.
        shutil.rmtree(self._tmpdir, ignore_errors=True)
        self.collective_rpc("load_model")

    @property
    def max_concurrent_batches(self) -> int:
        """``pipeline_parallel_size``: one batch per stage can be in flight."""
        return self.parallel_config.pipeline_parallel_size

    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> "ModelRunnerOutput | PendingCall":
        """Send the step's message to every rank (pickled once); return the driver's output.

        Args:
            non_block: return a ``PendingCall`` at once (its ``result()`` reads the answers of
                every earlier call first: the ranks answer in the order they were called).
        Raises:
            RuntimeError: if a worker died or raised (this step or before), naming the rank
                (from ``result()`` with ``non_block``).
        """
        call = self._send("execute_model", (scheduler_output,), {}, pick_rank=self.driver_rank)
        in_flight = sum(1 for c in self._pending if c.method == "execute_model")
        self.max_num_batches_in_flight = max(self.max_num_batches_in_flight, in_flight)
        return call if non_block else call.result()

    def sample_tokens(self, grammar_bitmask, non_block: bool = False) -> "ModelRunnerOutput | PendingCall":
        """[structured output] The second, small message of a step sent with
        ``grammar_bitmask_follows`` (``Executor.sample_tokens``): written to every rank right
        away (a rank reads it after the step's forward); the driver's answer is the step's output.
        The step's ``execute_model`` answers (None) are read first, in call order, so a rank that
        failed in the forward is reported as before.

        Raises:
            RuntimeError: if a worker died or raised (in the forward or in sampling), naming the rank.
        """
        call = self._send("sample_tokens", (grammar_bitmask,), {}, pick_rank=self.driver_rank)
        return call if non_block else call.result()

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None,
                       timeout_s: float | None = None) -> list[Any]:
        """Call ``Worker.<method>(*args, **kwargs)`` on every rank; one result per rank.

        Steps still in flight are finished first (their outputs kept for their futures).

        Args:
            timeout_s: seconds to wait for every answer (None: no limit; a dead worker is found
                through its process sentinel regardless).
        Raises:
            RuntimeError: if a worker died, raised, or did not answer within ``timeout_s``.
        """
        while self._pending:
            self._collect_oldest()
        return self._send(method, args, kwargs or {}).result(timeout_s)

    def check_health(self) -> None:
        """Raises:
            RuntimeError: if a worker process is gone or has failed."""
        self._check_alive()
        for rank, proc in enumerate(self.processes):
            if not proc.is_alive():
                self._fail(f"worker rank {rank} (pid {proc.pid}) is not running (exit code {proc.exitcode})")

    def shutdown(self) -> None:
        """Ask every worker to leave, then terminate stragglers (idempotent)."""
        if self._finalizer is not None:
            self._finalizer()
        self._finalizer = None
        self.processes, self.conns = [], []

    # -- internals ------------------------------------------------------------------------

    def _send(self, method: str, args: tuple, kwargs: dict[str, Any], pick_rank: int | None = None) -> "PendingCall":
        """Write the call (pickled once) to every rank's pipe; its answers are read later."""
        self._check_alive()
        payload = pickle.dumps((method, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)
        for rank, conn in enumerate(self.conns):
            try:
                conn.send_bytes(payload)
            except (OSError, ValueError):
                self._fail(f"worker rank {rank} cannot be reached (pid {self.processes[rank].pid}, exit code "
                           f"{self.processes[rank].exitcode})")
        call = PendingCall(self, method, pick_rank)
        self._pending.append(call)
        return call

    def _collect_oldest(self, timeout_s: float | None = None) -> None:
        """Read every rank's answer to the oldest call still pending and hand it to its ``PendingCall``."""
        self._check_alive()
        call = self._pending[0]
        results = self._collect(timeout_s=timeout_s, what=call.method)
        self._pending.popleft()
        call._set(results if call.pick_rank is None else results[call.pick_rank])

    def _oldest_answered(self, call: "PendingCall") -> bool:
        """Whether ``call`` is the oldest pending call and every rank's answer to it is readable."""
        return (bool(self._pending) and self._pending[0] is call and self._failure is None
                and all(conn.poll() for conn in self.conns))

    def _has_workers(self) -> bool:
        return bool(self.processes)

    def _stop_workers_now(self) -> None:
        self._pending.clear()
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
            _stop_workers(self.processes, self.conns, self._tmpdir, graceful=False)
        self.processes, self.conns = [], []

    def _collect(self, timeout_s: float | None, what: str) -> list[Any]:
        """One answer per rank, waiting on the pipes and on the processes' sentinels."""
        results: list[Any] = [None] * self.world_size
        pending = {conn: rank for rank, conn in enumerate(self.conns)}
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.processes)}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while pending:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            ready = wait(list(pending) + list(sentinels), timeout=remaining)
            if not ready:
                self._fail(f"worker rank(s) {sorted(pending.values())} did not answer {what!r} within {timeout_s:.0f} s")
            answered = [r for r in ready if r in pending]
            for conn in answered:   # answers first: a worker that raised and exited sent its traceback
                rank = pending.pop(conn)
                try:
                    status, value = conn.recv()
                except (EOFError, OSError):
                    proc = self.processes[rank]
                    proc.join(timeout=1.0)
                    self._fail(f"worker rank {rank} (pid {proc.pid}) died during {what!r} (exit code {proc.exitcode})")
                if status == "error":
                    self._fail(f"worker rank {rank} failed during {what!r}:\n{value}")
                results[rank] = value
            for sentinel in ready:
                rank = sentinels.get(sentinel)
                if rank is not None and self.conns[rank] in pending and not self.conns[rank].poll():
                    proc = self.processes[rank]
                    proc.join(timeout=1.0)
                    self._fail(f"worker rank {rank} (pid {proc.pid}) died during {what!r} (exit code {proc.exitcode})")
        return results


class PendingCall:
    """A call written to every rank whose answers are read on demand (a future without a thread).

    ``result()`` reads the answers of every earlier pending call first (pipes are FIFO), then
    this one's. Its value: the picked rank's answer, or the list of every rank's answers.
    """

    def __init__(self, executor: MultiprocExecutor, method: str, pick_rank: int | None) -> None:
        self._executor = executor
        self.method = method
        self.pick_rank = pick_rank
        self._done = False
        self._value: Any = None

    def _set(self, value: Any) -> None:
        self._value, self._done = value, True

    def done(self) -> bool:
        """True when ``result()`` will not wait (read already, or every rank's answer is ready);
        earlier calls already answered are read on the way (a step's ``execute_model`` before
        its ``sample_tokens``)."""
        executor = self._executor
        while not self._done and executor._pending and executor._pending[0] is not self \
                and executor._oldest_answered(executor._pending[0]):
            executor._collect_oldest()
        return self._done or executor._oldest_answered(self)

    def result(self, timeout_s: float | None = None) -> Any:
        """The answer (waiting for it).

        Raises:
            RuntimeError: if a worker died, raised, or did not answer within ``timeout_s``.
        """
        while not self._done:
            self._executor._collect_oldest(timeout_s)
        return self._value


def stop_processes(processes: list, grace_s: float) -> None:
    """Wait up to ``grace_s`` seconds (all together) for ``processes`` to exit, then kill (SIGKILL)
    each one still alive (our rank and engine-core processes ignore SIGTERM: see ``_worker_main``)."""
    deadline = time.monotonic() + grace_s
    for proc in processes:
        if grace_s > 0:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in processes:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=2.0)


def _stop_workers(processes: list, conns: list[Connection], tmpdir: str | None, graceful: bool = True) -> None:
    """Send "shutdown" to every live worker and wait (``graceful``), then terminate / kill what is left."""
    if graceful:
        payload = pickle.dumps(("shutdown", (), {}))
        for proc, conn in zip(processes, conns):
            if proc.is_alive():
                try:
                    conn.send_bytes(payload)
                except (OSError, ValueError):
                    pass
    stop_processes(processes, WORKER_STOP_TIMEOUT_S if graceful else 0.0)
    for conn in conns:
        conn.close()
    if tmpdir is not None:
        shutil.rmtree(tmpdir, ignore_errors=True)
