"""Request and response bodies of the OpenAI Responses API (``/v1/responses``, pydantic 2).

Field names follow OpenAI's API reference (``input``, ``instructions``, ``max_output_tokens``,
``text.format``, ``previous_response_id``, flat function tools) plus the vLLM sampling extras the
server also takes here (``top_k``, ``min_p``, ``repetition_penalty``, ``seed``, ``structured_outputs``). Input items and
tools stay plain dicts: ``serving_responses`` checks them and names the field at fault. A
response is built with these models and sent as JSON; the openai client reads it as its
``Response`` (``output_text`` is computed client-side).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from pagedllm.entrypoints.openai.protocol import OpenAIBaseModel


class ResponsesRequest(OpenAIBaseModel):
    """``POST /v1/responses``. ``input``: a string (one user message) or a list of input items
    (messages, ``function_call``, ``function_call_output``). ``store`` defaults to true, as
    OpenAI's; ``max_output_tokens`` omitted means up to ``max_model_len``."""

    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    store: bool | None = True
    stream: bool | None = False
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    # OpenAI fields this server does not implement (refused unless they ask for nothing).
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = None
    truncation: str | None = None
    # vLLM's extra sampling fields.
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    structured_outputs: dict[str, Any] | None = None


class ResponseOutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class ResponseOutputMessage(BaseModel):
    """An assistant ``message`` output item (``id`` "msg_...")."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"] = "completed"
    content: list[ResponseOutputText] = Field(default_factory=list)


class ResponseReasoningText(BaseModel):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ResponseReasoningItem(BaseModel):
    """A ``reasoning`` output item (``id`` "rs_..."): the reply's reasoning part as the
    ``--reasoning-parser`` splits it; not carried into a later turn."""

    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ResponseReasoningText] = Field(default_factory=list)
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ResponseFunctionToolCall(BaseModel):
    """A ``function_call`` output item: ``call_id`` ("call_...") is what the client's
    ``function_call_output`` item answers; ``arguments`` is a JSON string."""

    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class McpListToolsTool(BaseModel):
    """One tool of an ``mcp_list_tools`` item, as the MCP server lists it."""

    name: str
    input_schema: dict[str, Any] = Field(default_factory=dict)
    description: str | None = None
    annotations: dict[str, Any] | None = None


class McpListToolsItem(BaseModel):
    """An ``mcp_list_tools`` output item (``id`` "mcpl_..."): the tools of one MCP server that
    the request's ``allowed_tools`` lets the model see."""

    id: str
    type: Literal["mcp_list_tools"] = "mcp_list_tools"
    server_label: str
    tools: list[McpListToolsTool] = Field(default_factory=list)
    error: str | None = None


class McpCallItem(BaseModel):
    """An ``mcp_call`` output item (``id`` "mcp_..."): one tool the model called on an MCP server.
    ``arguments`` is a JSON string; ``output`` the tool's text; ``error`` (OpenAI's
    ``mcp_protocol_error`` / ``mcp_tool_execution_error`` / ``http_error`` object) when it failed."""

    id: str
    type: Literal["mcp_call"] = "mcp_call"
    server_label: str
    name: str
    arguments: str
    output: str | None = None
    error: dict[str, Any] | None = None
    approval_request_id: str | None = None
    status: Literal["in_progress", "completed", "incomplete", "calling", "failed"] = "completed"


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    """Token counts of one response (tokens)."""

    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


class ResponsesResponse(BaseModel):
    """The ``response`` object (``id`` "resp_..."). ``status``: "in_progress" while streaming,
    "completed", or "incomplete" (cut by ``max_output_tokens`` or ``max_model_len``:
    ``incomplete_details.reason`` "max_output_tokens")."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["in_progress", "completed", "incomplete", "failed", "cancelled"] = "completed"
    model: str
    output: list[ResponseReasoningItem | ResponseOutputMessage | ResponseFunctionToolCall | McpListToolsItem |
                 McpCallItem] = Field(default_factory=list)
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    previous_response_id: str | None = None
    store: bool = True
    metadata: dict[str, Any] | None = None
    user: str | None = None
    truncation: str = "disabled"
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    usage: ResponseUsage | None = None
