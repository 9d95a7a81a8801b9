"""Maps a config's ``architectures`` entry to our model class."""

from __future__ import annotations

from torch import nn

from pagedllm.config import ModelConfig

from pagedllm.models.gemma3 import Gemma2ForCausalLM, Gemma3ForCausalLM
from pagedllm.models.llama import (GraniteForCausalLM, LlamaForCausalLM, MistralForCausalLM, Olmo2ForCausalLM,
                                   Phi3ForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, SmolLM3ForCausalLM)
from pagedllm.models.moe import MixtralForCausalLM, OlmoeForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Olmo2ForCausalLM": Olmo2ForCausalLM,
    "GraniteForCausalLM": GraniteForCausalLM,
    "SmolLM3ForCausalLM": SmolLM3ForCausalLM,
    "Phi3ForCausalLM": Phi3ForCausalLM,
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForCausalLM,  # text path only
    # Mixture of experts (models/moe.py)
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "OlmoeForCausalLM": OlmoeForCausalLM,
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def get_model_class(config: ModelConfig) -> type[nn.Module]:
    """The model class for a model's architecture.

    Raises:
        ValueError: if none of ``config.architectures`` is supported (lists the supported ones).
    """
    archs = list(config.architectures)
    for arch in archs:
        if arch in _MODELS:
            return _MODELS[arch]
    raise ValueError(f"architectures {archs} are not supported; supported: {supported_architectures()}")
