"""Helpers shared by model implementations: loading checkpoint weights (the architecture is read
once into ``ModelConfig`` by ``loaders.hf_config.hf_architecture_fields``)."""

from __future__ import annotations

import logging
from typing import Iterable

import torch
from torch import nn

logger = logging.getLogger(__name__)


def _read(source, shard) -> torch.Tensor:
    """The whole tensor, or its ``shard`` (dim, start, length). ``source`` is a tensor or a
    safetensors slice (``safe_open(...).get_slice``: only the slice's bytes are read)."""
    if shard is None:
        return source if isinstance(source, torch.Tensor) else source[:]
    dim, start, length = shard
    return source[(slice(None),) * dim + (slice(start, start + length),)]


def load_named_weights(module: nn.Module, weights: Iterable[tuple[str, torch.Tensor]],
                       skip: Iterable[str] = (), shard=None, skip_prefixes: Iterable[str] = ()) -> set[str]:
    """Copy checkpoint tensors into parameters of the same Hugging Face name.

    A ``layers.linear.MergedLinear`` at ``<parent>.<merged>`` takes the checkpoint's
    ``<parent>.<shard>.weight`` / ``.bias`` of each of its ``shard_names`` into its rows
    (vLLM's ``stacked_params_mapping``), so checkpoint keys stay Hugging Face's. A module with
    ``checkpoint_slots(name)`` (``layers.fused_moe.FusedMoE``) says where each of its checkpoint
    tensors goes (one expert's rows of a stacked parameter, and the slice this rank reads), or
    that another rank holds it (skipped unread).

    Args:
        module: the model; its ``named_parameters`` names equal checkpoint keys, except merged layers.
        weights: (name, tensor) pairs (or (name, safetensors slice)); tensors are cast to each
            parameter's dtype.
        skip: name suffixes to ignore (e.g. rotary ``inv_freq`` buffers).
        shard: ``name -> (dim, start, length) | None``: the slice of a checkpoint tensor this
            rank loads (tensor parallelism, ``layers.parallel.checkpoint_shard``); a parameter
            longer than its slice (the padded vocabulary) gets zeros in its remaining rows.
        skip_prefixes: name prefixes to ignore unread (modules of other pipeline stages).
    Returns:
        The checkpoint names loaded. Afterwards every submodule's ``process_weights_after_loading()``
        (vLLM's name) is called, if it has one.
    Raises:
        ValueError: on a shape mismatch, an unknown name, or parameters (or shards) left unloaded.
    """
    from pagedllm.layers.linear import MergedLinear

    params = dict(module.named_parameters())
    shards: dict[str, tuple[str, int, int]] = {}  # checkpoint name -> (merged param name, first row, rows)
    for mod_name, mod in module.named_modules():
        if isinstance(mod, MergedLinear):
            parent = mod_name.rpartition(".")[0]
            for part, (start, size) in mod.shard_rows().items():
                for kind in ("weight", "bias") if mod.bias is not None else ("weight",):
                    key = f"{parent}.{part}.{kind}" if parent else f"{part}.{kind}"
                    shards[key] = (f"{mod_name}.{kind}", start, size)
    slots: dict[str, tuple] = {}  # checkpoint name -> (param name, index, first row or None, rows, shard)
    elsewhere: set[str] = set()   # checkpoint names another rank loads
    for mod_name, mod in module.named_modules():
        for key, slot in (mod.checkpoint_slots(mod_name).items() if hasattr(mod, "checkpoint_slots") else ()):
            if slot is None:
                elsewhere.add(key)
            else:
                slots[key] = slot
    merged_params = {target for target, _, _ in shards.values()} | {slot[0] for slot in slots.values()}
    loaded: set[str] = set()
    skip = tuple(skip)
    skip_prefixes = tuple(skip_prefixes)
    with torch.no_grad():
        for name, source in weights:
            if skip and name.endswith(skip):
                continue
            if skip_prefixes and name.startswith(skip_prefixes) or name in elsewhere:
                continue
            rule = slots[name][4] if name in slots else shard(name) if shard is not None else None
            tensor = _read(source, rule)
            if name in shards:
                target, start, size = shards[name]
                param = params[target].narrow(0, start, size)
            elif name in slots:
                target, index, start, size, _ = slots[name]
                param = params[target][index]
                param = param if start is None else param.narrow(0, start, size)
            else:
                param = params.get(name)
                if param is None or name in merged_params:
                    raise ValueError(f"checkpoint tensor {name!r} has no matching parameter")
            if rule is not None and param.shape[rule[0]] > rule[2]:  # padded vocabulary rows
                dim, _, length = rule
                param.narrow(dim, length, param.shape[dim] - length).zero_()
                param = param.narrow(dim, 0, length)
            if tuple(param.shape) != tuple(tensor.shape):
                raise ValueError(
                    f"shape mismatch for {name}: checkpoint {tuple(tensor.shape)} vs model {tuple(param.shape)}")
            param.copy_(tensor)  # casts in the same pass (``.to`` first would allocate and write a copy)
            loaded.add(name)
    missing = (set(params) - merged_params | set(shards) | set(slots)) - loaded
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} parameters, e.g. {sorted(missing)[:5]}")
    process_weights_after_loading(module)
    return loaded


def process_weights_after_loading(module: nn.Module) -> None:
    """Call every submodule's ``process_weights_after_loading()`` (vLLM's name), if it has one:
    the caches derived from the weights (e.g. GemmaRMSNorm's 1 + w)."""
    for mod in module.modules():
        hook = getattr(mod, "process_weights_after_loading", None)
        if hook is not None:
            hook()


def pp_missing_prefixes(model: nn.Module) -> tuple[str, ...]:
    """Checkpoint name prefixes of the modules another pipeline stage owns (placeholders here:
    ``layers.parallel.PPMissingLayer``), so the loader skips them unread."""
    from pagedllm.layers.parallel import PPMissingLayer

    return tuple(f"{name}." for name, module in model.named_modules() if isinstance(module, PPMissingLayer))


def run_decoder_layers(model: nn.Module, layers, rope_of, hidden_states: torch.Tensor, kv_caches, attn_metadata,
                       fused: bool) -> torch.Tensor:
    """This stage's decoder layers over ``hidden_states`` [T, hidden]; the final norm on the last stage.

    With ``fused`` (``layers.fused_ops.fused_ops_for`` found the C++ ops), each residual add runs
    inside the norms around it (``layer.forward_fused``: one pass per sub-block boundary), else each
    layer's eager ``forward``. ``rope_of(layer)`` is the (cos, sin) the layer uses (one per RoPE
    kind). ``model`` has ``ctx`` (the stage) and ``model.norm``. ``attn_metadata`` is one
    ``AttentionMetadata`` for every layer, or a list with one per layer (the hybrid KV cache: each
    layer reads its group's block table).

    Returns:
        [T, hidden]: the final-normed hidden states (last stage) or the residual stream.
    """
    last = model.ctx.is_last_stage
    mds = attn_metadata if isinstance(attn_metadata, (list, tuple)) else [attn_metadata] * len(layers)
    if layers and fused:
        final_norm = model.model.norm if last else None
        residual, x = hidden_states, layers[0].input_layernorm(hidden_states)
        for i, (layer, kv_cache, md) in enumerate(zip(layers, kv_caches, mds)):
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else final_norm
            residual, x = layer.forward_fused(rope_of(layer), x, residual, kv_cache, md, next_norm)
        return x if last else residual
    for layer, kv_cache, md in zip(layers, kv_caches, mds):
        hidden_states = layer(rope_of(layer), hidden_states, kv_cache, md)
    return model.model.norm(hidden_states) if last else hidden_states
