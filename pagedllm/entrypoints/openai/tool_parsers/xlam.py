"""``xlam``: Salesforce xLAM calls, a JSON array ``[{"name": ..., "arguments": {...}}, ...]``.

vLLM's ``xlam`` semantics, in its order: after a ``</think>``, the rest when it is JSON (the
text through ``</think>`` is content), else a block below inside that rest; else the first of
these that holds valid JSON: a code block (```` ```json ... ``` ````), the text after
``[TOOL_CALLS]`` up to the end of its line, a ``<tool_call>...</tool_call>`` block (content: the
reply with every such block removed, stripped); else a whole reply starting with ``[`` that is
valid JSON (no content). The JSON must be an array; its entries without ``name`` and
``arguments`` are skipped, and a reply with no valid entry is content (its text when the
parse left none; vLLM then answers ``content`` None).
"""

from __future__ import annotations

import json
import re
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.abstract import ExtractedToolCalls, ToolParser, make_tool_call
from pagedllm.utils.text import may_open

THINK_END = "</think>"
_BLOCKS = (re.compile(r"```(?:json)?\s*([\s\S]*?)```"), re.compile(r"\[TOOL_CALLS\]([\s\S]*?)(?=\n|$)"),
           re.compile(r"<tool_call>([\s\S]*?)</tool_call>"))
# What may start a call in a streamed reply (held back from content until the reply ends).
_OPENERS = ("```", "[TOOL_CALLS]", "<tool_call>", THINK_END)


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def _split(text: str) -> tuple[str | None, str | None]:
    """(content, the JSON that may hold the calls or None) by vLLM's ``preprocess_model_output``
    rules (module docstring)."""
    think = text.find(THINK_END)
    if think >= 0:
        content, rest = text[:think + len(THINK_END)].strip(), text[think + len(THINK_END):].strip()
        if _is_json(rest):
            return content, rest
        for block in _BLOCKS:
            for body in block.findall(rest):
                if _is_json(body):
                    return content, body
    for block in _BLOCKS:
        for body in block.findall(text):
            if _is_json(body):
                return block.sub("", text).strip(), body
    if text.strip().startswith("[") and _is_json(text):
        return None, text
    return text, None


class XLAMToolParser(ToolParser):
    name = "xlam"

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        content, calls_json = _split(text)
        if calls_json is None:
            return ExtractedToolCalls(False, content=content)
        data = json.loads(calls_json)
        if not isinstance(data, list):
            return ExtractedToolCalls(False, content=content or text)
        calls = [make_tool_call(c["name"], c["arguments"]) for c in data
                 if isinstance(c, dict) and isinstance(c.get("name"), str) and "arguments" in c]
        if not calls:  # vLLM then keeps only ``content`` (None for a bare array); the reply stays
            return ExtractedToolCalls(False, content=content or text)
        return ExtractedToolCalls(True, calls, content or None)

    def stream_progress(self, text: str) -> tuple[int, list[dict[str, Any]]]:
        # The calls go out when the reply ends. Content is sent up to what may open a call,
        # less the whitespace before it (the whole parse strips it); a reply that starts with
        # whitespace or "[" is held whole.
        if not text or text[0].isspace() or text[0] == "[":
            return 0, []
        cut = min([i for i in (text.find(o) for o in _OPENERS) if i >= 0], default=len(text))
        if cut == len(text):
            cut -= max(may_open(text, o) for o in _OPENERS)
        return len(text[:cut].rstrip()), []
