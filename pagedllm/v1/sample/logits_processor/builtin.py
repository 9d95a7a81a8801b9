"""vLLM V1's ``vllm.v1.sample.logits_processor.builtin`` path: ``process_dict_updates`` (pagedllm's
built-in processing, min_tokens, logit_bias, min_p, lives in ``pagedllm.sample``)."""

from pagedllm.sample.logits_processor import process_dict_updates

__all__ = ["process_dict_updates"]
