"""vLLM's ``vllm.utils.network_utils`` helper: a free TCP port."""

from __future__ import annotations

import socket


def get_open_port() -> int:
    """A TCP port free on this host right now (the kernel's pick; it can be taken before use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]

