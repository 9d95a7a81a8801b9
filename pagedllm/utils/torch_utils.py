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
