"""What the machine the engine runs on can do (vLLM's ``platforms``): the CPU's instruction sets,
and ``current_platform`` (vLLM's ``vllm.platforms.current_platform``: which device a default engine
runs on, with vLLM's ``is_cuda`` / ``is_rocm`` / ``is_cpu`` ... questions)."""

from __future__ import annotations

import functools


class Platform:
    """The device a default engine runs on (``device=None``: CUDA when torch sees a GPU, else the CPU).

    Attributes:
        device_type: ``"cuda"`` or ``"cpu"`` (torch's device type; vLLM's attribute).
        device_name: the same (vLLM's attribute).
    """

    def __init__(self, device_type: str) -> None:
        if device_type not in ("cpu", "cuda"):
            raise ValueError(f"device_type must be 'cpu' or 'cuda', got {device_type!r}")
        self.device_type = device_type
        self.device_name = device_type

    def is_cuda(self) -> bool:
        return self.device_type == "cuda"

    def is_cuda_alike(self) -> bool:
        return self.is_cuda()

    def is_cpu(self) -> bool:
        return self.device_type == "cpu"

    def is_rocm(self) -> bool:
        return False   # pagedllm runs on CPUs and NVIDIA GPUs only

    def is_tpu(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def is_out_of_tree(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"Platform({self.device_type!r})"


@functools.cache
def _detect() -> Platform:
    import torch

    return Platform("cuda" if torch.cuda.is_available() else "cpu")


def __getattr__(name: str):
    # Lazy, as vLLM's: importing pagedllm.platforms.cpu must not import torch for core's sake.
    if name == "current_platform":
        return _detect()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
