"""``UniProcExecutor``: one worker in the engine's own process (vLLM V1's ``UniProcExecutor``)."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from pagedllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from pagedllm.executor.abstract import Executor
from pagedllm.sampling_params import LogitsProcessor
from pagedllm.worker.worker import Worker


class UniProcExecutor(Executor):
    """Runs one ``Worker`` (rank 0) in this process; method calls are plain calls.

    Args:
        model_config, cache_config, scheduler_config, parallel_config, kernel_config: see ``Executor``.
        weights: (name, tensor) pairs to load instead of ``model_config.model_folder``.
        rank: the worker's global rank (0; ``ExternalLauncherExecutor`` passes torchrun's).
    Attributes:
        driver_worker: the worker.
    """

    uses_in_process_worker = True

    def __init__(self, model_config, cache_config, scheduler_config, parallel_config, kernel_config,
                 weights=None, rank: int = 0) -> None:
        super().__init__(model_config, cache_config, scheduler_config, parallel_config, kernel_config)
        self.driver_worker = Worker(model_config, cache_config, scheduler_config, parallel_config, kernel_config,
                                    rank=rank, weights=weights)

    def collective_rpc(self, method: str, args: tuple = (), kwargs: dict[str, Any] | None = None) -> list[Any]:
        """``[getattr(worker, method)(*args, **kwargs)]`` on the one worker."""
        return [getattr(self.local_worker, method)(*args, **(kwargs or {}))]

    @property
    def local_worker(self) -> Any:
        return self.driver_worker

    @property
    def model_dtype(self) -> Any:
        return self.local_worker.dtype

    def initialize(self) -> None:
        self.collective_rpc("init_device")
        self.collective_rpc("load_model")

    def _run_step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """The step's output as the engine gets it (here: the worker's)."""
        return self.local_worker.execute_model(scheduler_output)

    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> ModelRunnerOutput | Future[ModelRunnerOutput]:
        """Run the step now (one worker: nothing to overlap); ``non_block`` wraps the output
        in a completed future."""
        output = self._run_step(scheduler_output)
        if not non_block:
            return output
        future: Future[ModelRunnerOutput] = Future()
        future.set_result(output)
        return future

    def add_logits_processors(self, req_id: str, processors: list[LogitsProcessor]) -> None:
        self.local_worker.add_logits_processors(req_id, processors)

    def check_health(self) -> None:
        self.local_worker.check_health()

    def shutdown(self) -> None:
        self.local_worker.shutdown()
