"""Profiling the worker's steps with ``torch.profiler`` (vLLM's ``profiler_config`` and
``LLM.start_profile`` / ``stop_profile``): the config, and the per-worker profiler."""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

PROFILERS = ("torch",)


@dataclass(frozen=True)
class ProfilerConfig:
    """What ``start_profile`` records (vLLM's ``ProfilerConfig`` field names).

    Attributes:
        profiler: "torch" (``torch.profiler``), or None: profiling off (``start_profile`` raises).
        torch_profiler_dir: folder the traces go to, one file per worker rank per profile
            (``tensorboard_trace_handler``: ``rank<r>.<time>.pt.trace.json[.gz]``, a Chrome /
            Perfetto trace); created if missing. Required with "torch".
        torch_profiler_record_shapes: record each op's input shapes.
        torch_profiler_with_memory: record tensor allocations (bytes).
        torch_profiler_with_stack: record Python stacks.
        torch_profiler_with_flops: estimate FLOPs of matmuls and convolutions.
        torch_profiler_use_gzip: gzip the trace (``.json.gz``).
    Raises:
        ValueError: an unknown ``profiler`` or "torch" without ``torch_profiler_dir``.
    """

    profiler: str | None = None
    torch_profiler_dir: str = ""
    torch_profiler_record_shapes: bool = False
    torch_profiler_with_memory: bool = False
    torch_profiler_with_stack: bool = True
    torch_profiler_with_flops: bool = False
    torch_profiler_use_gzip: bool = True

    def __post_init__(self) -> None:
        if self.profiler is not None and self.profiler not in PROFILERS:
            raise ValueError(f"profiler_config.profiler must be one of {PROFILERS} or None, got {self.profiler!r}")
        if self.profiler == "torch" and not self.torch_profiler_dir:
            raise ValueError("profiler_config.torch_profiler_dir is required with profiler='torch'")
        if self.torch_profiler_dir:
            # Absolute: worker processes may run elsewhere in the file system's eyes (another cwd).
            object.__setattr__(self, "torch_profiler_dir", os.path.abspath(os.path.expanduser(self.torch_profiler_dir)))

    @property
    def enabled(self) -> bool:
        return self.profiler is not None

    @classmethod
    def from_any(cls, value: "ProfilerConfig | dict[str, Any] | None") -> "ProfilerConfig":
        """A ``ProfilerConfig`` from the engine argument: itself, a dict of its fields, or None (off).

        Raises:
            ValueError: an unknown key (naming it) or a bad value.
        """
        from pagedllm.config import config_from_any

        return config_from_any(cls, value, "profiler_config")


class WorkerProfiler:
    """One worker's ``torch.profiler.profile`` between ``start`` and ``stop`` (CPU activity, and
    CUDA's on a CUDA device); ``stop`` writes the trace.

    Args:
        config: an enabled ``ProfilerConfig``.
        rank: the worker's rank (names its trace file).
        device_type: "cpu" or "cuda".
    """

    def __init__(self, config: ProfilerConfig, rank: int, device_type: str) -> None:
        self.config = config
        self.rank = rank
        self.device_type = device_type
        self._profile = None

    @property
    def running(self) -> bool:
        return self._profile is not None

    def start(self) -> None:
        """Start recording (a no-op, logged, if already recording)."""
        import torch

        if self._profile is not None:
            logger.warning("rank %d: the profiler is already running", self.rank)
            return
        cfg = self.config
        os.makedirs(cfg.torch_profiler_dir, exist_ok=True)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device_type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(
            activities=activities, record_shapes=cfg.torch_profiler_record_shapes,
            profile_memory=cfg.torch_profiler_with_memory, with_stack=cfg.torch_profiler_with_stack,
            with_flops=cfg.torch_profiler_with_flops,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(
                cfg.torch_profiler_dir, worker_name=f"rank{self.rank}", use_gzip=cfg.torch_profiler_use_gzip))
        self._profile.start()
        logger.info("rank %d: torch profiler started (traces to %s)", self.rank, cfg.torch_profiler_dir)

    def stop(self) -> None:
        """Stop recording and write the trace (a no-op if not recording)."""
        if self._profile is None:
            return
        profile, self._profile = self._profile, None
        profile.stop()
        logger.info("rank %d: torch profiler stopped; trace written to %s", self.rank, self.config.torch_profiler_dir)
