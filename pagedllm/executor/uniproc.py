"""``UniProcExecutor``: one worker in the engine's own process (vLLM V1's ``UniProcExecutor``)."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
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

    [structured output] A step sent with ``grammar_bitmask_follows`` runs its forward on a
    forward thread (one, started on the first such step; torch's kernels release the GIL), so
    the engine fills the bitmask meanwhile; ``sample_tokens`` then samples in the caller's
    thread. Other steps run in the caller's thread, as before.
    """

    uses_in_process_worker = True

    def __init__(self, model_config, cache_config, scheduler_config, parallel_config, kernel_config,
                 weights=None, rank: int = 0) -> None:
        super().__init__(model_config, cache_config, scheduler_config, parallel_config, kernel_config)
        self.driver_worker = Worker(model_config, cache_config, scheduler_config, parallel_config, kernel_config,
                                    rank=rank, weights=weights)
        self._forward_pool: ThreadPoolExecutor | None = None
        self._forward: Future | None = None   # the forward of the step waiting for sample_tokens

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

    def _run_step(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput | None:
        """The step's output as the engine gets it (here: the worker's; None for a step whose
        sampling waits for ``sample_tokens``)."""
        return self.local_worker.execute_model(scheduler_output)

    def _run_sampling(self, grammar_bitmask) -> ModelRunnerOutput:
        """The kept step's output as the engine gets it (here: the worker's ``sample_tokens``)."""
        return self.local_worker.sample_tokens(grammar_bitmask)

    def execute_model(self, scheduler_output: SchedulerOutput,
                      non_block: bool = False) -> ModelRunnerOutput | None | Future:
        """Run the step now (one worker: nothing to overlap); ``non_block`` wraps the output
        in a completed future. [structured output] With ``grammar_bitmask_follows`` the forward
        starts on the forward thread and the future (``non_block``) is its; its value is None."""
        if scheduler_output.grammar_bitmask_follows:
            if self._forward_pool is None:
                self._forward_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pagedllm-forward")
            self._forward = self._forward_pool.submit(self._run_step, scheduler_output)
            return self._forward if non_block else self._forward.result()
        return _maybe_future(self._run_step(scheduler_output), non_block)

    def sample_tokens(self, grammar_bitmask, non_block: bool = False) -> ModelRunnerOutput | Future:
        """[structured output] Wait for the kept step's forward, then sample it in this thread
        (``Executor.sample_tokens``).

        Raises:
            whatever the forward raised.
        """
        forward, self._forward = self._forward, None
        if forward is not None:
            forward.result()
        return _maybe_future(self._run_sampling(grammar_bitmask), non_block)

    def add_logits_processors(self, req_id: str, processors: list[LogitsProcessor]) -> None:
        self.local_worker.add_logits_processors(req_id, processors)

    def check_health(self) -> None:
        self.local_worker.check_health()

    def shutdown(self) -> None:
        if self._forward_pool is not None:
            self._forward_pool.shutdown(wait=True)   # a forward in flight ends first
            self._forward_pool = None
        self.local_worker.shutdown()


def _maybe_future(output, non_block: bool):
    """``output``, or (``non_block``) a future already holding it."""
    if not non_block:
        return output
    future: Future = Future()
    future.set_result(output)
    return future
