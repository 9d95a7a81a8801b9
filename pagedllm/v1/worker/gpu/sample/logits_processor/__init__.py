"""vLLM's ``vllm.v1.worker.gpu.sample.logits_processor``: the Model Runner V2 interface
(defined in ``interface.py``; re-exports only)."""

from pagedllm.v1.worker.gpu.sample.logits_processor.interface import (
    LogitsContext,
    LogitsProcessor,
    LogitsProcRequestState,
)

__all__ = ["LogitsContext", "LogitsProcessor", "LogitsProcRequestState"]
