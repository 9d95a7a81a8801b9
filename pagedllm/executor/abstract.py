"""The ``Executor`` interface (vLLM V1's ``vllm/v1/executor/abstract.py``) and its selection."""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from concurrent.futures import Future
from typing import Any, NoReturn

from pagedllm.config import CacheConfig, KernelConfig, ModelConfig, ParallelConfig, SchedulerConfig
from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.sampling_params import LogitsProcessor

logger = logging.getLogger(__name__)


class Executor(ABC):
    """Runs the model on one or more workers; the engine's only way to reach them.

    Everything that crosses this interface is plain, picklable data (configs, ``SchedulerOutput``,
    ``ModelRunnerOutput``, ints), except ``add_logits_processors``, which only in-process
    executors accept.

    Lifecycle: ``initialize()`` (devices, weights) -> ``determine_num_blocks()`` ->
    ``initialize_cache(num_blocks)`` -> ``execute_model`` once per step -> ``shutdown()``.

    Args:
        model_config, cache_config, scheduler_config, parallel_config, kernel_config: see
            ``pagedllm.config`` (each worker gets them all, pickled to worker processes).

    Attributes:
        uses_in_process_worker: True when the worker that samples runs in the engine's process,
            so Python callables (``SamplingParams.logits_processors``) can reach it without being
            sent anywhere.
    """

    uses_in_process_worker: bool = False

    def __init__(self, model_config: ModelConfig, cache_config: CacheConfig,
                 scheduler_config: SchedulerConfig, parallel_config: ParallelConfig,
                 kernel_config: KernelConfig) -> None:
        self.model_config = model_config
        self.cache_config = cache_config
        self.scheduler_config = scheduler_config
        self.parallel_config = parallel_config
        self.kernel_config = kernel_config

    @staticmethod
    def get_class(parallel_config: ParallelConfig) -> type["Executor"]:
        """The executor class for ``parallel_config`` (vLLM's ``Executor.get_class``).

        ``distributed_executor_backend`` "uni", or None with a world size of 1, gives
        ``UniProcExecutor``; "mp", or None with more ranks, ``MultiprocExecutor``; "ray"
        ``RayDistributedExecutor`` (which raises ImportError naming the ``[ray]`` extra without Ray);
        "external_launcher" ``ExternalLauncherExecutor`` (this process is one of torchrun's ranks).

        Raises:
            ValueError: for a backend or world size no executor implements.
        """
        backend = parallel_config.distributed_executor_backend
        if backend is None:
            backend = "uni" if parallel_config.world_size == 1 else "mp"
        if backend == "mp":
            from pagedllm.executor.multiproc import MultiprocExecutor
            return MultiprocExecutor
        if backend == "ray":
            from pagedllm.executor.ray_executor import RayDistributedExecutor
            return RayDistributedExecutor
        if backend == "external_launcher":
            from pagedllm.executor.external_launcher import ExternalLauncherExecutor
            return ExternalLauncherExecutor
        if backend == "uni":
            if parallel_config.world_size != 1:
                raise ValueError(f"distributed_executor_backend='uni' runs one worker, "
                                 f"but the world size is {parallel_config.world_size}")
            from pagedllm.executor.uniproc import UniProcExecutor
            return UniProcExecutor
        raise ValueError(f"distributed_executor_backend={backend!r} with world size "
                         f"{parallel_config.world_size} is not supported ('uni', 'mp', 'ray', 'external_launcher')")

    # -- lifecycle ------------------------------------------------------------------------

    @abstractmethod
    def initialize(self) -> None:
        """Start the workers, pick their devices and load the weights.

        Raises:
            ValueError: unsupported model or settings.
        """

    def determine_num_blocks(self) -> int:
        """KV blocks every worker can hold (the minimum over workers; each rank's pool holds its
        own KV heads and layers).

        Raises:
            ValueError: if the KV budget cannot hold one request of ``max_model_len`` tokens.
        """
        return min(self.collective_rpc("determine_num_blocks"))

    def determine_num_cpu_blocks(self) -> int:
        """Host blocks for swap preemption every worker can hold (0 unless
        ``preemption_mode="swap"``)."""
        return min(self.collective_rpc("determine_num_cpu_blocks"))

    def initialize_cache(self, num_blocks: int, num_cpu_blocks: int = 0) -> None:
        """Allocate ``num_blocks`` KV blocks (and ``num_cpu_blocks`` host blocks) on every
        worker and build their model runners."""
        self.collective_rpc("initialize_cache", (num_blocks, num_cpu_blocks))

    @property
    def local_worker(self) -> Any:
        """The in-process ``Worker`` (its ``model``, ``model_runner``, ``kv_shape``), or None
        where the workers live in other processes. The supported way for tools (``pagedllm bench
        latency --breakdown``, ``bench throughput``'s KV budget) to reach the model in process."""
        return None

    @property
    def model_dtype(self) -> Any:
        """The ``torch.dtype`` the model runs in ("auto" resolved), where the executor knows it
        without a call to its workers (an in-process one); else None (the workers log it)."""
        return None

    @property
    def max_concurrent_batches(self) -> int:
        """Steps the engine may have in flight at once (vLLM's ``max_concurrent_batches``): 1,
        or ``pipeline_parallel_size`` for an executor whose ``execute_model`` accepts
        ``non_block=True`` (each stage works on another batch; see ``LLMEngine``)."""
        return 1

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> "ModelRunnerOutput | Future[ModelRunnerOutput]":
        """Run one step on every worker; returns the sampling rank's output.

        Args:
            non_block: return at once with a future (an object with ``done()`` and
                ``result()``, as ``concurrent.futures.Future``) instead of the output; the
                engine asks for it when ``max_concurrent_batches > 1`` and on a step sent
                with ``grammar_bitmask_follows`` (whose output comes from ``sample_tokens``;
                this call's value is then None). Outputs are produced in submission order.
        """

    @abstractmethod
    def sample_tokens(self, grammar_bitmask: Any,
                      non_block: bool = False) -> "ModelRunnerOutput | Future[ModelRunnerOutput]":
        """[structured output] Send the grammar bitmask of the step last sent with
        ``grammar_bitmask_follows`` (vLLM V1's ``sample_tokens``): the workers sample it once
        its forward is done; returns that step's output (what ``execute_model`` returns on a
        step without the split). The engine calls it right after filling the bitmask, while the
        forward may still run; ``execute_model``'s own value for such a step is None.

        Args:
            grammar_bitmask: [len(structured_output_request_ids), ceil(vocab_size / 32)] int32
                numpy, or None to drop the step unsampled (its fill failed; an empty output).
            non_block: as ``execute_model``'s.
        Raises:
            RuntimeError: as ``execute_model`` (a worker died or raised, in the forward or here).
        """

    @abstractmethod
    def check_health(self) -> None:
        """Raises:
            RuntimeError: if a worker is gone or not initialized."""

    @abstractmethod
    def shutdown(self) -> None:
        """Stop the workers and free their memory (idempotent)."""

    # -- in-process hooks -----------------------------------------------------------------

    def add_logits_processors(self, req_id: str, processors: list[LogitsProcessor]) -> None:
        """Hand the logits processors of a request that the next ``execute_model`` sends as new
        to the worker that samples it (the engine calls this just before that step).

        Processors are Python callables; they stay in the process that created them and are
        applied where the logits are sampled, which only an in-process worker can do.

        Raises:
            ValueError: if this executor's workers run in other processes.
        """
        raise ValueError(
            f"logits_processors are Python callables and cannot be sent to worker processes; "
            f"{type(self).__name__} runs its workers out of process (use a single-process engine, "
            f"distributed_executor_backend='uni')")

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Call ``Worker.<method>(*args, **kwargs)`` on every worker; one result per rank, in rank
        order (the default ``determine_num_blocks`` / ``initialize_cache`` go through it)."""


class MultiRankExecutor(Executor):
    """What the executors of several rank processes (``MultiprocExecutor``, ``RayDistributedExecutor``)
    share: fail-stop. The first failure of any rank stops every rank and is kept; every later
    call raises it (the survivors may be blocked in a collective, so nothing waits on them).

    Subclasses define ``_has_workers`` and ``_stop_workers_now``.
    """

    _failure: str | None = None   # the first failure's message, once one happened

    @abstractmethod
    def _has_workers(self) -> bool:
        """Whether rank processes are running (initialized and not shut down)."""

    @abstractmethod
    def _stop_workers_now(self) -> None:
        """Stop every rank without goodbyes and forget them (never raises)."""

    def _check_alive(self) -> None:
        """Raises:
            RuntimeError: the executor stopped after a failure, or has no workers."""
        if self._failure is not None:
            raise RuntimeError(f"the {type(self).__name__} is stopped after a failure: {self._failure}")
        if not self._has_workers():
            raise RuntimeError(f"the {type(self).__name__} has no workers (not initialized, or shut down)")

    def _fail(self, message: str) -> NoReturn:
        """Record the failure, stop every rank, raise ``RuntimeError(message)``."""
        self._failure = message
        logger.error("%s; stopping every worker", message)
        self._stop_workers_now()
        raise RuntimeError(message)
