"""``set_random_seed`` (vLLM's ``vllm.utils.torch_utils.set_random_seed``, what its
``current_platform.seed_everything`` does): seed Python's, numpy's and torch's global RNGs."""

from __future__ import annotations

import random

import numpy as np
import torch


def set_random_seed(seed: int | None) -> None:
    """Seed ``random``, ``numpy.random`` and torch's default generators (CPU, and every CUDA
    device when CUDA is initialized) with ``seed``; None leaves them as they are.

    The worker calls it at ``init_device`` with the engine's ``seed``, as vLLM's workers do, so a
    script's ``random.random()`` after ``LLM(seed=s)`` is the same on every run. numpy takes
    ``seed`` modulo 2**32 (its limit).

    Raises:
        ValueError: if ``seed`` is not an int.
    """
    if seed is None:
        return
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise ValueError(f"seed must be an int, got {seed!r}")
    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)   # also seeds every CUDA device (lazily when CUDA is not initialized yet)


def async_tensor_h2d(data, device, dtype: torch.dtype | None = None,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """A host array on ``device`` without waiting for the copy (vLLM's ``async_tensor_h2d``).

    Args:
        data: a numpy array, a CPU tensor or a list (any shape); numpy arrays keep their dtype
            (int64 stays int64, bool stays bool).
        device: the destination device (str or ``torch.device``); ignored when ``out`` is given.
        dtype: the result's dtype (None: the data's, or ``out``'s).
        out: a device tensor of the same shape to copy into (returned).
    Returns:
        The device tensor. On CUDA the data is staged in pinned memory and copied with
        ``non_blocking=True`` (the copy is ordered on the current stream); on the CPU it is a copy
        (never a view of ``data``, so later writes to the array do not show through).
    """
    t = torch.from_numpy(np.ascontiguousarray(data)) if isinstance(data, np.ndarray) else \
        data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=dtype)
    if dtype is None:
        dtype = out.dtype if out is not None else t.dtype
    target = out.device if out is not None else torch.device(device)
    if target.type == "cuda":
        t = torch.empty(t.shape, dtype=dtype, pin_memory=True).copy_(t)
    if out is not None:
        return out.copy_(t, non_blocking=True)
    if target.type == "cpu":
        return t.to(dtype=dtype, copy=True)
    return t.to(device=target, dtype=dtype, non_blocking=True)
