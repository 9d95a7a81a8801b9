"""OpenAI's stream events for the Responses API's MCP items (``response.mcp_list_tools.*``,
``response.mcp_call_arguments.*``, ``response.mcp_call.*``), framed by ``output_item.added`` /
``output_item.done``. ``event(kind, **fields)`` writes one numbered server-sent event.
"""

from __future__ import annotations

from typing import Any, Callable

from pagedllm.entrypoints.openai.protocol_responses import McpCallItem, McpListToolsItem

Event = Callable[..., str]


def list_tools_events(event: Event, index: int, item: McpListToolsItem) -> list[str]:
    """A finished ``mcp_list_tools`` item at output ``index``: added (no tools yet), in progress,
    completed (``failed`` when it holds an ``error``), done."""
    where: dict[str, Any] = {"item_id": item.id, "output_index": index}
    outcome = "failed" if item.error else "completed"
    return [event("response.output_item.added", output_index=index,
                  item=item.model_copy(update={"tools": []}).model_dump()),
            event("response.mcp_list_tools.in_progress", **where),
            event(f"response.mcp_list_tools.{outcome}", **where),
            event("response.output_item.done", output_index=index, item=item.model_dump())]


def call_started_events(event: Event, index: int, item: McpCallItem) -> list[str]:
    """An ``mcp_call`` about to run, at output ``index``: added (``in_progress``, no arguments),
    its arguments (one delta, then done), in progress."""
    where: dict[str, Any] = {"item_id": item.id, "output_index": index}
    pending = item.model_copy(update={"arguments": "", "status": "in_progress"})
    return [event("response.output_item.added", output_index=index, item=pending.model_dump()),
            event("response.mcp_call_arguments.delta", **where, delta=item.arguments),
            event("response.mcp_call_arguments.done", **where, arguments=item.arguments),
            event("response.mcp_call.in_progress", **where)]


def call_done_events(event: Event, index: int, item: McpCallItem) -> list[str]:
    """The ``mcp_call`` at output ``index`` done: completed (``failed`` with an ``error``), done."""
    outcome = "failed" if item.error is not None else "completed"
    return [event(f"response.mcp_call.{outcome}", item_id=item.id, output_index=index),
            event("response.output_item.done", output_index=index, item=item.model_dump())]
