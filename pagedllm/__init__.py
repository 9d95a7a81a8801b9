"""pagedllm: a paged-KV-cache, continuously batched LLM inference engine."""

from pagedllm.sampling_params import SamplingParams
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.version import __version__

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]


def __getattr__(name):
    # Import the engine lazily so `import pagedllm` (and the scheduler tests) stay torch-light.
    if name == "LLM":
        from pagedllm.entrypoints.llm import LLM
        return LLM
    raise AttributeError(name)
