"""``gpu_sync_allowed`` (vLLM's ``vllm.utils.gpu_sync_debug``): the region where a logits
processor says a device -> host synchronization is expected.

In vLLM, a debug mode (``VLLM_GPU_SYNC_CHECK``) makes an unmarked GPU <-> CPU synchronization in
the sampling hot path an error, and code that syncs on purpose (a processor's slow path reading a
window back with ``.cpu()``) wraps it in ``with gpu_sync_allowed():``. pagedllm has no such check:
on the CPU nothing synchronizes, and on CUDA nothing is armed, so the context manager only marks
the region (the code reads as it does under vLLM)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator


@contextmanager
def gpu_sync_allowed() -> Iterator[None]:
    """A region where GPU <-> CPU synchronizations are expected (vLLM's meaning); here it checks
    nothing and changes nothing (no sync check exists to relax)."""
    yield


__all__ = ["gpu_sync_allowed"]
