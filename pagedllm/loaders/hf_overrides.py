"""``hf_overrides`` (vLLM's engine argument): changes to the model's ``config.json`` made before
the engine reads its architecture from it."""

from __future__ import annotations

import copy
from types import SimpleNamespace
from typing import Any, Callable


def _merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` laid over it; a dict over a dict merges key by key (so
    ``{"rope_parameters": {"rope_theta": 1e6}}`` keeps the other RoPE keys)."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _to_namespace(config: dict[str, Any]) -> SimpleNamespace:
    """config.json as attributes, as a transformers ``PretrainedConfig`` reads (sub-configs,
    the ``*_config`` dicts, as namespaces too; other dicts such as ``rope_parameters`` stay dicts)."""
    return SimpleNamespace(**{k: _to_namespace(v) if k.endswith("_config") and isinstance(v, dict) else copy.deepcopy(v)
                              for k, v in config.items()})


def _to_dict(config: SimpleNamespace | dict) -> dict[str, Any]:
    items = config.items() if isinstance(config, dict) else vars(config).items()
    return {k: _to_dict(v) if isinstance(v, SimpleNamespace) else v for k, v in items}


def apply_hf_overrides(hf_config: dict[str, Any],
                       hf_overrides: dict[str, Any] | Callable[[Any], Any] | None) -> dict[str, Any]:
    """The config.json dict with ``hf_overrides`` applied (``hf_config`` is not modified).

    Args:
        hf_config: the checkpoint's config.json.
        hf_overrides: None; a dict merged into it (nested dicts key by key); or a callable taking
            the config with attribute access (``config.num_hidden_layers``, as vLLM hands it a
            transformers ``PretrainedConfig``) and returning it (or a dict).
    Returns:
        The new config dict.
    Raises:
        ValueError: ``hf_overrides`` is neither, or the callable returns something else.
    """
    if hf_overrides is None:
        return hf_config
    if isinstance(hf_overrides, dict):
        return _merge(hf_config, hf_overrides)
    if callable(hf_overrides):
        result = hf_overrides(_to_namespace(hf_config))
        if not isinstance(result, (SimpleNamespace, dict)):
            raise ValueError(f"hf_overrides must return the config it was given, got {type(result).__name__}")
        return _to_dict(result)
    raise ValueError(f"hf_overrides must be a dict or a callable, got {type(hf_overrides).__name__}")
