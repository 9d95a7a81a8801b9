"""vLLM V1's ``vllm.v1.sample.logits_processor.interface`` path."""

from pagedllm.sample.logits_processor import (AddedRequest, BatchUpdate, LogitsProcessor, MovedRequest,
                                              MoveDirectionality, RemovedRequest)

__all__ = ["AddedRequest", "BatchUpdate", "LogitsProcessor", "MovedRequest", "MoveDirectionality", "RemovedRequest"]
