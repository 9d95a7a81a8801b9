"""This rank's place among the engine's workers, and the torch.distributed groups that join them.

Layout (vLLM's): global rank ``r`` is tensor-parallel rank ``r % T`` of pipeline stage ``r // T``.
A stage's T ranks form one tensor-parallel group (all-reduce, all-gather); rank ``r`` sends its
stage's output to rank ``r + T`` (point-to-point on the world group). The engine process is not a
member of any group: it talks to the ranks through the executor's pipes only.

No module-level state: the ``ParallelContext`` is made once per worker and handed to the model.
"""

from __future__ import annotations

import datetime
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from pagedllm.config import ParallelConfig

logger = logging.getLogger(__name__)

# How long a collective may wait for a peer before gloo / NCCL raise (a rank that died mid-step is
# found by the executor much sooner, through the process's sentinel).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)


@dataclass
class StepTimes:
    """Wall seconds this rank spent, summed since the last ``reset()``: in ``execute_model`` (the
    whole step), and inside it in each collective (``communication.py``). A collective's time
    includes waiting for its peers: a stage's ``recv`` holds the time it waits for the previous
    stage (pipeline bubble), an ``all_reduce`` the time it waits for the slowest rank.

    Attributes:
        num_steps: ``execute_model`` calls.
        execute_model, all_reduce, all_gather, send, recv: seconds.
    """

    num_steps: int = 0
    execute_model: float = 0.0
    all_reduce: float = 0.0
    all_gather: float = 0.0
    send: float = 0.0
    recv: float = 0.0

    def reset(self) -> None:
        self.num_steps = 0
        self.execute_model = self.all_reduce = self.all_gather = self.send = self.recv = 0.0


@dataclass(frozen=True)
class ParallelContext:
    """One rank's coordinates in the tensor x pipeline grid.

    Attributes:
        rank: global rank (``pp_rank * tp_size + tp_rank``).
        tp_rank, tp_size: tensor-parallel rank and size.
        pp_rank, pp_size: pipeline stage and number of stages.
        layer_start, layer_end: [start, end) decoder layers this stage runs (all layers for one stage).
        tp_group: the torch.distributed group of this stage's tensor-parallel ranks (None for T = 1).
        enable_expert_parallel: MoE layers place whole experts on the tensor ranks
            (``ParallelConfig.enable_expert_parallel``).
        engine_group: [external_launcher] the gloo group of this engine's ``world_size`` ranks
            (the driver's step output is broadcast over it); None otherwise.
        step_times: where this rank's step time goes (``--breakdown``; the one mutable part).
    """

    rank: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    layer_start: int = 0
    layer_end: int | None = None
    tp_group: Any = None
    enable_expert_parallel: bool = False
    engine_group: Any = None
    step_times: StepTimes = field(default_factory=StepTimes, compare=False)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def is_driver(self) -> bool:
        """Whether this rank samples and returns the step's output: tensor rank 0 of the last stage."""
        return self.is_last_stage and self.tp_rank == 0

    @property
    def prev_rank(self) -> int:
        """Global rank this stage receives hidden states from."""
        return self.rank - self.tp_size

    @property
    def next_rank(self) -> int:
        """Global rank this stage sends hidden states to."""
        return self.rank + self.tp_size

    @property
    def engine_driver_rank(self) -> int:
        """Global rank of this engine's driver (with external_launcher, engine ``d``'s ranks start at
        ``d x world_size``)."""
        return self.rank - (self.pp_rank * self.tp_size + self.tp_rank) + (self.pp_size - 1) * self.tp_size

    def owns_layer(self, index: int) -> bool:
        return self.layer_start <= index < (self.layer_end if self.layer_end is not None else index + 1)


def driver_rank(parallel_config: ParallelConfig) -> int:
    """The global rank that samples (tensor rank 0 of the last pipeline stage)."""
    return (parallel_config.pipeline_parallel_size - 1) * parallel_config.tensor_parallel_size


def init_parallel_context(parallel_config: ParallelConfig, rank: int, num_hidden_layers: int,
                          init_method: str | None, backend: str) -> ParallelContext:
    """Join the world process group (when the world has more than one rank) and make the
    tensor-parallel groups; every rank calls this with the same arguments except ``rank``.

    Args:
        parallel_config: the sizes.
        rank: this rank.
        num_hidden_layers: the model's decoder layers (split over the stages).
        init_method: torch.distributed's rendezvous URL ("file://..." or "tcp://host:port").
        backend: "gloo" (CPU) or "nccl" (CUDA).
    Raises:
        ValueError: if the world has more than one rank and ``init_method`` is None.
    """
    tp, pp = parallel_config.tensor_parallel_size, parallel_config.pipeline_parallel_size
    world = tp * pp
    tp_group = None
    if world > 1:
        if init_method is None:
            raise ValueError(f"a world of {world} ranks needs a distributed init_method")
        dist.init_process_group(backend, init_method=init_method, world_size=world, rank=rank,
                                timeout=COLLECTIVE_TIMEOUT)
        for stage in range(pp):  # every rank makes every group, in the same order
            group = dist.new_group(list(range(stage * tp, (stage + 1) * tp)), backend=backend)
            if stage == rank // tp:
                tp_group = group
    return make_parallel_context(parallel_config, rank, num_hidden_layers, tp_group)


def make_parallel_context(parallel_config: ParallelConfig, rank: int, num_hidden_layers: int, tp_group: Any,
                          engine_group: Any = None) -> ParallelContext:
    """The ``ParallelContext`` of global rank ``rank`` once its groups exist: tensor rank ``rank %
    T``, stage ``(rank % world_size) // T`` (engines of ``world_size`` ranks side by side)."""
    tp, pp = parallel_config.tensor_parallel_size, parallel_config.pipeline_parallel_size
    pp_rank = (rank % parallel_config.world_size) // tp
    start, end = parallel_config.stage_layers(num_hidden_layers, pp_rank)
    ctx = ParallelContext(rank=rank, tp_rank=rank % tp, tp_size=tp, pp_rank=pp_rank, pp_size=pp,
                          layer_start=start, layer_end=end, tp_group=tp_group if tp > 1 else None,
                          enable_expert_parallel=parallel_config.enable_expert_parallel, engine_group=engine_group)
    logger.info("rank %d: tensor rank %d/%d, pipeline stage %d/%d, layers [%d, %d)", rank, ctx.tp_rank, tp,
                pp_rank, pp, start, end)
    return ctx


@dataclass(frozen=True)
class WorldGroup:
    """vLLM's world ``GroupCoordinator``, reduced to what its torchrun examples use.

    Attributes:
        cpu_group: a group of every rank for CPU tensors and objects (gloo).
        device_group: the same ranks for the model's device tensors (gloo on the CPU, NCCL on CUDA).
    """

    cpu_group: Any
    device_group: Any

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def world_size(self) -> int:
        return dist.get_world_size()


def get_world_group() -> WorldGroup:
    """vLLM's ``get_world_group()``: torch.distributed's default group, which an external_launcher
    engine joins with gloo on the CPU and ``cpu:gloo,cuda:nccl`` on CUDA, so one group serves both.

    Raises:
        RuntimeError: if this process has no process group (no multi-rank engine here).
    """
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("get_world_group(): torch.distributed is not initialized in this process "
                           "(only engines of several ranks in this process, external_launcher, join one)")
    return WorldGroup(cpu_group=dist.group.WORLD, device_group=dist.group.WORLD)


def destroy_parallel_context() -> None:
    """Leave the process group, if this process joined one."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def cleanup_dist_env_and_memory(shutdown_ray: bool = False) -> None:
    """vLLM's ``cleanup_dist_env_and_memory``: destroy this process's torch.distributed process
    group (if any), collect garbage and give cached accelerator memory back; a no-op for the
    group when none exists. Between two engines in one script (``del llm`` first).

    Args:
        shutdown_ray: also ``ray.shutdown()`` when Ray is imported and initialized.
    """
    import gc

    destroy_parallel_context()
    if shutdown_ray:
        import sys

        ray = sys.modules.get("ray")
        if ray is not None and ray.is_initialized():
            ray.shutdown()
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
