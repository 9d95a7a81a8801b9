"""Helpers shared by model implementations: loading checkpoint weights (the architecture is read
once into ``ModelConfig`` by ``config.hf_architecture_fields``)."""

from __future__ import annotations

import logging
from typing import Iterable

import torch
from torch import nn

logger = logging.getLogger(__name__)


def load_named_weights(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                       skip: Iterable[str] = ()) -> set[str]:
    """Copy checkpoint tensors into parameters of the same Hugging Face name.

    A ``layers.linear.MergedLinear`` at ``<parent>.<merged>`` takes the checkpoint's
    ``<parent>.<shard>.weight`` / ``.bias`` of each of its ``shard_names`` into its rows
    (vLLM's ``stacked_params_mapping``), so checkpoint keys stay Hugging Face's.

    Args:
        module: the model; its ``named_parameters`` names equal checkpoint keys, except merged layers.
        weights: (name, tensor) pairs; tensors are cast to each parameter's dtype.
        skip: name suffixes to ignore (e.g. rotary ``inv_freq`` buffers).
    Returns:
        The checkpoint names loaded.
    Raises:
        ValueError: on a shape mismatch, an unknown name, or parameters (or shards) left unloaded.
    """
    from pagedllm.layers.linear import MergedLinear

    params = dict(module.named_parameters())
    shards: dict[str, tuple[str, int, int]] = {}  # checkpoint name -> (merged param name, first row, rows)
    for mod_name, mod in module.named_modules():
        if isinstance(mod, MergedLinear):
            parent = mod_name.rpartition(".")[0]
            for shard, (start, size) in mod.shard_rows().items():
                for kind in ("weight", "bias") if mod.bias is not None else ("weight",):
                    key = f"{parent}.{shard}.{kind}" if parent else f"{shard}.{kind}"
                    shards[key] = (f"{mod_name}.{kind}", start, size)
    merged_params = {target for target, _, _ in shards.values()}
    loaded: set[str] = set()
    skip = tuple(skip)
    with torch.no_grad():
        for name, tensor in weights:
            if skip and name.endswith(skip):
                continue
            if name in shards:
                target, start, size = shards[name]
                param = params[target].narrow(0, start, size)
            else:
                param = params.get(name)
                if param is None or name in merged_params:
                    raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)} vs model {tuple(param.shape)}")
            param.copy_(tensor.to(dtype=param.dtype))
            loaded.add(name)
    missing = (set(params) - merged_params | set(shards)) - loaded
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} parameters, e.g. {sorted(missing)[:5]}")
    return loaded
