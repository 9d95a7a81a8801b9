"""vLLM's ``vllm.model_executor.model_loader``: ``ShardedStateLoader``, whose file-name patterns
vLLM's sharded-state examples read; the saving and loading are ``loaders/sharded_state.py``'s
(``engine_core.save_sharded_state``, ``load_format="sharded_state"``)."""

from pagedllm.loaders.sharded_state import DEFAULT_PATTERN, PP_AND_TP_PATTERN, TP_ONLY_PATTERN


class ShardedStateLoader:
    """vLLM's loader class for ``load_format="sharded_state"``, here the names of its patterns:
    ``{rank}`` / ``{tp_rank}`` the tensor-parallel rank, ``{pp_rank}`` the pipeline stage,
    ``{part}`` the file's index among its rank's files."""

    DEFAULT_PATTERN = DEFAULT_PATTERN
    TP_ONLY_PATTERN = TP_ONLY_PATTERN
    PP_AND_TP_PATTERN = PP_AND_TP_PATTERN


__all__ = ["ShardedStateLoader"]
