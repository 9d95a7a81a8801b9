"""vLLM's ``vllm.utils.system_utils.set_ulimit``: room for many open connections."""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger(__name__)


def set_ulimit(target_soft_limit: int = 65535) -> None:
    """Raise this process's soft limit of open files (``RLIMIT_NOFILE``) to ``target_soft_limit``
    (capped at the hard limit) when it is lower; a server holds a descriptor per connection.
    Logs a WARNING when the limit cannot be raised; nothing on Windows."""
    if sys.platform.startswith("win"):
        return
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = target_soft_limit if hard == resource.RLIM_INFINITY else min(target_soft_limit, hard)
    if soft == resource.RLIM_INFINITY or soft >= target:
        return
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as e:
        logger.warning("open-file limit is %d and could not be raised to %d (%s): many connections may fail "
                       "with 'Too many open files'; raise it with ulimit -n", soft, target, e)
