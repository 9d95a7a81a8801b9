"""torch.distributed for one engine's ranks: the process groups (``parallel_state``) and the
collectives the parallel layers and the pipeline use (``communication``)."""

from pagedllm.distributed.parallel_state import ParallelContext, init_parallel_context

__all__ = ["ParallelContext", "init_parallel_context"]
