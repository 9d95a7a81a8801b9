"""``llama3_json``: Llama 3.x JSON calls, ``{"name": ..., "parameters": {...}}``.

vLLM's ``llama3_json`` semantics: a reply with a ``{`` (optionally after ``<|python_tag|>``) holds
one JSON object per call, several separated by ``;``; each needs ``name`` and ``arguments`` or
``parameters``. The calls are the first JSON object in the reply and the ``;``-separated objects
right after it; text around them is dropped (``content`` None). A first object that is not a
call, or a malformed one in the run, leaves the whole reply as content. Objects are read with
``json`` (any nesting depth; vLLM's pattern allows two levels).
"""

from __future__ import annotations

import json
import re
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.abstract import ExtractedToolCalls, ToolParser, make_tool_call
from pagedllm.utils.text import may_open

BOT_TOKEN = "<|python_tag|>"
_DECODER = json.JSONDecoder()
_SEPARATOR = re.compile(r"\s*(;\s*)?")


def _call(obj: Any) -> dict[str, Any] | None:
    """A call from one decoded object, or None when it is not ``{"name": str, "arguments" |
    "parameters": ...}``."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if "arguments" in obj:
        return make_tool_call(obj["name"], obj["arguments"])
    if "parameters" in obj:
        return make_tool_call(obj["name"], obj["parameters"])
    return None


def _scan(text: str, start: int) -> list[dict[str, Any] | None]:
    """The ``;``-separated objects decoded from ``text[start]`` (a ``{``) on: one entry per
    complete object, the call or None for an object that is no call. Stops at the first object
    that does not decode (unfinished or malformed) or the first gap without a ``;``."""
    calls: list[dict[str, Any] | None] = []
    pos = start
    while True:
        try:
            obj, end = _DECODER.raw_decode(text, pos)
        except json.JSONDecodeError:
            return calls
        calls.append(_call(obj))
        sep = _SEPARATOR.match(text, end)
        if sep.group(1) is None or sep.end() == len(text):
            return calls
        pos = sep.end()


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        start = text.find("{")
        if start < 0:
            return ExtractedToolCalls(False, content=text)
        calls = _scan(text, start)
        if not calls or any(c is None for c in calls):
            return ExtractedToolCalls(False, content=text)
        return ExtractedToolCalls(True, calls, None)

    def stream_progress(self, text: str) -> tuple[int, list[dict[str, Any]]]:
        start = text.find("{")
        tag = text.find(BOT_TOKEN)
        if start < 0:  # "<|python_tag|>" opens calls too: hold it and what may begin it
            return (tag if tag >= 0 else len(text) - may_open(text, BOT_TOKEN)), []
        calls = _scan(text, start)
        done = []
        for call in calls:
            if call is None:
                break
            done.append(call)
        # Text before the JSON goes out as content (a whole reply drops it: vLLM's rule).
        return (tag if 0 <= tag < start else start), done
