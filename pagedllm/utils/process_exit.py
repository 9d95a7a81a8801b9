"""End a process without the interpreter's finalization.

A Python process that imported torch spent ~0.75 s after its last statement tearing down every
module and collecting every object (1.1 s with the default model loaded; docs/performance.md,
"Session 15"), time a server's stop and every command paid. ``exit_process`` does what the exit
must do, then leaves with ``os._exit``.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
from typing import NoReturn


def exit_process(code: int | None) -> NoReturn:
    """End this process with exit status ``code`` (None: 0) at once.

    In the interpreter's order: wait for the non-daemon threads (``threading._shutdown``, which
    also stops ``concurrent.futures`` pools), run the ``atexit`` handlers (logging's flush,
    multiprocessing's joins of child processes, ours), flush stdout and stderr, then
    ``os._exit(code)``. What is skipped: the teardown of modules and the collection of objects,
    and with it any ``__del__`` that has not run by then.

    For a process's own entry point only (the ``pagedllm`` command, a server module's
    ``__main__``, an engine process's target), never inside a library call. Where CPython lacks
    ``threading._shutdown`` it falls back to ``sys.exit(code)``.
    """
    shutdown_threads = getattr(threading, "_shutdown", None)
    if shutdown_threads is None or threading.current_thread() is not threading.main_thread():
        sys.exit(code)
    shutdown_threads()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):   # closed, replaced or gone
            pass
    os._exit(0 if code is None else int(code))
