"""PEFT LoRA adapters on disk (``adapter_config.json`` + ``adapter_model.safetensors``) -> tensors.

PEFT (Mangrulkar et al.) stores, for each adapted linear layer ``<module>``,
``base_model.model.<module>.lora_A.weight`` [r, in] and ``...lora_B.weight`` [out, r]; the layer
computes ``y = x W^T + scaling * (x A^T) B^T`` with ``scaling = lora_alpha / r`` (or
``lora_alpha / sqrt(r)`` with ``use_rslora``; Kalajdzievski 2023). What this engine does not
implement is refused with a ``ValueError`` naming the field.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

# The linear layers an adapter may target (Hugging Face names of the Llama / Qwen / Gemma 3 layers).
SUPPORTED_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")
_PEFT_PREFIX = "base_model.model."


@dataclass(frozen=True)
class PeftLoRAConfig:
    """The fields of ``adapter_config.json`` the engine reads.

    Attributes:
        r: the rank.
        lora_alpha: the scale's numerator.
        use_rslora: ``scaling = lora_alpha / sqrt(r)`` instead of ``lora_alpha / r``.
        target_modules: adapted layers, a subset of ``SUPPORTED_TARGET_MODULES``.
    """

    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...]

    @property
    def scaling(self) -> float:
        return self.lora_alpha / (math.sqrt(self.r) if self.use_rslora else self.r)


def _refuse_if(config: dict, field: str, ok) -> None:
    value = config.get(field)
    if not ok(value):
        raise ValueError(f"LoRA adapter_config.json: {field}={value!r} is not supported")


def read_peft_config(path: str, max_lora_rank: int | None = None) -> PeftLoRAConfig:
    """Read and check ``<path>/adapter_config.json``.

    Raises:
        ValueError: a missing folder or file, a ``peft_type`` other than LORA, ``r`` above
            ``max_lora_rank``, a target outside ``SUPPORTED_TARGET_MODULES``, ``bias`` other than
            "none", DoRA, ``fan_in_fan_out``, per-layer patterns, ``modules_to_save``,
            ``layers_to_transform``: each naming the field.
    """
    file = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(file):
        raise ValueError(f"lora_path {path!r}: no {ADAPTER_CONFIG} (a PEFT LoRA adapter folder)")
    with open(file, encoding="utf-8") as f:
        config = json.load(f)
    _refuse_if(config, "peft_type", lambda v: v in (None, "LORA"))
    _refuse_if(config, "bias", lambda v: v in (None, "none"))
    _refuse_if(config, "use_dora", lambda v: not v)
    _refuse_if(config, "fan_in_fan_out", lambda v: not v)
    _refuse_if(config, "rank_pattern", lambda v: not v)
    _refuse_if(config, "alpha_pattern", lambda v: not v)
    _refuse_if(config, "modules_to_save", lambda v: not v)
    _refuse_if(config, "layers_to_transform", lambda v: v is None)
    _refuse_if(config, "target_parameters", lambda v: not v)
    r = config.get("r")
    if not isinstance(r, int) or r < 1:
        raise ValueError(f"LoRA adapter_config.json: r={r!r} must be an int >= 1")
    if max_lora_rank is not None and r > max_lora_rank:
        raise ValueError(f"LoRA adapter {path!r}: r={r} is above max_lora_rank={max_lora_rank}")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)):
        raise ValueError(f"LoRA adapter_config.json: lora_alpha={alpha!r} must be a number")
    targets = config.get("target_modules")
    if targets == "all-linear":
        targets = list(SUPPORTED_TARGET_MODULES)
    if isinstance(targets, str) or not targets or not set(targets) <= set(SUPPORTED_TARGET_MODULES):
        raise ValueError(f"LoRA adapter_config.json: target_modules={targets!r} is not supported "
                         f"(a list among {list(SUPPORTED_TARGET_MODULES)})")
    return PeftLoRAConfig(r=r, lora_alpha=float(alpha), use_rslora=bool(config.get("use_rslora", False)),
                          target_modules=tuple(sorted(set(targets), key=SUPPORTED_TARGET_MODULES.index)))


@dataclass
class LoRAWeights:
    """An adapter's tensors on the host, keyed by the base model's module names.

    Attributes:
        config: its ``PeftLoRAConfig``.
        lora_a: module name (``model.layers.0.self_attn.q_proj``) -> A [r, in] float32.
        lora_b: module name -> ``scaling * B`` [out, r] float32 (the scale folded in).
        load_s: seconds the load took.
    """

    config: PeftLoRAConfig
    lora_a: dict
    lora_b: dict
    load_s: float = 0.0


def load_peft_adapter(path: str, max_lora_rank: int | None = None) -> LoRAWeights:
    """Read a PEFT LoRA adapter folder (config checked by ``read_peft_config``).

    Raises:
        ValueError: as ``read_peft_config``; no weights file; a tensor that is not a
            ``lora_A`` / ``lora_B`` weight of a target module (``lora_embedding``, DoRA's
            magnitude, biases), or an A without its B.
    """
    import time

    import torch

    t0 = time.perf_counter()
    config = read_peft_config(path, max_lora_rank)
    tensors = None
    for name in ADAPTER_WEIGHTS:
        file = os.path.join(path, name)
        if os.path.isfile(file):
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file

                tensors = load_file(file)
            else:
                tensors = torch.load(file, map_location="cpu", weights_only=True)
            break
    if tensors is None:
        raise ValueError(f"lora_path {path!r}: no {' / '.join(ADAPTER_WEIGHTS)}")
    lora_a, lora_b = {}, {}
    for key, tensor in tensors.items():
        name = key[len(_PEFT_PREFIX):] if key.startswith(_PEFT_PREFIX) else key
        module, _, kind = name.rpartition(".lora_")
        leaf = module.rpartition(".")[2]
        if kind not in ("A.weight", "B.weight") or leaf not in config.target_modules:
            raise ValueError(f"LoRA adapter {path!r}: tensor {key!r} is not supported "
                             f"(lora_A / lora_B weights of target_modules only)")
        (lora_a if kind == "A.weight" else lora_b)[module] = tensor.float()
    if set(lora_a) != set(lora_b):
        raise ValueError(f"LoRA adapter {path!r}: modules with lora_A but no lora_B (or the reverse): "
                         f"{sorted(set(lora_a) ^ set(lora_b))[:4]}")
    for module, b in lora_b.items():
        if lora_a[module].shape[0] != config.r or b.shape[1] != config.r:
            raise ValueError(f"LoRA adapter {path!r}: {module} has rank {lora_a[module].shape[0]}, "
                             f"adapter_config.json says r={config.r}")
        lora_b[module] = b * config.scaling
    return LoRAWeights(config=config, lora_a=lora_a, lora_b=lora_b, load_s=time.perf_counter() - t0)
