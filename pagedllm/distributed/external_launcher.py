"""The process groups of an ``external_launcher`` engine: this process is one rank of the world that
torchrun started (vLLM's torchrun mode).

Layout: ``data_parallel_size`` engines of ``W = pipeline_parallel_size x tensor_parallel_size``
ranks side by side; engine ``d`` is global ranks ``[d W, (d + 1) W)``, inside which rank ``r`` is
tensor rank ``r % T`` of stage ``(r % W) // T`` (as ``parallel_state``). The world is joined from
torchrun's ``env://`` rendezvous, or reused when the script already joined it.
"""

from __future__ import annotations

import atexit

import torch.distributed as dist

from pagedllm.config import ParallelConfig
from pagedllm.distributed.parallel_state import COLLECTIVE_TIMEOUT, ParallelContext, make_parallel_context


def init_launcher_context(parallel_config: ParallelConfig, num_hidden_layers: int, backend: str) -> ParallelContext:
    """Join torchrun's world (unless the script did) and make every engine's tensor-parallel
    groups and engine group; every rank calls this with the same configs, in the same order.

    Args:
        parallel_config: the sizes and ``launcher`` (torchrun's ``RANK``, ``WORLD_SIZE``, ...).
        num_hidden_layers: the model's decoder layers (split over the stages).
        backend: "gloo" (CPU) or "nccl" (CUDA): the tensor-parallel groups' backend; the world is
            joined with gloo, plus NCCL for CUDA tensors ("cpu:gloo,cuda:nccl"), so that
            ``get_world_group().cpu_group`` carries CPU objects either way.
    Raises:
        ValueError: if the process group the script made disagrees with torchrun's variables, or
            ``distributed_executor_backend`` is not "external_launcher".
    """
    launcher = parallel_config.launcher
    if not parallel_config.uses_external_launcher:
        raise ValueError("init_launcher_context needs distributed_executor_backend='external_launcher' and "
                         "torchrun's environment")
    owns_world = not dist.is_initialized()
    if not owns_world:
        if (dist.get_world_size(), dist.get_rank()) != (launcher.world_size, launcher.rank):
            raise ValueError(f"the script's process group (rank {dist.get_rank()} of {dist.get_world_size()}) "
                             f"is not torchrun's (RANK={launcher.rank}, WORLD_SIZE={launcher.world_size})")
    else:
        dist.init_process_group("gloo" if backend == "gloo" else "cpu:gloo,cuda:nccl", init_method="env://",
                                world_size=launcher.world_size, rank=launcher.rank, timeout=COLLECTIVE_TIMEOUT)
    tp, pp, world = (parallel_config.tensor_parallel_size, parallel_config.pipeline_parallel_size,
                     parallel_config.world_size)
    rank = launcher.rank
    tp_group = engine_group = None
    made = []
    for dp in range(parallel_config.data_parallel_size):   # every rank makes every group, in the same order
        first = dp * world
        if tp > 1:
            for stage in range(pp):
                group = dist.new_group(list(range(first + stage * tp, first + (stage + 1) * tp)), backend=backend)
                made.append(group)
                if first + stage * tp <= rank < first + (stage + 1) * tp:
                    tp_group = group
        if world > 1:
            group = dist.new_group(list(range(first, first + world)), backend="gloo")
            made.append(group)
            if first <= rank < first + world:
                engine_group = group
    # Left to the interpreter's teardown, a gloo group whose peer exited first aborts the process
    # ("terminate called without an active exception"); the script's own world stays the script's.
    atexit.register(_leave_groups, made, owns_world)
    return make_parallel_context(parallel_config, rank, num_hidden_layers, tp_group, engine_group)


def _leave_groups(groups: list, world: bool) -> None:
    """At exit: destroy ``groups`` (this module's), and the world when this module joined it."""
    if not dist.is_initialized():
        return
    for group in groups:
        dist.destroy_process_group(group)
    if world:
        dist.destroy_process_group()
