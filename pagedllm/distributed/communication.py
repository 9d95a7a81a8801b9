"""The collectives of tensor and pipeline parallelism, over torch.distributed (gloo on the CPU,
NCCL on CUDA). Each is the identity when its group has one rank, so single-process models pay
nothing. Each adds its wall time to ``ctx.step_times`` (two ``perf_counter`` calls)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from pagedllm.distributed.parallel_state import ParallelContext


def tensor_parallel_all_reduce(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """Sum ``x`` over the stage's tensor-parallel ranks (in place; returns ``x``). After a
    row-parallel layer: each rank holds a partial product ``x_r @ W_r^T`` (Megatron-LM,
    Shoeybi et al. 2019).

    Batch-invariant: every element's sum has one order whatever the tensor's size. Two ranks
    use the backend's all-reduce (``a + b`` is the same either way round). With three or more,
    gloo's and NCCL's all-reduce split the tensor into chunks by its size, so an element's
    summation order (and, in bfloat16, where it is rounded) changes with the number of rows
    in the step; there the partials are all-gathered and summed here in rank order in float32,
    rounded once to ``x.dtype`` (``tp_size`` times the traffic of a reduce-scatter, which at
    decode sizes is latency, not bandwidth).
    """
    if ctx.tp_size > 1:
        t0 = time.perf_counter()
        if ctx.tp_size == 2:
            dist.all_reduce(x, group=ctx.tp_group)
        else:
            x_c = x.contiguous()
            parts = [torch.empty_like(x_c) for _ in range(ctx.tp_size)]
            dist.all_gather(parts, x_c, group=ctx.tp_group)
            total = parts[0].to(torch.float32)
            for part in parts[1:]:
                total += part
            x.copy_(total)
        ctx.step_times.all_reduce += time.perf_counter() - t0
    return x


def tensor_parallel_all_gather(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """Concatenate ``x`` ([..., n]) of every tensor-parallel rank along the last dim, in rank order:
    [..., n * tp_size] (the vocabulary-parallel LM head's logits)."""
    if ctx.tp_size == 1:
        return x
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(ctx.tp_size)]
    t0 = time.perf_counter()
    dist.all_gather(parts, x, group=ctx.tp_group)
    ctx.step_times.all_gather += time.perf_counter() - t0
    return torch.cat(parts, dim=-1)


def send_to_next_stage(x: torch.Tensor, ctx: ParallelContext) -> None:
    """Send this stage's hidden states ([num_tokens, hidden]) to the same tensor rank of the next stage."""
    x = x.contiguous()
    t0 = time.perf_counter()
    dist.send(x, dst=ctx.next_rank)
    ctx.step_times.send += time.perf_counter() - t0


def recv_from_prev_stage(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
                         ctx: ParallelContext) -> torch.Tensor:
    """Receive the previous stage's hidden states (``shape``, known from the step's message on every rank)."""
    x = torch.empty(shape, dtype=dtype, device=device)
    t0 = time.perf_counter()
    dist.recv(x, src=ctx.prev_rank)
    ctx.step_times.recv += time.perf_counter() - t0
    return x


def broadcast_from_driver(obj: Any, ctx: ParallelContext) -> Any:
    """[external_launcher] The engine driver's ``obj`` (any picklable value, e.g. a step's
    ``ModelRunnerOutput``) on every rank of the engine, over its gloo ``engine_group``; the
    other ranks' ``obj`` is ignored. ``obj`` itself with no engine group (one rank)."""
    if ctx.engine_group is None:
        return obj
    box = [obj if ctx.rank == ctx.engine_driver_rank else None]
    dist.broadcast_object_list(box, src=ctx.engine_driver_rank, group=ctx.engine_group)
    return box[0]


def min_over_engine(value: int, ctx: ParallelContext) -> int:
    """[external_launcher] The minimum of ``value`` (an int, e.g. KV blocks) over the engine's ranks,
    so that every rank's scheduler gets the same number; ``value`` with no engine group."""
    if ctx.engine_group is None:
        return value
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=ctx.engine_group)
    return int(t.item())
