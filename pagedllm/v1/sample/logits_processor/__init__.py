"""vLLM V1's ``vllm.v1.sample.logits_processor``: the class-based logits processor interface
(defined in ``pagedllm.sample.logits_processor``; pass the classes as ``LLM(logits_processors=[...])``)."""

from pagedllm.sample.logits_processor import (AdapterLogitsProcessor, AddedRequest, BatchUpdate, LogitsProcessor,
                                              MovedRequest, MoveDirectionality, RemovedRequest,
                                              RequestLogitsProcessor, VllmConfig, process_dict_updates)

__all__ = ["AdapterLogitsProcessor", "AddedRequest", "BatchUpdate", "LogitsProcessor", "MovedRequest",
           "MoveDirectionality", "RemovedRequest", "RequestLogitsProcessor", "VllmConfig", "process_dict_updates"]
