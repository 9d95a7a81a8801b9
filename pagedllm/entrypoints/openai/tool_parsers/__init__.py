"""Tool-call parsers for ``tool_choice: "auto"`` (``--tool-call-parser NAME``)."""

from __future__ import annotations

from pagedllm.entrypoints.openai.tool_parsers.abstract import (ExtractedToolCalls, ToolCallStream, ToolParser,
                                                               make_tool_call)
from pagedllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from pagedllm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from pagedllm.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser
from pagedllm.entrypoints.openai.tool_parsers.xlam import XLAMToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p for p in (HermesToolParser, Llama3JsonToolParser, PythonicToolParser, XLAMToolParser)}

__all__ = ["ExtractedToolCalls", "ToolCallStream", "ToolParser", "TOOL_PARSERS", "get_tool_parser", "make_tool_call"]


def get_tool_parser(name: str) -> ToolParser:
    """The parser called ``name``.

    Raises:
        ValueError: for an unknown name (naming ``tool_call_parser`` and the known ones).
    """
    if name not in TOOL_PARSERS:
        raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}, got {name!r}")
    return TOOL_PARSERS[name]()
