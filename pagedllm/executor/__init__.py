"""What runs the workers: the engine hands an ``Executor`` one ``SchedulerOutput`` per step.

``abstract.py`` holds the interface and the selection by ``ParallelConfig``; ``uniproc.py`` runs
one worker in the engine's process (today's only executor). A multi-process executor (one worker
process per rank over ``torch.distributed``) and a Ray executor slot in beside it.
"""

from pagedllm.executor.abstract import Executor
from pagedllm.executor.uniproc import UniProcExecutor

__all__ = ["Executor", "UniProcExecutor"]
