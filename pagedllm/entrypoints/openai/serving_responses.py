"""``POST /v1/responses``, ``GET /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel``: OpenAI's
Responses API on the chat path.

A request becomes a ``ChatCompletionRequest``: ``instructions`` a first system message, ``input``
(a string, or message / ``function_call`` / ``function_call_output`` items) the messages, flat
function tools and a named ``tool_choice`` the chat shapes, ``text.format`` the
``response_format``, ``max_output_tokens`` the ``max_tokens``. It is rendered with the chat
template, constrained by ``tool_calls.plan_tools`` and sampled like a chat completion; the reply
comes back as a ``response`` whose ``output`` holds a ``reasoning`` item (with the server's
``--reasoning-parser``), an assistant ``message`` (``output_text``) and a ``function_call`` item
per tool call. Streamed, it is OpenAI's event sequence
(``response.created`` ... ``response.completed``, each with its ``sequence_number``); a reply
under tools is sent whole when it ends (a call is known only then). As vLLM does, the last event
is ``response.completed`` whatever the status (``incomplete`` when cut by ``max_output_tokens``).

``{"type": "mcp"}`` tools (the ``mcp`` extra) run a bounded loop of replies: the servers' allowed
tools (``mcp_tools``) are offered as function tools, each call the model makes is run on its
server (``mcp_loop``) and fed back, and the output holds ``mcp_list_tools`` / ``mcp_call`` items
(streamed with ``mcp_events``).

Stored responses (``store``, OpenAI's default true) live in memory, in a ``ResponseStore`` of at
most ``--max-stored-responses`` (least recently used dropped first); ``previous_response_id``
puts that response's conversation (its input and output, not its ``instructions``) before the new
input. An unknown id is a 404, as vLLM answers. There is no background mode, so, as vLLM answers
for a response that is not queued or running, cancelling a stored response is a 400.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedllm.engine.async_engine import AsyncLLM, EngineDeadError, EngineStepError, OutputStream
from pagedllm.engine.input_processor import LengthCheck
from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request, error_from_exception
from pagedllm.entrypoints.openai.protocol import ChatCompletionRequest
from pagedllm.entrypoints.openai.mcp_client import McpConnectionError, McpUnavailableError, list_tools, require_sdk
from pagedllm.entrypoints.openai.mcp_events import call_done_events, call_started_events, list_tools_events
from pagedllm.entrypoints.openai.mcp_loop import ModelRound, run_mcp_call, tool_messages
from pagedllm.entrypoints.openai.mcp_tools import (McpLimits, McpTool, call_item, function_tools, list_tools_item,
                                                   parse_mcp_tools)
from pagedllm.entrypoints.openai.protocol_responses import (InputTokensDetails, McpCallItem, McpListToolsItem,
                                                            ResponseFunctionToolCall,
                                                            ResponseOutputMessage, ResponseOutputText,
                                                            ResponseReasoningItem, ResponseReasoningText,
                                                            ResponsesRequest, ResponsesResponse, ResponseUsage)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_engine import DEFAULT_MAX_N, OpenAIServing
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.entrypoints.openai.tool_calls import ToolPlan, parse_tool_calls
from pagedllm.outputs import CompletionOutput
from pagedllm.reasoning import ReasoningParser, ReasoningStream
from pagedllm.sampling_params import RequestOutputKind
from pagedllm.structured_output.grammar import StructuredOutputsError

logger = logging.getLogger(__name__)

# --max-stored-responses: responses kept for previous_response_id and GET (0: none stored).
DEFAULT_MAX_STORED_RESPONSES = 1000

# The chat request's field -> the Responses field a client sent (named in a 400's ``param``).
_PARAM_NAMES = {"messages": "input", "response_format": "text", "max_tokens": "max_output_tokens",
                "max_completion_tokens": "max_output_tokens"}
# OpenAI's Responses fields this server does not implement: field -> "this value asks for nothing"
# (any other value is a 400 naming the field; there is no background mode, reasoning or logprobs).
RESPONSES_UNSUPPORTED_FIELDS: dict[str, Callable[[Any], bool]] = {
    "background": lambda v: v in (None, False), "reasoning": lambda v: v is None, "include": lambda v: not v,
    "top_logprobs": lambda v: v in (None, 0), "truncation": lambda v: v in (None, "disabled"),
    "conversation": lambda v: v is None, "prompt": lambda v: v is None, "max_tool_calls": lambda v: v is None,
}
_MESSAGE_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


@dataclass
class StoredResponse:
    """A stored response and its conversation as chat messages (the input without the
    ``instructions``, then the output), what a ``previous_response_id`` continues."""

    response: ResponsesResponse
    messages: list[dict[str, Any]]


class ResponseStore:
    """An LRU of at most ``max_size`` stored responses by id (one per server, no global state;
    used from the event loop only, so no lock).

    Args:
        max_size: the most responses kept (the least recently stored or read goes first); 0
            keeps none.
    Raises:
        ValueError: if ``max_size`` < 0.
    """

    def __init__(self, max_size: int = DEFAULT_MAX_STORED_RESPONSES) -> None:
        if not isinstance(max_size, int) or max_size < 0:
            raise ValueError(f"--max-stored-responses must be an int >= 0, got {max_size!r}")
        self.max_size = max_size
        self._items: collections.OrderedDict[str, StoredResponse] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, response_id: str) -> StoredResponse | None:
        """The stored response (now the most recently used), or None when unknown or dropped."""
        item = self._items.get(response_id)
        if item is not None:
            self._items.move_to_end(response_id)
        return item

    def put(self, item: StoredResponse) -> None:
        """Store ``item`` under its response's id, dropping the least recently used beyond ``max_size``."""
        if self.max_size == 0:
            return
        self._items[item.response.id] = item
        self._items.move_to_end(item.response.id)
        while len(self._items) > self.max_size:
            self._items.popitem(last=False)


def not_found(response_id: str, param: str | None = None) -> OpenAIError:
    """vLLM's 404 for a response id the server does not hold."""
    return OpenAIError(404, f"Response with id '{response_id}' not found.", "invalid_request_error", param)


def _parts_text(content: Any, where: str) -> str:
    """A message's or output's text: a string, or the text of its ``input_text`` / ``output_text``
    parts joined with newlines.

    Raises:
        OpenAIError: 400 naming ``input`` for another part type (images, files) or a malformed part.
    """
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of input_text parts", param="input")
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{k}]: content part type {kind!r} is not supported (this server takes "
                              f"text only: {list(_TEXT_PARTS[:2])} with a string 'text')", param="input")
        texts.append(part["text"])
    return "\n".join(texts)


def input_messages(items: str | list[Any]) -> list[dict[str, Any]]:
    """``input`` as chat messages: a string is one user message; a ``message`` item keeps its role
    and text; consecutive ``function_call`` items become one assistant message's ``tool_calls``
    (joined to the assistant message right before them); a ``function_call_output`` item a
    ``tool`` message; ``reasoning``, ``mcp_list_tools`` and ``mcp_call`` items are skipped.

    Raises:
        OpenAIError: 400 naming ``input`` for an unknown item type or role, a missing field, or
            non-text content.
    """
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object (a message or a function_call / function_call_output "
                              f"item), got {type(item).__name__}", param="input")
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            if item.get("role") not in _MESSAGE_ROLES:
                raise bad_request(f"{where}.role must be one of {list(_MESSAGE_ROLES)}, got {item.get('role')!r}",
                                  param="input")
            messages.append({"role": item["role"], "content": _parts_text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            for key in ("call_id", "name", "arguments"):
                if not isinstance(item.get(key), str):
                    raise bad_request(f"{where} (function_call) needs a string {key!r}", param="input")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise bad_request(f"{where} (function_call_output) needs a string 'call_id'", param="input")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": _parts_text(item.get("output"), f"{where}.output")})
        elif kind not in ("reasoning", "mcp_list_tools", "mcp_call"):
            raise bad_request(f"{where}.type must be 'message', 'function_call' or 'function_call_output', got "
                              f"{kind!r}", param="input")
    if not messages:
        raise bad_request("input must hold at least one message", param="input")
    return messages


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    """Flat Responses function tools (``{"type": "function", "name", "parameters", ...}``) as chat
    tools (``{"type": "function", "function": {...}}``).

    Raises:
        OpenAIError: 400 naming ``tools`` for a tool that is not a function tool with a name.
    """
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
            raise bad_request(f"tools[{i}] must be a function tool {{'type': 'function', 'name': ..., 'parameters': "
                              f"{{...}}}} (this server runs no built-in tools), got type {kind!r}", param="tools")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(tool_choice: Any) -> Any:
    """A Responses ``tool_choice`` (``"none"`` / ``"auto"`` / ``"required"`` /
    ``{"type": "function", "name": ...}``) in the chat shape.

    Raises:
        OpenAIError: 400 naming ``tool_choice`` for another object (built-in or allowed tools).
    """
    if not isinstance(tool_choice, dict):
        return tool_choice
    if tool_choice.get("type") != "function" or not isinstance(tool_choice.get("name"), str):
        raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', 'name': ...}}, "
                          f"got {tool_choice!r}", param="tool_choice")
    return {"type": "function", "function": {"name": tool_choice["name"]}}


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """``text.format`` as chat's ``response_format``: ``json_schema`` (flat: ``name``, ``schema``,
    ``strict``) becomes ``{"type": "json_schema", "json_schema": {...}}``; ``json_object`` and
    ``text`` stay as they are.

    Raises:
        OpenAIError: 400 naming ``text`` for a format that is not an object.
    """
    if not text or text.get("format") is None:
        return None
    fmt = text["format"]
    if not isinstance(fmt, dict):
        raise bad_request(f"text.format must be an object, got {type(fmt).__name__}", param="text")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
    return dict(fmt)


def _renamed(e: OpenAIError) -> OpenAIError:
    """``e`` with its ``param`` and message naming the Responses field instead of the chat one."""
    param = _PARAM_NAMES.get(e.param, e.param)
    message = e.message
    if e.param == "response_format":
        message = message.replace("response_format.json_schema.schema", "text.format.schema").replace(
            "response_format", "text.format")
    elif e.param in _PARAM_NAMES and message.startswith(e.param):
        message = param + message[len(e.param):]
    return OpenAIError(e.status_code, message, e.type, param, e.code)


class OpenAIServingResponses(OpenAIServing):
    """Handler of ``/v1/responses`` (on the chat handler's template, tool parser and checks).

    Args:
        engine, models, log_requests, max_n, pool: as ``OpenAIServing``.
        chat: the server's chat handler: rendering (``--chat-template``), the ``--tool-call-parser``
            for ``tool_choice: "auto"``.
        store: where stored responses live (its size is ``--max-stored-responses``); None: a
            ``ResponseStore`` of ``DEFAULT_MAX_STORED_RESPONSES``.
        mcp_limits: rounds and seconds of the ``mcp`` tool loop; None: ``McpLimits()``.
    """

    fields = set(ResponsesRequest.model_fields)

    def __init__(self, engine: AsyncLLM, models: OpenAIServingModels, chat: OpenAIServingChat,
                 log_requests: bool = True, max_n: int = DEFAULT_MAX_N,
                 pool: concurrent.futures.Executor | None = None,
                 store: ResponseStore | None = None, mcp_limits: McpLimits | None = None) -> None:
        super().__init__(engine, models, log_requests, max_n, pool)
        self.chat = chat
        self.store = ResponseStore() if store is None else store
        self.mcp_limits = McpLimits() if mcp_limits is None else mcp_limits

    # -- checks and conversion ---------------------------------------------------------------

    def chat_request(self, request: ResponsesRequest, mcp_tools: list[dict[str, Any]] = ()
                     ) -> tuple[ChatCompletionRequest, StoredResponse | None]:
        """The chat request a Responses request runs as, and the previous response it continues.
        ``mcp_tools``: the MCP servers' allowed tools as flat function tools, offered in place of
        the request's ``mcp`` entries.

        Raises:
            OpenAIError: 404 naming ``previous_response_id`` for an id not stored; 400 naming the
                field for malformed input, tools, ``tool_choice`` or ``text``.
        """
        previous = None
        if request.previous_response_id is not None:
            previous = self.store.get(request.previous_response_id)
            if previous is None:
                raise not_found(request.previous_response_id, param="previous_response_id")
        if request.max_output_tokens is not None and request.max_output_tokens < 1:
            raise bad_request(f"max_output_tokens must be at least 1, got {request.max_output_tokens}",
                              param="max_output_tokens")
        messages = [{"role": "system", "content": request.instructions}] if request.instructions else []
        messages += [dict(m) for m in previous.messages] if previous is not None else []
        messages += input_messages(request.input)
        chat = ChatCompletionRequest(
            model=request.model, messages=messages, tools=chat_tools(
                [t for t in request.tools or [] if not _is_mcp(t)] + list(mcp_tools)),
            tool_choice=chat_tool_choice(request.tool_choice), parallel_tool_calls=request.parallel_tool_calls,
            response_format=response_format(request.text), max_tokens=request.max_output_tokens,
            temperature=request.temperature, top_p=request.top_p, seed=request.seed, top_k=request.top_k,
            min_p=request.min_p, repetition_penalty=request.repetition_penalty, user=request.user,
            structured_outputs=request.structured_outputs)
        return chat, previous

    # -- the routes ----------------------------------------------------------------------------

    async def create_responses(self, request: ResponsesRequest, raw_request: Request | None = None) -> Response:
        """Validate and render (a 400 / 404 before any event is streamed), queue one engine
        request, answer with the ``response`` or its event stream, and store it when
        ``store`` is true.

        Raises:
            OpenAIError: 400 for invalid input (``param`` names the Responses field), 404 for an
                unknown model or ``previous_response_id``.
        """
        arrival_time = time.monotonic()
        model_name = self.models.resolve(request.model)
        self.check_unsupported_fields(request, RESPONSES_UNSUPPORTED_FIELDS)
        self.warn_unknown_fields(request, RESPONSES_UNSUPPORTED_FIELDS)
        _, mcp = parse_mcp_tools(request.tools, self.mcp_limits)
        if mcp:
            return await self._create_with_mcp(request, mcp, model_name, raw_request, arrival_time)
        try:
            chat, previous = self.chat_request(request)
        except OpenAIError as e:
            raise _renamed(e) from e
        stream = bool(request.stream)
        response_id = f"resp_{uuid.uuid4().hex}"
        tool_plan, outputs, num_input = await self._submit(request, chat, model_name, response_id, raw_request,
                                                           arrival_time, stream)
        base = self._base(request, response_id, model_name)
        history = chat.messages[1:] if request.instructions else chat.messages
        if stream:
            return StreamingResponse(self._stream(request, base, outputs, tool_plan, num_input, history),
                                     media_type="text/event-stream")
        final = (await self.final_outputs(outputs))[response_id]
        o = final.outputs[0]
        response = self._finish(request, base, self._output_items(tool_plan, o.text), o, num_input,
                                final.num_cached_tokens, history)
        return JSONResponse(response.model_dump())

    async def _submit(self, request: ResponsesRequest, chat: ChatCompletionRequest, model_name: str,
                      request_id: str, raw_request: Request | None, arrival_time: float, stream: bool
                      ) -> tuple[ToolPlan, OutputStream, int]:
        """Plan tools, render ``chat`` and queue it as engine request ``request_id``: (the tool
        plan, its output stream, the prompt's length in tokens).

        Raises:
            OpenAIError: 400 naming the Responses field for a bad constraint, tool choice or
                prompt (too long for ``max_model_len``).
        """
        try:
            tool_plan, structured_outputs, origin = self.chat.plan_tools_and_constraint(chat, "text.format", request.tool_choice)
            prompt = await self.run_in_pool(self.chat.render, chat)
        except OpenAIError as e:
            raise _renamed(e) from e
        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        try:
            params = self.sampling_params(chat, request.max_output_tokens, None, kind,
                                          structured_outputs=structured_outputs)
            processed = await self.run_in_pool(self.engine.process_inputs, prompt, params,
                                               LengthCheck("max_output_tokens", "input"))
            processed = processed.with_lora(self.models.lora_for(model_name))   # the adapter `model` names
            num_input = len(processed.prompt_token_ids)
            self.log_request(request_id, processed.prompt, num_input, processed.params)
            outputs = self.engine.add_request(request_id, processed, arrival_time=arrival_time,
                                              trace_headers=self.trace_headers(raw_request))
        except StructuredOutputsError as e:   # named by the chat field it came from: rename it
            raise _renamed(error_from_exception(e, constraint=origin)) from e
        except Exception as e:
            raise error_from_exception(e, self.fields, prompt_param="input") from e
        return tool_plan, outputs, num_input

    @staticmethod
    def _base(request: ResponsesRequest, response_id: str, model_name: str) -> ResponsesResponse:
        """The response as it starts (``in_progress``, no output), echoing the request's settings."""
        return ResponsesResponse(
            id=response_id, status="in_progress", model=model_name, instructions=request.instructions,
            max_output_tokens=request.max_output_tokens, temperature=request.temperature, top_p=request.top_p,
            tools=list(request.tools or []), tool_choice=request.tool_choice or ("auto" if request.tools else "none"),
            parallel_tool_calls=request.parallel_tool_calls is not False,
            text=request.text or {"format": {"type": "text"}}, previous_response_id=request.previous_response_id,
            store=bool(request.store), metadata=request.metadata, user=request.user)

    async def generate_round(self, request: ResponsesRequest, chat: ChatCompletionRequest, model_name: str,
                             request_id: str, raw_request: Request | None, arrival_time: float) -> ModelRound:
        """One model reply to ``chat`` (a round of the ``mcp`` tool loop), awaited whole.

        Raises:
            OpenAIError: as ``_submit``.
        """
        plan, outputs, num_input = await self._submit(request, chat, model_name, request_id, raw_request,
                                                      arrival_time, stream=False)
        final = (await self.final_outputs(outputs))[request_id]
        o = final.outputs[0]
        return ModelRound(plan, o, num_input, final.num_cached_tokens or 0, len(o.token_ids))

    async def _create_with_mcp(self, request: ResponsesRequest, mcp: list[McpTool], model_name: str,
                               raw_request: Request | None, arrival_time: float) -> Response:
        """The ``mcp`` tool loop: list each server's tools (an ``mcp_list_tools`` item each), offer
        the allowed ones as function tools, and while the model calls them (at most
        ``mcp_limits.max_rounds`` replies) call them on their servers (an ``mcp_call`` item each)
        and feed the results back as tool messages. A call of one of the request's own function
        tools ends the loop with its ``function_call`` item, as without MCP. Streamed, each item
        is sent when it is done (with OpenAI's ``response.mcp_list_tools.*`` and
        ``response.mcp_call*`` events), each reply whole.

        Raises:
            OpenAIError: 400 without the ``mcp`` extra; 424 naming the server when its tools
                cannot be listed (OpenAI's status for an MCP server it cannot reach); as
                ``_submit`` for the first reply.
        """
        try:
            require_sdk()
        except McpUnavailableError as e:
            raise bad_request(str(e), param="tools") from e
        listed: list[McpListToolsItem] = []
        for tool in mcp:
            try:
                tools = await list_tools(tool.server)
            except McpConnectionError as e:
                raise OpenAIError(424, f"Error retrieving tool list from MCP server: {tool.server.server_label!r} "
                                  f"({tool.server.server_url}): {e}", "external_connector_error", "tools",
                                  "mcp_list_tools_failed") from e
            listed.append(list_tools_item(tool, tools))
        try:
            chat, previous = self.chat_request(request, function_tools(listed))
        except OpenAIError as e:
            raise _renamed(e) from e
        history = chat.messages[1:] if request.instructions else chat.messages
        base = self._base(request, f"resp_{uuid.uuid4().hex}", model_name)
        loop = self._mcp_rounds(request, chat, mcp, listed, base, raw_request, arrival_time)
        head = []   # the steps up to the first reply's: its errors are still an HTTP status
        while not head or (head[-1][0] == "item" and isinstance(head[-1][1], McpListToolsItem)):
            head.append(await anext(loop))
        if request.stream:
            return StreamingResponse(self._mcp_stream(request, base, history, head, loop),
                                     media_type="text/event-stream")
        steps = head + [step async for step in loop]
        items = [item for kind, item in steps if kind == "item"]
        return JSONResponse(self._mcp_finish(request, base, history, items, steps[-1][1]).model_dump())

    async def _mcp_rounds(self, request: ResponsesRequest, chat: ChatCompletionRequest, mcp: list[McpTool],
                          listed: list[McpListToolsItem], base: ResponsesResponse, raw_request: Request | None,
                          arrival_time: float) -> AsyncIterator[tuple[str, Any]]:
        """The loop's steps, in order: ``("item", item)`` for each finished output item (the
        ``mcp_list_tools`` items first), ``("calling", item)`` before an ``mcp_call`` runs, and
        last ``("end", ModelRound)`` with the last reply and the token counts of all replies."""
        own = {t["function"]["name"] for t in chat_tools([t for t in request.tools if not _is_mcp(t)]) or []}
        servers = {t.server.server_label: t for t in mcp}
        offered = {t.name: item.server_label for item in listed for t in item.tools}
        for item in listed:
            yield "item", item
        total = ModelRound(None, None, 0, 0, 0)   # the last reply, the tokens of all
        for k in range(self.mcp_limits.max_rounds):
            step = await self.generate_round(request, chat, base.model, f"{base.id}-{k}", raw_request, arrival_time)
            total = ModelRound(step.plan, step.output, total.num_input + step.num_input, total.num_cached +
                               step.num_cached, total.num_output + len(step.output.token_ids))
            reply = self._output_items(step.plan, step.output.text)
            calls = [i for i in reply if isinstance(i, ResponseFunctionToolCall)]
            mcp_calls = [i for i in calls if i.name not in own]
            called = []
            for item in reply:
                if item not in mcp_calls:
                    yield "item", item
                    continue
                tool = servers[offered.get(item.name, mcp[0].server.server_label)]
                pending = call_item(tool.server.server_label, item.name, item.arguments)
                yield "calling", pending
                done = await run_mcp_call(tool, pending, item.name in offered)
                called.append((item, done))
                yield "item", done
            if not mcp_calls or len(mcp_calls) < len(calls) or step.output.finish_reason == "length":
                break
            chat.messages = [*chat.messages, *tool_messages(reply, called)]
        else:   # the last reply still called tools: cut off like a reply at max_output_tokens
            total.output = CompletionOutput(index=0, text="", token_ids=[], cumulative_logprob=None, logprobs=None,
                                            finish_reason="length")
        yield "end", total

    def _mcp_finish(self, request: ResponsesRequest, base: ResponsesResponse, history: list[dict[str, Any]],
                    items: list, end: ModelRound) -> ResponsesResponse:
        """The finished response of the loop (``end``: its last step)."""
        return self._finish(request, base, items, end.output, end.num_input, end.num_cached, history,
                            num_output=end.num_output)

    async def _mcp_stream(self, request: ResponsesRequest, base: ResponsesResponse, history: list[dict[str, Any]],
                          head: list[tuple[str, Any]], loop: AsyncIterator[tuple[str, Any]]) -> AsyncIterator[str]:
        """The loop's event stream: created, in progress, each item's events as it is done,
        completed (or an ``error`` event when a later reply fails)."""
        event = EventCounter()
        items: list = []
        yield event("response.created", response=base.model_dump())
        yield event("response.in_progress", response=base.model_dump())
        try:
            while True:
                kind, item = head.pop(0) if head else await anext(loop)
                if kind == "end":
                    break
                if kind == "calling":
                    for piece in call_started_events(event, len(items), item):
                        yield piece
                elif isinstance(item, McpCallItem):
                    for piece in call_done_events(event, len(items), item):
                        yield piece
                elif isinstance(item, McpListToolsItem):
                    for piece in list_tools_events(event, len(items), item):
                        yield piece
                else:
                    item.status = "completed"
                    for piece in self._item_events(event, len(items), item, announced=False):
                        yield piece
                if kind == "item":
                    items.append(item)
            response = self._mcp_finish(request, base, history, items, item)
            yield event("response.completed", response=response.model_dump())
        except (OpenAIError, EngineStepError, EngineDeadError) as e:
            logger.error("request %s failed: %s", base.id, e)
            error = e if isinstance(e, OpenAIError) else error_from_exception(e)
            yield event("error", code=error.code or error.type, message=error.message, param=error.param)
        finally:
            await loop.aclose()

    async def retrieve_responses(self, response_id: str) -> Response:
        """``GET /v1/responses/{id}``: the stored response.

        Raises:
            OpenAIError: 404 for an id not stored (never stored, ``store`` false, or dropped).
        """
        stored = self.store.get(response_id)
        if stored is None:
            raise not_found(response_id)
        return JSONResponse(stored.response.model_dump())

    async def cancel_responses(self, response_id: str) -> Response:
        """``POST /v1/responses/{id}/cancel``: only a background response can be cancelled, and this
        server runs none (vLLM's answers).

        Raises:
            OpenAIError: 404 for an id not stored; 400 for a stored (finished) response.
        """
        if self.store.get(response_id) is None:
            raise not_found(response_id)
        raise bad_request("Cannot cancel a synchronous response.")

    # -- building the response ---------------------------------------------------------------

    def reasoning_parser_for(self, plan: ToolPlan) -> ReasoningParser | None:
        """The ``--reasoning-parser`` when it splits this reply (free text: ``tool_choice`` "none"
        or "auto", as on chat), else None."""
        return self.chat.reasoning_parser if plan.mode in ("none", "auto") else None

    def _output_items(self, plan: ToolPlan, text: str) -> list[ResponseReasoningItem | ResponseOutputMessage |
                                                              ResponseFunctionToolCall]:
        """The ``output`` items of a finished reply: its reasoning part as a ``reasoning`` item
        (with a ``--reasoning-parser``), a ``message`` for its text (always under ``tool_choice:
        "none"``; under tools only when text is left besides the calls), then a ``function_call``
        per call (found by the plan's constraint or, in the content, by the ``auto`` parser)."""
        items: list[ResponseReasoningItem | ResponseOutputMessage | ResponseFunctionToolCall] = []
        parser = self.reasoning_parser_for(plan)
        if parser is not None:
            reasoning, text = parser.extract_reasoning(text)
            text = text or ""
            if reasoning:
                items.append(ResponseReasoningItem(id=f"rs_{uuid.uuid4().hex}",
                                                   content=[ResponseReasoningText(text=reasoning)]))
        content, calls = text, None
        if plan.mode == "auto":
            found = plan.parser.extract_tool_calls(text)
            if found.tools_called:
                content, calls = found.content or "", found.tool_calls
        elif plan.mode != "none":
            calls = parse_tool_calls(plan, text)
            if calls is not None:
                content = ""
        if (calls is None and not items) or content:
            items.append(ResponseOutputMessage(id=f"msg_{uuid.uuid4().hex}",
                                               content=[ResponseOutputText(text=content)]))
        for call in calls or []:
            items.append(ResponseFunctionToolCall(id=f"fc_{uuid.uuid4().hex}", call_id=f"call_{uuid.uuid4().hex}",
                                                  name=call["function"]["name"],
                                                  arguments=call["function"]["arguments"]))
        return items

    def _finish(self, request: ResponsesRequest, base: ResponsesResponse, items: list, o: CompletionOutput,
                num_input: int, num_cached: int | None, history: list[dict[str, Any]],
                num_output: int | None = None) -> ResponsesResponse:
        """The finished response (status, usage), stored when ``request.store``. ``o`` is the
        last reply; ``num_output``: the output tokens of all replies (tokens; None: ``o``'s)."""
        incomplete = o.finish_reason == "length"
        status = "incomplete" if incomplete else "completed"
        for item in items:
            if not isinstance(item, (McpListToolsItem, McpCallItem)):   # those keep their own status
                item.status = status
        num_output = len(o.token_ids) if num_output is None else num_output
        response = base.model_copy(update=dict(
            status=status, output=items,
            incomplete_details={"reason": "max_output_tokens"} if incomplete else None,
            usage=ResponseUsage(input_tokens=num_input, output_tokens=num_output, total_tokens=num_input + num_output,
                                input_tokens_details=InputTokensDetails(cached_tokens=num_cached or 0))))
        if request.store:
            self.store.put(StoredResponse(response, [*history, *_as_messages(items)]))
        return response

    # -- streaming ---------------------------------------------------------------------------

    async def _stream(self, request: ResponsesRequest, base: ResponsesResponse, outputs: OutputStream,
                      plan: ToolPlan, num_input: int, history: list[dict[str, Any]]) -> AsyncIterator[str]:
        event = EventCounter()

        def dump(item) -> dict[str, Any]:
            return item.model_dump()

        text, token_ids, num_cached, last = "", [], None, None
        # tool_choice "none": the text streams as it comes (its reasoning part first, in a
        # "reasoning" item, with a --reasoning-parser); under tools the reply is sent whole.
        live = plan.mode == "none"
        parser = self.reasoning_parser_for(plan)
        split = ReasoningStream(parser) if parser is not None and live else None
        reasoning = ResponseReasoningItem(id=f"rs_{uuid.uuid4().hex}", status="in_progress")
        message = ResponseOutputMessage(id=f"msg_{uuid.uuid4().hex}", status="in_progress")
        announced: set[str] = set()   # ids of the items whose added event is sent
        closed: set[str] = set()      # ... and of those sent in full
        try:
            yield event("response.created", response=dump(base))
            yield event("response.in_progress", response=dump(base))
            async for out in outputs:
                num_cached = out.num_cached_tokens if out.num_cached_tokens is not None else num_cached
                o = last = out.outputs[0]
                text += o.text
                token_ids += list(o.token_ids)
                if not live:
                    continue
                thought, said = split.feed(o.text, final=o.finish_reason is not None) if split else ("", o.text)
                if thought:
                    if reasoning.id not in announced:
                        announced.add(reasoning.id)
                        yield event("response.output_item.added", output_index=0, item=dump(reasoning))
                    reasoning.content.append(ResponseReasoningText(text=thought))
                    yield event("response.reasoning_text.delta", item_id=reasoning.id, output_index=0,
                                content_index=0, delta=thought)
                index = 1 if reasoning.id in announced else 0   # the message's output index
                if said:
                    if reasoning.id in announced and reasoning.id not in closed:   # the reasoning is complete
                        closed.add(reasoning.id)
                        done = reasoning.model_copy(update={"status": "completed", "content": [ResponseReasoningText(
                            text="".join(part.text for part in reasoning.content))]})
                        for piece in self._item_events(event, 0, done, announced=True):
                            yield piece
                    if message.id not in announced:
                        announced.add(message.id)
                        yield event("response.output_item.added", output_index=index, item=dump(message))
                        yield event("response.content_part.added", item_id=message.id, output_index=index,
                                    content_index=0, part=dump(ResponseOutputText(text="")))
                    yield event("response.output_text.delta", item_id=message.id, output_index=index,
                                content_index=0, delta=said, logprobs=[])
            last = CompletionOutput(index=0, text=text, token_ids=token_ids, cumulative_logprob=None, logprobs=None,
                                    finish_reason=last.finish_reason if last else None,
                                    stop_reason=last.stop_reason if last else None)
            items = self._output_items(plan, text)
            if live:   # the ids the stream announced (the parts equal the whole reply's split)
                for item in items:
                    item.id = reasoning.id if isinstance(item, ResponseReasoningItem) else message.id
            response = self._finish(request, base, items, last, num_input, num_cached, history)
            for index, item in enumerate(response.output):
                if item.id not in closed:
                    for piece in self._item_events(event, index, item, announced=item.id in announced):
                        yield piece
            yield event("response.completed", response=dump(response))
        except (EngineStepError, EngineDeadError) as e:
            logger.error("request %s failed: %s", base.id, e)
            error = error_from_exception(e)
            yield event("error", code=error.code or error.type, message=error.message, param=error.param)
        finally:
            outputs.abort()

    @staticmethod
    def _item_events(event, index: int, item, announced: bool) -> list[str]:
        """The events that send one finished output item: added and its text (unless
        ``announced``: streamed live), its arguments, the text's done events, and done."""
        pieces = []
        if isinstance(item, ResponseReasoningItem):
            part = item.content[0]
            if not announced:
                pending = item.model_copy(update={"content": [], "status": "in_progress"})
                pieces.append(event("response.output_item.added", output_index=index, item=pending.model_dump()))
                pieces.append(event("response.reasoning_text.delta", item_id=item.id, output_index=index,
                                    content_index=0, delta=part.text))
            pieces.append(event("response.reasoning_text.done", item_id=item.id, output_index=index, content_index=0,
                                text=part.text))
        elif isinstance(item, ResponseFunctionToolCall):
            pending = item.model_copy(update={"arguments": "", "status": "in_progress"})
            pieces.append(event("response.output_item.added", output_index=index, item=pending.model_dump()))
            pieces.append(event("response.function_call_arguments.delta", item_id=item.id, output_index=index,
                                delta=item.arguments))
            pieces.append(event("response.function_call_arguments.done", item_id=item.id, output_index=index,
                                name=item.name, arguments=item.arguments))
        else:
            part = item.content[0]
            if not announced:
                pending = item.model_copy(update={"content": [], "status": "in_progress"})
                pieces.append(event("response.output_item.added", output_index=index, item=pending.model_dump()))
                pieces.append(event("response.content_part.added", item_id=item.id, output_index=index,
                                    content_index=0, part=ResponseOutputText(text="").model_dump()))
                pieces.append(event("response.output_text.delta", item_id=item.id, output_index=index,
                                    content_index=0, delta=part.text, logprobs=[]))
            pieces.append(event("response.output_text.done", item_id=item.id, output_index=index, content_index=0,
                                text=part.text, logprobs=[]))
            pieces.append(event("response.content_part.done", item_id=item.id, output_index=index, content_index=0,
                                part=part.model_dump()))
        pieces.append(event("response.output_item.done", output_index=index, item=item.model_dump()))
        return pieces


class EventCounter:
    """Writes one stream's server-sent events, numbering them (``sequence_number`` from 0)."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def __call__(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False)}\n\n"


def _is_mcp(tool: Any) -> bool:
    return isinstance(tool, dict) and tool.get("type") == "mcp"


def _as_messages(items: list) -> list[dict[str, Any]]:
    """Output items as the chat messages a later turn sees: the text as an assistant message, the
    calls as that message's ``tool_calls`` (ids = the items' ``call_id``)."""
    text = "".join(part.text for item in items if isinstance(item, ResponseOutputMessage) for part in item.content)
    calls = [{"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
             for item in items if isinstance(item, ResponseFunctionToolCall)]
    message: dict[str, Any] = {"role": "assistant", "content": text if text or not calls else None}
    if calls:
        message["tool_calls"] = calls
    return [message]
