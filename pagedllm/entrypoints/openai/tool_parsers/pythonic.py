"""``pythonic``: a Python list of calls, ``[get_weather(city='Paris'), get_time()]``.

The whole reply (surrounding whitespace aside) must be the list, with keyword arguments whose
values are Python literals (strings, numbers, booleans, None, lists, dicts); anything else is
content (vLLM's ``pythonic`` parser, used by Llama 3.2 and others). Parsed with ``ast``, never
evaluated.
"""

from __future__ import annotations

import ast
from typing import Any

from pagedllm.entrypoints.openai.tool_parsers.abstract import ExtractedToolCalls, ToolParser, make_tool_call


def _function_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):  # a dotted name, e.g. tools.get_weather
        base = _function_name(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


def _parse_calls(text: str) -> list[dict[str, Any]] | None:
    try:
        tree = ast.parse(text.strip(), mode="eval")
    except SyntaxError:
        return None
    if not isinstance(tree.body, ast.List) or not tree.body.elts:
        return None
    calls = []
    for node in tree.body.elts:
        if not isinstance(node, ast.Call) or node.args or any(k.arg is None for k in node.keywords):
            return None
        name = _function_name(node.func)
        if name is None:
            return None
        try:
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
        except ValueError:
            return None
        calls.append(make_tool_call(name, arguments))
    return calls


class PythonicToolParser(ToolParser):
    name = "pythonic"

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        calls = _parse_calls(text)
        if calls is None:
            return ExtractedToolCalls(False, content=text)
        return ExtractedToolCalls(True, calls, None)

    def stream_progress(self, text: str) -> tuple[int, list[dict[str, Any]]]:
        stripped = text.lstrip()
        if not stripped or stripped.startswith("["):
            return 0, []  # may be a list of calls: hold until the reply ends
        return len(text), []
