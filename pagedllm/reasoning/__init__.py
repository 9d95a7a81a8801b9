"""Reasoning parsers (``--reasoning-parser NAME``): a reply's ``<think>`` part becomes
``message.reasoning`` (and ``reasoning_content``, vLLM's older name), the rest ``content``."""

from __future__ import annotations

from pagedllm.reasoning.abs_reasoning_parsers import ReasoningParser, ReasoningStream
from pagedllm.reasoning.deepseek_r1_reasoning_parser import DeepSeekR1ReasoningParser
from pagedllm.reasoning.qwen3_reasoning_parser import Qwen3ReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    p.name: p for p in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser)}

__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningStream", "get_reasoning_parser"]


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser called ``name``.

    Raises:
        ValueError: for an unknown name (naming ``--reasoning-parser`` and the known ones).
    """
    if name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser must be one of {sorted(REASONING_PARSERS)}, got {name!r}")
    return REASONING_PARSERS[name]()
