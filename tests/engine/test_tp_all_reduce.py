"""The tensor-parallel all-reduce is batch-invariant at any rank count: a row's sum does not
depend on how many rows share the call (the user-visible symptom it fixes: bfloat16 greedy output
at ``-tp 4`` changed when another prompt joined the batch; gloo's all-reduce chunks the tensor by
its size, so an element's summation order followed the batch)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pagedllm.distributed.communication import tensor_parallel_all_reduce
from pagedllm.distributed.parallel_state import ParallelContext

pytestmark = pytest.mark.multiprocess

HIDDEN = 640          # the default model's hidden size
BATCHES = (1, 3, 64, 257)


def _partials(rank: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s partial sums for the first ``rows`` rows: the same values for a row
    whatever ``rows`` is (seeded per rank), large enough in bfloat16 that rounding bites."""
    g = torch.Generator().manual_seed(1000 + rank)
    full = torch.randn(max(BATCHES), HIDDEN, generator=g) * 40
    return full[:rows].to(dtype)


DTYPES = (torch.bfloat16, torch.float32)


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        ctx = ParallelContext(rank=rank, tp_rank=rank, tp_size=world, tp_group=dist.group.WORLD)
        results = {(str(dtype), rows): tensor_parallel_all_reduce(_partials(rank, rows, dtype), ctx).clone()
                   for dtype in DTYPES for rows in BATCHES}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [3, 4])
def test_all_reduce_is_the_same_for_a_row_whatever_the_batch(world, tmp_path):
    from pagedllm.utils.network_utils import get_open_port

    # Both dtypes in one group of processes, started from the fork server (as the engine's ranks are).
    mp.start_processes(_worker, args=(world, get_open_port(), str(tmp_path)), nprocs=world, join=True,
                       start_method="forkserver")
    results = [torch.load(tmp_path / f"rank{r}.pt") for r in range(world)]
    for dtype in DTYPES:
        # The reference: the partials summed in rank order in float32, rounded once.
        expected = sum((_partials(r, max(BATCHES), dtype).float() for r in range(1, world)),
                       _partials(0, max(BATCHES), dtype).float()).to(dtype)
        for rank_results in results:
            for rows in BATCHES:
                got = rank_results[(str(dtype), rows)]
                assert got.dtype == dtype
                assert torch.equal(got, expected[:rows]), (world, dtype, rows)
