"""Sharded state: each rank's own weights in its own safetensors files (vLLM's ``sharded_state``
load format, ``ShardedStateLoader``), so a tensor- or pipeline-parallel rank reads only its part.

What a rank saves is its model *as loaded, before the kernel plan packs it*: every parameter
(and persistent buffer) under the model's own names (``model.layers.0.self_attn.qkv_proj.weight``
where layers are merged), already this rank's slice of each tensor-parallel tensor, in the
engine's dtype. The packed layouts the workers run (oneDNN / float32 / bfloat16 GEMM packing,
int8 quantization, the exact greedy head's copy) are not saved: they depend on the loading
machine's CPU and settings and some are lossy, so loading copies the saved tensors into a freshly
built model and runs the same packing as any other load.

Each file carries safetensors metadata (``format``, ``tp_rank`` / ``tp_size``, ``pp_rank`` /
``pp_size``, ``part`` / ``num_parts``), so loading finds a rank's files by that, whatever
``pattern`` named them, and can tell a checkpoint saved for another parallel layout (or with a
file missing) before any weight is read.
"""

from __future__ import annotations

import glob
import logging
import os
import string
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

logger = logging.getLogger(__name__)

TP_ONLY_PATTERN = "model-rank-{rank}-part-{part}.safetensors"
PP_AND_TP_PATTERN = "model-pp-{pp_rank}-tp-{tp_rank}-part-{part}.safetensors"
DEFAULT_PATTERN = TP_ONLY_PATTERN   # vLLM's older name for the tensor-parallel-only pattern
SHARDED_STATE_FORMAT = "pagedllm-sharded-state"   # the files' metadata "format"
_FIELDS = frozenset({"rank", "tp_rank", "pp_rank", "part"})


@dataclass(frozen=True)
class ShardFile:
    """One file of a sharded state, from its metadata.

    Attributes:
        path: the file.
        tp_rank, tp_size, pp_rank, pp_size: the rank that saved it and the layout it ran in.
        part, num_parts: its index among that rank's files, and how many there are.
    """

    path: str
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    part: int
    num_parts: int


def render_pattern(pattern: str | None, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int,
                   part: int) -> str:
    """A rank's file name from ``pattern`` (None: ``PP_AND_TP_PATTERN`` with pipeline stages,
    else ``TP_ONLY_PATTERN``); ``{rank}`` is the tensor-parallel rank, as in vLLM.

    Raises:
        ValueError: a placeholder other than ``rank``, ``tp_rank``, ``pp_rank``, ``part``; or no
            placeholder for a rank that has peers (their files would overwrite each other).
    """
    if pattern is None:
        pattern = PP_AND_TP_PATTERN if pp_size > 1 else TP_ONLY_PATTERN
    fields = {f for _, f, _, _ in string.Formatter().parse(pattern) if f is not None}
    unknown = fields - _FIELDS
    if unknown:
        raise ValueError(f"pattern {pattern!r} has placeholder(s) {sorted(unknown)}; "
                         f"supported: {sorted(_FIELDS)}")
    if "part" not in fields:
        raise ValueError(f"pattern {pattern!r} has no {{part}} placeholder (a rank may write several files)")
    if pp_size > 1 and "pp_rank" not in fields:
        raise ValueError(f"pattern {pattern!r} has no {{pp_rank}}: with pipeline_parallel_size={pp_size} "
                         f"the stages would write the same files; use {PP_AND_TP_PATTERN!r}")
    if tp_size > 1 and not fields & {"rank", "tp_rank"}:
        raise ValueError(f"pattern {pattern!r} has no {{rank}} / {{tp_rank}}: with tensor_parallel_size="
                         f"{tp_size} the ranks would write the same files")
    return pattern.format(rank=tp_rank, tp_rank=tp_rank, pp_rank=pp_rank, part=part)


def rank_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's parameters (a tied weight once, under its first name) and persistent buffers,
    by the model's own names."""
    state = dict(model.named_parameters())
    non_persistent = {f"{prefix}.{b}" if prefix else b for prefix, mod in model.named_modules()
                      for b in mod._non_persistent_buffers_set}
    state.update((n, b) for n, b in model.named_buffers() if n not in non_persistent)
    return state


def save_rank_state(model: nn.Module, folder: str, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int,
                    pattern: str | None = None, max_size: int | None = None) -> list[str]:
    """Write one rank's ``rank_state_dict`` into ``folder`` as safetensors files of at most
    ``max_size`` bytes each (a tensor larger than that gets a file of its own).

    Returns:
        The paths written, in part order.
    Raises:
        ValueError: as ``render_pattern``; ``max_size`` < 1.
    """
    from safetensors.torch import save_file

    if max_size is not None and max_size < 1:
        raise ValueError(f"max_size must be >= 1 byte, got {max_size}")
    parts: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in rank_state_dict(model).items():
        nbytes = tensor.numel() * tensor.element_size()
        if max_size is not None and parts[-1] and size + nbytes > max_size:
            parts.append({})
            size = 0
        parts[-1][name] = tensor.detach().to("cpu").contiguous()
        size += nbytes
    os.makedirs(folder, exist_ok=True)
    paths = []
    for part, tensors in enumerate(parts):
        path = os.path.join(folder, render_pattern(pattern, tp_rank, tp_size, pp_rank, pp_size, part))
        meta = {"format": SHARDED_STATE_FORMAT, "tp_rank": tp_rank, "tp_size": tp_size, "pp_rank": pp_rank,
                "pp_size": pp_size, "part": part, "num_parts": len(parts)}
        save_file(tensors, path, metadata={k: str(v) for k, v in meta.items()})
        paths.append(path)
    logger.info("saved rank tp=%d pp=%d: %d tensors in %d file(s) under %s", tp_rank, pp_rank,
                sum(map(len, parts)), len(parts), folder)
    return paths


def _shard_files(folder: str) -> list[ShardFile]:
    """Every sharded-state file in ``folder`` (safetensors files with our metadata)."""
    from safetensors import safe_open

    found = []
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            meta = f.metadata() or {}
        if meta.get("format") == SHARDED_STATE_FORMAT:
            found.append(ShardFile(path, *(int(meta[k]) for k in ("tp_rank", "tp_size", "pp_rank", "pp_size",
                                                                  "part", "num_parts"))))
    return found


def check_sharded_state(folder: str, tp_size: int, pp_size: int,
                        ranks: list[tuple[int, int]] | None = None) -> dict[tuple[int, int], list[str]]:
    """Check that ``folder`` holds a complete sharded state for this parallel layout.

    Args:
        tp_size, pp_size: the loading engine's ``tensor_parallel_size`` / ``pipeline_parallel_size``.
        ranks: the (tp_rank, pp_rank) pairs to check (None: all of the layout's).
    Returns:
        (tp_rank, pp_rank) -> that rank's file paths in part order.
    Raises:
        ValueError: no sharded-state file in ``folder``; files saved with another
            ``tensor_parallel_size`` / ``pipeline_parallel_size`` (both named); a rank's file missing.
    """
    files = _shard_files(folder)
    if not files:
        raise ValueError(f"{folder!r} holds no sharded-state files (load_format='sharded_state' reads the files "
                         "save_sharded_state writes; save them first with llm.llm_engine.engine_core."
                         "save_sharded_state)")
    saved = sorted({(f.tp_size, f.pp_size) for f in files})
    if saved != [(tp_size, pp_size)]:
        layouts = ", ".join(f"tensor_parallel_size={t}, pipeline_parallel_size={p}" for t, p in saved)
        raise ValueError(f"the sharded state in {folder!r} was saved with {layouts}; it loads only with the "
                         f"same sizes, not tensor_parallel_size={tp_size}, pipeline_parallel_size={pp_size} "
                         "(save it again from an engine with these sizes)")
    by_rank: dict[tuple[int, int], list[str]] = {}
    for tp_rank, pp_rank in ranks or [(t, p) for p in range(pp_size) for t in range(tp_size)]:
        mine = {f.part: f for f in files if (f.tp_rank, f.pp_rank) == (tp_rank, pp_rank)}
        if not mine:
            raise ValueError(f"the sharded state in {folder!r} has no file for tp_rank={tp_rank}, "
                             f"pp_rank={pp_rank} (a shard is missing)")
        num_parts = next(iter(mine.values())).num_parts
        missing = [p for p in range(num_parts) if p not in mine]
        if missing:
            raise ValueError(f"the sharded state in {folder!r} lacks part(s) {missing} of {num_parts} for "
                             f"tp_rank={tp_rank}, pp_rank={pp_rank} (a shard is missing)")
        by_rank[tp_rank, pp_rank] = [mine[p].path for p in range(num_parts)]
    return by_rank


def load_rank_state(model: nn.Module, paths: list[str]) -> None:
    """Copy one rank's saved tensors into ``model`` (built for that rank, e.g. by
    ``worker.build_model`` without weights) by name, cast to each tensor's dtype. The caller
    then runs ``models.utils.process_weights_after_loading``, as a checkpoint load does.

    Raises:
        ValueError: as ``copy_state``.
    """
    from safetensors import safe_open

    def tensors():
        for path in paths:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                    yield name, f.get_tensor(name)

    copy_state(model, tensors(), "the sharded state")


def copy_state(model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]], source: str) -> None:
    """Copy (name, tensor) pairs under the model's own names (``rank_state_dict``'s) into
    ``model``, cast to each target's dtype; every target must be given.

    Args:
        source: what the tensors came from, for the error messages.
    Raises:
        ValueError: a name the model lacks, a shape mismatch, or model tensors left unloaded.
    """
    state = rank_state_dict(model)
    loaded: set[str] = set()
    with torch.no_grad():
        for name, tensor in named_tensors:
            target = state.get(name)
            if target is None:
                raise ValueError(f"{source}: tensor {name!r} has no place in the model "
                                 "(saved from another model or engine version?)")
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(f"{source}: shape mismatch for {name}: saved "
                                 f"{tuple(tensor.shape)} vs model {tuple(target.shape)}")
            target.copy_(tensor)
            loaded.add(name)
    missing = sorted(set(state) - loaded)
    if missing:
        raise ValueError(f"{source} lacks {len(missing)} of this rank's tensors, e.g. {missing[:5]}")
