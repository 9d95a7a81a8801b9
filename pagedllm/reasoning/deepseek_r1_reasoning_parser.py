"""``deepseek_r1``: DeepSeek R1 (and QwQ): ``<think>`` reasoning ``</think>`` content, the start
tag optional (``BaseThinkingReasoningParser``'s rules)."""

from __future__ import annotations

from pagedllm.reasoning.basic_parsers import BaseThinkingReasoningParser


class DeepSeekR1ReasoningParser(BaseThinkingReasoningParser):
    name = "deepseek_r1"
