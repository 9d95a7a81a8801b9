"""``ExternalLauncherExecutor`` (``external_launcher``): this process is one rank of the world that
torchrun started (vLLM's ``ExecutorWithExternalLauncher``).

Every rank runs the same script, builds the same ``LLM`` and its own engine on the same inputs; the
executor holds one ``Worker`` (this rank) in the process. Each step the engine driver's output (the
sampled tokens; only the driver samples) is broadcast to the engine's other ranks, so every rank's
scheduler sees the same token ids and the ranks stay in lockstep. With ``data_parallel_size`` D > 1
the world is D engines of ``world_size`` ranks, each independent (its own share of the prompts).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.distributed.communication import broadcast_from_driver, min_over_engine
from pagedllm.executor.uniproc import UniProcExecutor
from pagedllm.worker.worker import Worker

logger = logging.getLogger(__name__)


@dataclass
class WorkerWrapper:
    """vLLM's ``WorkerWrapperBase`` as its torchrun example reaches it:
    ``llm.llm_engine.model_executor.driver_worker.worker.model_runner.model``.

    Attributes:
        worker: this rank's ``Worker``.
    """

    worker: Worker


class ExternalLauncherExecutor(UniProcExecutor):
    """One ``Worker`` for this torchrun rank, in this process; logits processors (callables) reach
    it as with ``UniProcExecutor`` (every rank makes its own; the engine's driver applies them).

    Args:
        model_config, cache_config, scheduler_config, parallel_config, kernel_config: see
            ``Executor``; ``parallel_config.launcher`` holds torchrun's values.
    Attributes:
        driver_worker: a ``WorkerWrapper`` around this rank's worker (vLLM's attribute name; on
            every rank, not only the engine's driver).
    Raises:
        ValueError: without ``parallel_config.launcher`` (torchrun's environment; ``ParallelConfig``
            also refuses a WORLD_SIZE other than data_parallel_size x pipeline_parallel_size x
            tensor_parallel_size).
    """

    def __init__(self, model_config, cache_config, scheduler_config, parallel_config, kernel_config) -> None:
        if not parallel_config.uses_external_launcher:
            raise ValueError("ExternalLauncherExecutor needs distributed_executor_backend='external_launcher' "
                             "and torchrun's environment (ParallelConfig.launcher)")
        super().__init__(model_config, cache_config, scheduler_config, parallel_config, kernel_config,
                         rank=parallel_config.launcher.rank)
        self.driver_worker = WorkerWrapper(self.driver_worker)

    @property
    def local_worker(self) -> Worker:
        return self.driver_worker.worker

    def initialize(self) -> None:
        """Set this rank's torch threads on the CPU (``cpu_threads_per_rank``), join torchrun's
        world, load this rank's weights."""
        threads = self.parallel_config.cpu_threads_per_rank
        if threads is not None and (self.model_config.device or "cpu") == "cpu":
            torch.set_num_threads(threads)
        super().initialize()
        logger.info("external_launcher: rank %d of %d, data-parallel rank %d of %d, %d torch thread(s)",
                    self.local_worker.parallel.rank, self.parallel_config.world_size_across_dp,
                    self.parallel_config.data_parallel_rank, self.parallel_config.data_parallel_size,
                    torch.get_num_threads())

    def determine_num_blocks(self) -> int:
        """This rank's KV blocks, the minimum over the engine's ranks (the same on each)."""
        return min_over_engine(self.local_worker.determine_num_blocks(), self.local_worker.parallel)

    def determine_num_cpu_blocks(self) -> int:
        return min_over_engine(self.local_worker.determine_num_cpu_blocks(), self.local_worker.parallel)

    def _run_step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """Run the step on this rank; every rank returns the engine driver's output (broadcast
        over the engine's gloo group). A step whose sampling waits for ``sample_tokens``
        broadcasts nothing here (None on every rank)."""
        output = super()._run_step(scheduler_output)
        if scheduler_output.grammar_bitmask_follows:
            return None
        return broadcast_from_driver(output, self.local_worker.parallel)

    def _run_sampling(self, grammar_bitmask) -> ModelRunnerOutput:
        """Sample the kept step on this rank (every rank fills the same bitmask: the engines
        are in lockstep); every rank returns the engine driver's output."""
        return broadcast_from_driver(super()._run_sampling(grammar_bitmask), self.local_worker.parallel)
