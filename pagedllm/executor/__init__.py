"""What runs the workers: the engine hands an ``Executor`` one ``SchedulerOutput`` per step.

``abstract.py`` holds the interface and the selection by ``ParallelConfig``; ``uniproc.py`` runs
one worker in the engine's process; ``multiproc.py`` one worker process per rank, the ranks joined
over ``torch.distributed`` (tensor and pipeline parallelism); ``external_launcher.py`` this process
as one rank of a world that torchrun started.
"""

from pagedllm.executor.abstract import Executor
from pagedllm.executor.multiproc import MultiprocExecutor
from pagedllm.executor.uniproc import UniProcExecutor

__all__ = ["Executor", "MultiprocExecutor", "UniProcExecutor"]
