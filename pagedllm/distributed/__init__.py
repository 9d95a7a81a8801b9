"""torch.distributed for one engine's ranks: the process groups (``parallel_state``) and the
collectives the parallel layers and the pipeline use (``communication``); and, without torch,
the KV-cache events published for external routers (``kv_events``).

The torch names load on first use, so ``pagedllm.distributed.kv_events`` (imported by the block
pool in ``core/``, which runs without torch) does not import torch."""

_PARALLEL_STATE_NAMES = ("ParallelContext", "cleanup_dist_env_and_memory", "destroy_parallel_context",
                         "init_parallel_context")

__all__ = list(_PARALLEL_STATE_NAMES)


def __getattr__(name: str):
    """The ``parallel_state`` names, imported on first use."""
    if name in _PARALLEL_STATE_NAMES:
        from pagedllm.distributed import parallel_state

        return getattr(parallel_state, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
