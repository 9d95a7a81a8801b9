"""``pagedllm serve MODEL --headless -dp D -dpr S [-dpl L] --data-parallel-address A
[--data-parallel-rpc-port P]``: run data-parallel engine ranks ``[S, S + L)`` for a front end
elsewhere, without an API server (vLLM's ``run_headless``).

Each rank is an engine-core process (``engine/core_proc.py``) built from this command's own engine
flags (as vLLM's headless ranks are: start both sides with the same model and flags), connected to
the front end at ``tcp://A:P`` (``engine/dp_remote.py``). The ranks may start before the front end:
zmq connects when it comes up. The process exits when every rank has left: on the front end's
"shutdown", when their connection drops, or on SIGTERM / SIGINT here: then each rank tells the front
end it is draining (nothing new is routed to it), finishes its in-flight requests (at most
``--shutdown-timeout`` seconds, as the API server's own graceful shutdown) and says "bye"; the front
end marks it departed. The same command started again later rejoins the front end.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import threading

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.dp_layout import DataParallelLayout

logger = logging.getLogger(__name__)

# Seconds the ranks get to leave after SIGTERM, beyond their drain timeout, before they are killed.
HEADLESS_STOP_TIMEOUT_S = 10.0


def run_headless(engine_args: EngineArgs, drain_timeout_s: float = 30.0) -> int:
    """Start this process's ranks and wait for them.

    Args:
        drain_timeout_s: seconds the ranks' in-flight requests get to finish after SIGTERM / SIGINT
            (``--shutdown-timeout``).

    Returns:
        0 when every rank left normally (after SIGTERM too), 1 when one failed or was refused by the
        front end (its rank is served by a live process already).
    Raises:
        ValueError: bad data-parallel flags (naming them), before anything starts.
    """
    import dataclasses

    from pagedllm.engine.core_proc import run_engine_core
    from pagedllm.engine.dp_client import engine_process_env, replica_threads
    from pagedllm.executor.multiproc import stop_processes
    from pagedllm.loaders import resolve_model

    layout = DataParallelLayout.from_engine_args(engine_args, headless=True)
    world_size = engine_args.tensor_parallel_size * engine_args.pipeline_parallel_size
    threads = replica_threads(engine_args, world_size, os.cpu_count())
    rank_args = dataclasses.replace(engine_args, data_parallel_size=1, data_parallel_size_local=None,
                                    data_parallel_start_rank=None,
                                    cpu_threads_per_rank=threads if world_size > 1 else None)
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    stopped = threading.Event()

    def on_signal(signum, frame) -> None:
        logger.info("signal %d: stopping data-parallel rank(s) %s", signum, list(layout.local_ranks))
        stop.set()
        stopped.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    resolve_model(engine_args.model)   # a GGUF is converted once, before the ranks start
    if stopped.is_set():
        return 0
    log_level = logging.getLogger("pagedllm").getEffectiveLevel()
    processes = []
    for rank in layout.local_ranks:
        proc = ctx.Process(target=run_engine_core,
                           args=(rank_args, rank, layout.handshake_address, None, threads, log_level,
                                 layout.size, stop, drain_timeout_s),
                           name=f"pagedllm-dp-{rank}", daemon=False)
        with engine_process_env():
            proc.start()
        processes.append(proc)
    logger.info("headless: data-parallel rank(s) %s of %d (pids %s) connect to the front end at %s",
                list(layout.local_ranks), layout.size, [p.pid for p in processes], layout.handshake_address)
    try:
        from multiprocessing.connection import wait

        live = list(processes)
        while live and not stopped.is_set():
            wait([p.sentinel for p in live], timeout=0.5)
            live = [p for p in live if p.is_alive()]
    finally:
        stop.set()
        stop_processes(processes, drain_timeout_s + HEADLESS_STOP_TIMEOUT_S if stopped.is_set()
                       else HEADLESS_STOP_TIMEOUT_S)
    codes = {p.name: p.exitcode for p in processes}
    logger.info("headless: rank process exit codes %s", codes)
    return 0 if stopped.is_set() or all(c == 0 for c in codes.values()) else 1
