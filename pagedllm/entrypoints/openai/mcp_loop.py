"""One round of the Responses API's ``mcp`` tool loop: run the model's calls on their MCP servers
(an ``mcp_call`` item each) and turn the reply and the results into the chat messages the next
round sees (the assistant's ``tool_calls``, then one ``tool`` message per call).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.openai.mcp_client import McpConnectionError, call_tool
from pagedllm.entrypoints.openai.mcp_tools import McpTool, parse_arguments, result_text
from pagedllm.entrypoints.openai.protocol_responses import (McpCallItem, ResponseFunctionToolCall,
                                                            ResponseOutputMessage)
from pagedllm.entrypoints.openai.tool_calls import ToolPlan
from pagedllm.outputs import CompletionOutput

logger = logging.getLogger(__name__)

# JSON-RPC's codes for the protocol errors this server reports itself.
_METHOD_NOT_FOUND = -32601
_INVALID_PARAMS = -32602


@dataclass
class ModelRound:
    """One model reply of the loop (or the loop's total): the tool plan it ran under, its output,
    its prompt's length, how much of it was cached and its output's length (tokens)."""

    plan: ToolPlan | None
    output: CompletionOutput | None
    num_input: int
    num_cached: int
    num_output: int


async def run_mcp_call(tool: McpTool, item: McpCallItem, allowed: bool) -> McpCallItem:
    """Run the call ``item`` (``name``, ``arguments``) on ``tool``'s server: the item done; never
    raises. Its ``output`` is the tool's text
    (status ``completed``), or its ``error`` (status ``failed``): ``mcp_protocol_error`` for a
    tool not in ``allowed_tools`` (not sent to the server), arguments that are not a JSON object,
    or a protocol error the server answered; ``mcp_tool_execution_error`` (the content) when the
    tool failed; ``http_error`` when the server could not be reached."""
    name, arguments = item.name, item.arguments

    def failed(error: dict[str, Any]) -> McpCallItem:
        logger.info("MCP call %s on %s failed: %s", name, tool.server.server_label, error)
        return item.model_copy(update={"error": error, "status": "failed"})

    if not allowed:
        return failed({"type": "mcp_protocol_error", "code": _METHOD_NOT_FOUND,
                       "message": f"tool {name!r} is not among the allowed tools of MCP server "
                                  f"{tool.server.server_label!r}"})
    try:
        args = parse_arguments(arguments)
    except ValueError as e:
        return failed({"type": "mcp_protocol_error", "code": _INVALID_PARAMS, "message": f"bad arguments: {e}"})
    try:
        result = await call_tool(tool.server, name, args)
    except McpConnectionError as e:
        return failed({"type": "http_error", "code": 424, "message": str(e)})
    except Exception as e:   # the SDK's McpError: the server answered with a JSON-RPC error
        error = getattr(e, "error", None)
        return failed({"type": "mcp_protocol_error", "code": getattr(error, "code", _INVALID_PARAMS),
                       "message": getattr(error, "message", None) or str(e)})
    if result.isError:
        return failed({"type": "mcp_tool_execution_error",
                       "content": [part.model_dump(mode="json", exclude_none=True) for part in result.content]})
    return item.model_copy(update={"output": result_text(result), "status": "completed"})


def error_text(item: McpCallItem) -> str:
    """What the model reads for a failed call: ``error: <message or the tool's text>``."""
    error = item.error or {}
    if error.get("type") == "mcp_tool_execution_error":
        detail = "\n".join(str(part.get("text", part)) for part in error.get("content") or [])
    else:
        detail = str(error.get("message", ""))
    return f"error: {detail}"


def tool_messages(reply: list[Any], called: list[tuple[ResponseFunctionToolCall, McpCallItem]]
                  ) -> list[dict[str, Any]]:
    """The chat messages that carry one round forward: the reply as an assistant message (its text,
    and a ``tool_calls`` entry per call, ids = the calls' ``call_id``), then a ``tool`` message per
    call with its output (or ``error_text``)."""
    text = "".join(p.text for item in reply if isinstance(item, ResponseOutputMessage) for p in item.content)
    assistant = {"role": "assistant", "content": text or None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
        for call, _ in called]}
    return [assistant, *({"role": "tool", "tool_call_id": call.call_id,
                          "content": done.output if done.error is None else error_text(done)}
                         for call, done in called)]
