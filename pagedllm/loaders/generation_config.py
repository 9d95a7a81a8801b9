"""The model's ``generation_config.json``: the sampling defaults its creator recommends (vLLM's
``ModelConfig.get_diff_sampling_param``), read without transformers."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

# generation_config.json keys vLLM takes as sampling defaults -> SamplingParams field.
GENERATION_CONFIG_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                            "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def load_generation_config(folder: str) -> dict[str, Any]:
    """``generation_config.json`` of ``folder`` as a dict; {} when the folder has none.

    Raises:
        ValueError: if the file is not a JSON object.
    """
    path = os.path.join(folder, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(config, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(config).__name__}")
    return config


def diff_sampling_params(model_folder: str, generation_config: str = "auto",
                         override_generation_config: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``SamplingParams`` fields the model's generation config sets (vLLM's rule).

    Args:
        model_folder: the model's folder (read when ``generation_config`` is "auto").
        generation_config: "auto" (the model folder's file), "vllm" (none: pagedllm's defaults),
            or a folder holding a ``generation_config.json``.
        override_generation_config: keys laid over the file's (e.g. ``{"temperature": 0.5}``).
    Returns:
        ``SamplingParams`` keyword arguments: temperature, top_p, top_k, min_p,
        repetition_penalty, max_tokens (the file's ``max_new_tokens``), only those set (not null).
    Raises:
        ValueError: if ``generation_config`` is none of those, or the file is malformed.
    """
    if generation_config == "vllm":
        config: dict[str, Any] = {}
    elif generation_config == "auto":
        config = load_generation_config(model_folder)
    elif isinstance(generation_config, str) and os.path.isdir(generation_config):
        config = load_generation_config(generation_config)
    else:
        raise ValueError(f"generation_config must be 'auto', 'vllm' or a folder with a generation_config.json, "
                         f"got {generation_config!r}")
    config = {**config, **(override_generation_config or {})}
    diff = {field: config[key] for key, field in GENERATION_CONFIG_FIELDS.items() if config.get(key) is not None}
    if diff:
        logger.info("default sampling parameters from the model's generation config: %s "
                    "(generation_config='vllm' ignores them)", diff)
    return diff
