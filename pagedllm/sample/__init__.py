"""Token sampling: per-step ``SamplingMetadata``, the batched ``Sampler``, the exact greedy head."""

from pagedllm.sample.metadata import (TOP_P_CANDIDATE_CAP, LogitsAdjustments, RandomSampling,
                                      SamplingMetadata)
from pagedllm.sample.sampler import (Sampler, SamplerOutput, compute_prompt_logprobs,
                                     make_generator)

__all__ = [
    "TOP_P_CANDIDATE_CAP",
    "LogitsAdjustments",
    "RandomSampling",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "compute_prompt_logprobs",
    "make_generator",
]
