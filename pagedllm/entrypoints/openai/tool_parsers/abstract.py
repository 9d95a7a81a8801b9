"""``ToolParser``: turns a model's free-text reply into OpenAI ``tool_calls`` (``tool_choice: "auto"``).

vLLM's design (``vllm/entrypoints/openai/tool_parsers``): the model writes calls in its own
format, a parser named by ``--tool-call-parser`` finds them. A parser is stateless; streaming
keeps its state in a ``ToolCallStream`` per choice.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


def make_tool_call(name: str, arguments: Any) -> dict[str, Any]:
    """One OpenAI tool call: ``{"id", "type": "function", "function": {"name", "arguments"}}``
    with ``arguments`` a JSON string (a string given is kept as is)."""
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


@dataclass
class ExtractedToolCalls:
    """What a parser found in a whole reply.

    Attributes:
        tools_called: True when at least one call was found.
        tool_calls: the calls (``make_tool_call``'s shape), in order.
        content: the text outside the calls that the reply keeps as ``message.content``, or None.
    """

    tools_called: bool
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    content: str | None = None


class ToolParser:
    """Base class of the ``--tool-call-parser`` parsers."""

    name = ""

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """The calls in a finished reply (no call: ``tools_called`` False and ``content`` = the
        text)."""
        raise NotImplementedError

    def stream_progress(self, text: str) -> tuple[int, list[dict[str, Any]]]:
        """For a reply still being generated (``text`` = everything so far): how many leading
        characters are content for sure (they can be streamed), and the calls already complete.

        The calls must be a prefix of what ``extract_tool_calls`` returns for any continuation.
        """
        raise NotImplementedError


class ToolCallStream:
    """One streamed choice under ``tool_choice: "auto"``: feeds the text deltas to a parser and
    yields what can be sent: content deltas, and each call whole once it is complete, with its
    ``index`` (the OpenAI client accumulates ``delta.tool_calls`` by index).

    Args:
        parser: the server's parser.
    """

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.num_content_sent = 0  # characters of ``text`` sent as content
        self.calls_sent: list[dict[str, Any]] = []

    @property
    def tools_called(self) -> bool:
        return bool(self.calls_sent)

    def _indexed(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        start = len(self.calls_sent)
        self.calls_sent.extend(calls)
        return [{"index": start + k, **call} for k, call in enumerate(calls)]

    def feed(self, delta: str) -> tuple[str, list[dict[str, Any]]]:
        """Add a text delta; returns (content to send, tool-call deltas to send)."""
        self.text += delta
        safe, calls = self.parser.stream_progress(self.text)
        content = ""
        if not self.calls_sent and safe > self.num_content_sent:
            content = self.text[self.num_content_sent:safe]
            self.num_content_sent = safe
        return content, self._indexed(calls[len(self.calls_sent):])

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The reply has ended: the rest, by the whole-text parse."""
        result = self.parser.extract_tool_calls(self.text)
        # The rest of the whole parse's content (a parser may strip it or drop the calls from
        # it; what was sent is always its prefix, else the rest of the text).
        sent = self.text[:self.num_content_sent]
        final = result.content or ""
        if final.startswith(sent):
            rest = final[len(sent):]
        else:
            rest = "" if result.tools_called else self.text[self.num_content_sent:]
        if self.calls_sent:
            rest = ""  # no content after a call
        self.num_content_sent = len(self.text)
        if not result.tools_called:
            return rest, []
        return rest, self._indexed(result.tool_calls[len(self.calls_sent):])
