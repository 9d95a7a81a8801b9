"""What runs the workers: the engine hands an ``Executor`` one ``SchedulerOutput`` per step.

``abstract.py`` holds the interface and the selection by ``ParallelConfig``; ``uniproc.py`` runs
one worker in the engine's process; ``multiproc.py`` one worker process per rank, the ranks joined
over ``torch.distributed`` (tensor and pipeline parallelism); ``external_launcher.py`` this process
as one rank of a world that torchrun started.

The package's names load on first use (PEP 562), so that a process which only starts engine
processes (the server's front end: ``engine/dp_client.py``) imports ``multiproc``'s process helpers
without the in-process worker, and so without torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"Executor": "abstract", "MultiprocExecutor": "multiproc", "UniProcExecutor": "uniproc"}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
