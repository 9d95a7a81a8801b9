"""torch.distributed for one engine's ranks: the process groups (``parallel_state``) and the
collectives the parallel layers and the pipeline use (``communication``)."""

from pagedllm.distributed.parallel_state import (ParallelContext, cleanup_dist_env_and_memory,
                                                 destroy_parallel_context, init_parallel_context)

__all__ = ["ParallelContext", "cleanup_dist_env_and_memory", "destroy_parallel_context", "init_parallel_context"]
