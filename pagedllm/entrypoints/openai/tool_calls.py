"""OpenAI ``tools`` / ``tool_choice`` on ``/v1/chat/completions`` by constrained decoding.

``tool_choice: "required"`` constrains the reply to a JSON array of calls,
``[{"name": <one of the tools>, "parameters": <that tool's parameters schema>}, ...]`` (vLLM's
shape); a named function (``{"type": "function", "function": {"name": ...}}``) constrains it to
that function's arguments. Either works with any model, the default base model included, since
the grammar, not the model, guarantees the shape. ``"none"`` generates text. ``"auto"`` (OpenAI's
default when tools are given) lets the model write calls in its own format, found afterwards by the
server's ``--tool-call-parser`` (``tool_parsers/``); without ``--enable-auto-tool-choice`` it is
refused with a 400 naming ``tool_choice``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.openai.errors import ConstraintOrigin, bad_request
from pagedllm.entrypoints.openai.tool_parsers import ToolParser, make_tool_call
from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output.grammar import check_schema_refs, walk_schema

_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    """How a chat request's tools shape its reply.

    Attributes:
        mode: "none" (plain text), "required" (a JSON array of calls), "named" (one call) or
            "auto" (free text, calls found by ``parser``).
        structured_outputs: the constraint for "required" / "named", else None (the input
            processor checks that the backend can build it).
        function_name: the called function for "named".
        parser: the server's tool-call parser for "auto".
        origin: how a constraint the backend cannot build is answered (naming ``tools``).
    """

    mode: str
    structured_outputs: StructuredOutputsParams | None = None
    function_name: str | None = None
    parser: ToolParser | None = None
    origin: ConstraintOrigin | None = None


def _functions(tools: list[Any]) -> dict[str, dict]:
    """name -> parameters schema of each tool.

    Raises:
        OpenAIError: 400 (param ``tools``) for a tool that is not ``{"type": "function",
            "function": {"name": ..., "parameters": {...}}}`` or a repeated name.
    """
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict) \
                or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                              f"'parameters': {{...}}}}}}", param="tools")
        params = fn.get("parameters") or _EMPTY_PARAMETERS
        if not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        if fn["name"] in out:
            raise bad_request(f"tools[{i}]: the function name {fn['name']!r} is repeated", param="tools")
        out[fn["name"]] = params
    return out


def _embedded(params: dict, index: int, defs: dict[str, Any]) -> dict:
    """A tool's parameters schema as a part of the "required" schema. Its ``$ref``s point into
    the tool's own schema (``#/$defs/X``), which is no longer the root there: a schema with
    references is moved to ``defs["tool<index>"]`` (the combined schema's ``$defs``) with each
    local reference re-rooted (``#/$defs/X`` -> ``#/$defs/tool<index>/$defs/X``), and a ``$ref``
    to it takes its place. A schema without references is used as is.

    Raises:
        OpenAIError: 400 naming ``tools`` for a ``$ref`` that does not resolve in the tool's schema.
    """
    try:
        check_schema_refs(params, f"tools[{index}].function.parameters")
    except ValueError as e:
        raise bad_request(f"tools: {e}", param="tools") from None
    if not any("$ref" in node for _, node in walk_schema(params, "#")):
        return params
    key = f"tool{index}"

    def reroot(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: (f"#/$defs/{key}{v[1:]}" if k == "$ref" and isinstance(v, str) and v.startswith("#/")
                        else f"#/$defs/{key}" if k == "$ref" and v == "#" else reroot(v)) for k, v in node.items()}
        if isinstance(node, list):
            return [reroot(v) for v in node]
        return node

    defs[key] = reroot(params)
    return {"$ref": f"#/$defs/{key}"}


def plan_tools(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None = None,
               auto_tool_parser: ToolParser | None = None) -> ToolPlan:
    """The ``ToolPlan`` of a request (``parallel_tool_calls: false``: at most one call).

    Args:
        auto_tool_parser: the server's parser when it runs with ``--enable-auto-tool-choice``,
            else None (then ``"auto"`` is refused).
    Raises:
        OpenAIError: 400 naming ``tools`` or ``tool_choice``: malformed tools, a ``tool_choice``
            without tools, a named function not in ``tools``, ``"auto"`` without
            ``--enable-auto-tool-choice``, or an unknown value.
    """
    if not tools:
        if tool_choice not in (None, "none"):
            raise bad_request(f"tool_choice={tool_choice!r} needs tools", param="tool_choice")
        return ToolPlan("none")
    functions = _functions(tools)
    if tool_choice == "none":
        return ToolPlan("none")
    if tool_choice in (None, "auto"):
        if auto_tool_parser is not None:
            return ToolPlan("auto", parser=auto_tool_parser)
        # tool_choice left out: the field at fault is the tools that imply "auto".
        raise bad_request("tool_choice 'auto' (the default when tools are given) requires the server to run with "
                          "--enable-auto-tool-choice and --tool-call-parser; use tool_choice 'required', a named "
                          "function, or 'none'", param="tools" if tool_choice is None else "tool_choice")
    if tool_choice == "required":
        defs: dict[str, Any] = {}
        calls = [{"type": "object", "properties": {"name": {"enum": [name]}, "parameters": _embedded(params, i, defs)},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for i, (name, params) in enumerate(functions.items())]
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if defs:
            schema["$defs"] = defs
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan("required", StructuredOutputsParams(json=schema),
                        origin=ConstraintOrigin("tools", "the tools' parameters schemas"))
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if tool_choice.get("type") != "function" or not isinstance(name, str):
            raise bad_request("tool_choice must be 'none', 'auto', 'required' or {'type': 'function', "
                              "'function': {'name': ...}}", param="tool_choice")
        if name not in functions:
            raise bad_request(f"tool_choice names the function {name!r}, which is not in tools "
                              f"({sorted(functions)})", param="tool_choice")
        return ToolPlan("named", StructuredOutputsParams(json=functions[name]), name,
                        origin=ConstraintOrigin("tools", f"the parameters of function {name!r}"))
    raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {tool_choice!r}",
                      param="tool_choice")


def parse_tool_calls(plan: ToolPlan, text: str) -> list[dict[str, Any]] | None:
    """OpenAI ``tool_calls`` from a constrained reply, or None when the text is not a complete
    call (cut by ``max_tokens`` or a stop string; the reply then stays text). "auto" replies go
    through ``plan.parser`` instead (``serving_chat``).

    Each call: ``{"id", "type": "function", "function": {"name", "arguments"}}``, ``arguments``
    a JSON string.
    """
    if plan.mode == "named":
        try:
            json.loads(text)
        except json.JSONDecodeError:
            return None
        return [make_tool_call(plan.function_name, text)]
    if plan.mode == "required":
        try:
            calls = json.loads(text)
        except json.JSONDecodeError:
            return None
        if not isinstance(calls, list):
            return None
        return [make_tool_call(c["name"], c["parameters"]) for c in calls]
    return None
