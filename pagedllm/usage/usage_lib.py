"""vLLM's ``vllm.usage.usage_lib.UsageContext``: where an engine was started from. vLLM reports it
with its usage statistics; pagedllm collects none, so engines accept it and ignore it."""

from __future__ import annotations

import enum


class UsageContext(str, enum.Enum):
    """What started the engine (vLLM's members and values)."""

    UNKNOWN_CONTEXT = "UNKNOWN_CONTEXT"
    LLM_CLASS = "LLM_CLASS"
    API_SERVER = "API_SERVER"
    OPENAI_API_SERVER = "OPENAI_API_SERVER"
    OPENAI_BATCH_RUNNER = "OPENAI_BATCH_RUNNER"
    ENGINE_CONTEXT = "ENGINE_CONTEXT"
