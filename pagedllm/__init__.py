"""pagedllm: a paged-KV-cache, continuously batched LLM inference engine.

The names vLLM's ``vllm`` package exports are here too (``LLM``, ``EngineArgs``, ``LLMEngine``,
``AsyncLLMEngine``, ...); the engine's are imported on first access, so ``import pagedllm`` (and
the scheduler tests) stay torch-light.
"""

from pagedllm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams
from pagedllm.inputs import TextPrompt, TokensPrompt
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.lora.request import LoRARequest
from pagedllm.version import __version__

# name -> (module, attribute), imported on first access.
_LAZY = {
    "LLM": ("pagedllm.entrypoints.llm", "LLM"),
    "EngineArgs": ("pagedllm.engine.arg_utils", "EngineArgs"),
    "AsyncEngineArgs": ("pagedllm.engine.arg_utils", "AsyncEngineArgs"),
    "LLMEngine": ("pagedllm.engine.llm_engine", "LLMEngine"),
    "AsyncLLM": ("pagedllm.engine.async_engine", "AsyncLLM"),
    "AsyncLLMEngine": ("pagedllm.engine.async_engine", "AsyncLLM"),
}

__all__ = ["LLM", "SamplingParams", "BeamSearchParams", "RequestOutputKind", "RequestOutput", "CompletionOutput",
           "TextPrompt", "TokensPrompt", "LoRARequest",
           "EngineArgs", "AsyncEngineArgs", "LLMEngine", "AsyncLLM", "AsyncLLMEngine", "__version__"]


def __getattr__(name):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'pagedllm' has no attribute {name!r}")
