"""Helpers shared by model implementations: reading HF config dicts and loading weights."""

from __future__ import annotations

import logging
from typing import Iterable

import torch
from torch import nn

logger = logging.getLogger(__name__)


def rope_params(config: dict, layer_type: str | None = None, default_theta: float = 10000.0
                ) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling dict or None) from a config.json dict.

    Reads transformers 5's ``rope_parameters`` (flat, or keyed by layer type as Gemma 3 writes it)
    and the legacy ``rope_theta`` / ``rope_scaling`` / ``rope_local_base_freq`` keys.
    """
    params = config.get("rope_parameters")
    if isinstance(params, dict) and layer_type is not None and layer_type in params:
        params = params[layer_type]
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = params if params.get("rope_type", "default") != "default" else None
        return theta, scaling
    if layer_type == "sliding_attention" and "rope_local_base_freq" in config:
        return float(config["rope_local_base_freq"]), None
    theta = float(config.get("rope_theta", default_theta))
    return theta, config.get("rope_scaling")


def layer_types(config: dict) -> list[str]:
    """Per-layer attention type ("full_attention" / "sliding_attention") of a config dict."""
    n = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if types:
        if len(types) != n:
            raise ValueError(f"layer_types has {len(types)} entries for {n} layers")
        return list(types)
    pattern = config.get("sliding_window_pattern")
    if pattern:
        return ["sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(n)]
    return ["full_attention"] * n


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
