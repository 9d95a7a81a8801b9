"""Model weights and files: safetensors folders, GGUF conversion (cached), config.json.

Both loaders yield ``(hf_name, tensor)`` pairs under Hugging Face parameter names, so model modules
map checkpoint keys 1:1.
"""

from pagedllm.loaders.model_files import ModelFiles, iterate_weights, load_config, resolve_model
from pagedllm.loaders.safetensors import iterate_safetensors_slices

__all__ = ["ModelFiles", "iterate_safetensors_slices", "iterate_weights", "load_config", "resolve_model"]
