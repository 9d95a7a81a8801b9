"""The Responses API's ``{"type": "mcp", ...}`` tools: checking them, filtering a server's tools by
``allowed_tools``, offering them to the model as function tools, and the ``mcp_list_tools`` /
``mcp_call`` output items (OpenAI's shapes).

No approval flow: ``require_approval`` absent or ``"never"`` runs calls at once (as vLLM does);
asking for approval is a 400.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from pagedllm.entrypoints.openai.errors import bad_request
from pagedllm.entrypoints.openai.mcp_client import McpServer
from pagedllm.entrypoints.openai.protocol_responses import McpCallItem, McpListToolsItem, McpListToolsTool


@dataclass(frozen=True)
class McpLimits:
    """Bounds of one request's MCP tool loop.

    Args:
        max_rounds: the most model replies in one response (tool rounds plus the final answer);
            when the last still calls tools, the response is ``incomplete``.
        timeout_s: seconds one MCP operation (listing or one call) may take.
    Raises:
        ValueError: for ``max_rounds`` < 1 or ``timeout_s`` <= 0.
    """

    max_rounds: int = 8
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.max_rounds < 1:
            raise ValueError(f"max_rounds must be >= 1, got {self.max_rounds}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {self.timeout_s}")


@dataclass(frozen=True)
class McpTool:
    """One request's ``mcp`` tool: the server and which of its tools the model may use.

    Args:
        server: where the server is (label, URL, headers, timeout).
        tool_names: the allowed names; None allows all (``allowed_tools`` absent or ``["*"]``).
        read_only: with the object form's ``read_only``, only tools whose ``readOnlyHint``
            annotation equals it; None: no such filter.
    """

    server: McpServer
    tool_names: frozenset[str] | None = None
    read_only: bool | None = None

    def allows(self, tool: Any) -> bool:
        """Whether the model may see and call ``tool`` (an ``mcp.types.Tool``)."""
        if self.tool_names is not None and tool.name not in self.tool_names:
            return False
        if self.read_only is not None:
            hint = getattr(tool.annotations, "readOnlyHint", None) if tool.annotations else None
            return bool(hint) == self.read_only
        return True


def _allowed(value: Any, where: str) -> tuple[frozenset[str] | None, bool | None]:
    """(names or None, read_only or None) of an ``allowed_tools`` value."""
    if value is None:
        return None, None
    read_only = None
    if isinstance(value, dict):
        read_only = value.get("read_only")
        if read_only is not None and not isinstance(read_only, bool):
            raise bad_request(f"{where}.read_only must be a boolean, got {read_only!r}", param="tools")
        value = value.get("tool_names")
        if value is None:
            return None, read_only
    if not isinstance(value, list) or not all(isinstance(n, str) for n in value):
        raise bad_request(f"{where} must be a list of tool names or {{'tool_names': [...], 'read_only': bool}}, "
                          f"got {value!r}", param="tools")
    return (None if "*" in value else frozenset(value)), read_only


def _asks_approval(value: Any) -> bool:
    """Whether ``require_approval`` asks for an approval this server cannot give."""
    if value in (None, "never"):
        return False
    if isinstance(value, dict) and set(value) <= {"never"}:
        return False
    if isinstance(value, dict) and set(value) <= {"always", "never"}:
        always = value.get("always") or {}
        return bool(always.get("tool_names")) or always.get("read_only") is not None
    return True


def parse_mcp_tools(tools: list[Any] | None, limits: McpLimits) -> tuple[list[Any], list[McpTool]]:
    """Split ``tools`` into the other tools (as sent) and the ``mcp`` tools (checked).

    Raises:
        OpenAIError: 400 naming ``tools`` for a missing ``server_label`` / ``server_url``
            (``connector_id`` / ``tunnel_id`` are not supported), a bad URL or ``allowed_tools``,
            headers that are not strings, a repeated label, or a ``require_approval`` asking for
            approval.
    """
    others, mcp = [], []
    for i, tool in enumerate(tools or []):
        if not isinstance(tool, dict) or tool.get("type") != "mcp":
            others.append(tool)
            continue
        where = f"tools[{i}]"
        label, url = tool.get("server_label"), tool.get("server_url")
        if not isinstance(label, str) or not label:
            raise bad_request(f"{where} (mcp) needs a string 'server_label'", param="tools")
        if not isinstance(url, str):
            raise bad_request(f"{where} (mcp) needs a 'server_url' (connector_id and tunnel_id are not supported "
                              f"by this server)", param="tools")
        headers = tool.get("headers") or {}
        if not isinstance(headers, dict) or not all(isinstance(v, str) for v in headers.values()):
            raise bad_request(f"{where}.headers must map names to strings", param="tools")
        if tool.get("authorization"):
            headers = {**headers, "Authorization": f"Bearer {tool['authorization']}"}
        if _asks_approval(tool.get("require_approval")):
            raise bad_request(f"{where}.require_approval: this server has no approval flow; send 'never' (or omit "
                              f"it), got {tool['require_approval']!r}", param="tools")
        if any(t.server.server_label == label for t in mcp):
            raise bad_request(f"{where}: server_label {label!r} is used twice", param="tools")
        names, read_only = _allowed(tool.get("allowed_tools"), f"{where}.allowed_tools")
        try:
            server = McpServer(label, url, dict(headers), limits.timeout_s)
        except ValueError as e:
            raise bad_request(f"{where}: {e}", param="tools") from e
        mcp.append(McpTool(server, names, read_only))
    return others, mcp


def list_tools_item(tool: McpTool, listed: list[Any]) -> McpListToolsItem:
    """The ``mcp_list_tools`` item of the allowed ones among ``listed`` (``mcp.types.Tool``)."""
    return McpListToolsItem(id=f"mcpl_{uuid.uuid4().hex}", server_label=tool.server.server_label, tools=[
        McpListToolsTool(name=t.name, description=t.description, input_schema=dict(t.inputSchema or {}),
                         annotations=t.annotations.model_dump(exclude_none=True) if t.annotations else None)
        for t in listed if tool.allows(t)])


def function_tools(items: list[McpListToolsItem]) -> list[dict[str, Any]]:
    """The listed tools as flat Responses function tools (what the chat template shows the model).

    Raises:
        OpenAIError: 400 naming ``tools`` when two servers offer a tool of the same name.
    """
    out, seen = [], {}
    for item in items:
        for t in item.tools:
            if t.name in seen:
                raise bad_request(f"MCP servers {seen[t.name]!r} and {item.server_label!r} both offer a tool named "
                                  f"{t.name!r}; narrow one with allowed_tools", param="tools")
            seen[t.name] = item.server_label
            out.append({"type": "function", "name": t.name, "description": t.description,
                        "parameters": t.input_schema or {"type": "object", "properties": {}}})
    return out


def call_item(server_label: str, name: str, arguments: str) -> McpCallItem:
    """A new ``mcp_call`` item (no output yet)."""
    return McpCallItem(id=f"mcp_{uuid.uuid4().hex}", server_label=server_label, name=name, arguments=arguments,
                       status="calling")


def parse_arguments(arguments: str) -> dict[str, Any]:
    """A call's JSON arguments as the dict ``tools/call`` takes.

    Raises:
        ValueError: when they are not a JSON object.
    """
    value = json.loads(arguments or "{}")
    if not isinstance(value, dict):
        raise ValueError(f"arguments must be a JSON object, got {arguments!r}")
    return value


def result_text(result: Any) -> str:
    """A ``CallToolResult``'s content as text: text parts as they are, others as JSON, joined
    with newlines."""
    return "\n".join(part.text if getattr(part, "type", None) == "text" else
                     json.dumps(part.model_dump(mode="json", exclude_none=True)) for part in result.content)
