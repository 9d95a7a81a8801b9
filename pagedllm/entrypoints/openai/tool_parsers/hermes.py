"""``hermes``: Hermes / Qwen style calls, a JSON object per ``<tool_call>`` block.

``<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>``; text
before the first block is the message content. A last block cut before its closing tag still
counts if its JSON is complete (vLLM's parser does the same).
"""

from __future__ import annotations

import json
import re
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.abstract import ExtractedToolCalls, ToolParser, make_tool_call
from pagedllm.utils.text import may_open

TOOL_CALL_START = "<tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


def _parse_block(body: str) -> dict[str, Any] | None:
    """A call from a block's JSON ({"name", "arguments"}; "parameters" accepted), or None."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = obj.get("arguments", obj.get("parameters", {}))
    return make_tool_call(obj["name"], arguments)


class HermesToolParser(ToolParser):
    name = "hermes"

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        start = text.find(TOOL_CALL_START)
        if start < 0:
            return ExtractedToolCalls(False, content=text)
        calls = [_parse_block(m.group(1) if m.group(1) is not None else m.group(2))
                 for m in _BLOCK.finditer(text[start:])]
        if not calls or any(c is None for c in calls):
            return ExtractedToolCalls(False, content=text)  # a malformed call: the reply stays text
        return ExtractedToolCalls(True, calls, text[:start] or None)

    def stream_progress(self, text: str) -> tuple[int, list[dict[str, Any]]]:
        start = text.find(TOOL_CALL_START)
        if start < 0:
            return len(text) - may_open(text, TOOL_CALL_START), []  # hold what may open "<tool_call>"
        calls = []
        for m in re.finditer(r"<tool_call>(.*?)</tool_call>", text[start:], re.DOTALL):
            call = _parse_block(m.group(1))
            if call is None:
                break  # malformed: the whole reply may end up as text, so send no more calls
            calls.append(call)
        return start, calls
