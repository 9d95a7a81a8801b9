"""Talk to one remote MCP server with the official ``mcp`` SDK (``pip install 'pagedllm[mcp]'``):
list its tools, call one.

Each operation opens its own session (connect, ``initialize``, the request, close) under one
deadline, so nothing outlives the HTTP request that needed it. The transport follows the URL:
a path ending in ``/sse`` is the SDK's SSE client; a bare ``http://host:port`` (no path) tries
streamable HTTP at ``/mcp`` then SSE at ``/sse`` (``FastMCP``'s default paths); any other path
tries streamable HTTP then SSE at that URL. A transport is abandoned only when connecting or
``initialize`` fails, so a tool is never called twice. ``streamablehttp_client`` is used (mcp
1.10 has no other; 1.2x marks it deprecated in favour of ``streamable_http_client``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

MCP_EXTRA_HINT = "pip install 'pagedllm[mcp]'"


class McpUnavailableError(RuntimeError):
    """The ``mcp`` SDK is not installed (the ``mcp`` extra)."""


class McpConnectionError(RuntimeError):
    """No transport reached the server, or it did not answer within the deadline."""


@dataclass(frozen=True)
class McpServer:
    """Where one MCP server is and how to reach it.

    Args:
        server_label: the request's label for the server (named in items and errors).
        server_url: its http(s) URL.
        headers: HTTP headers sent with every request (e.g. ``Authorization``).
        timeout_s: seconds one operation (connect, initialize, list or call) may take in all.
    Raises:
        ValueError: for a URL that is not http(s) or a timeout <= 0.
    """

    server_label: str
    server_url: str
    headers: dict[str, str] = field(default_factory=dict)
    timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if urlsplit(self.server_url).scheme not in ("http", "https"):
            raise ValueError(f"server_url must be an http(s) URL, got {self.server_url!r}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 seconds, got {self.timeout_s}")


def require_sdk() -> None:
    """Raises:
        McpUnavailableError: naming the extra when the ``mcp`` package is missing."""
    try:
        import mcp  # noqa: F401
    except ImportError:
        raise McpUnavailableError(f"MCP tools need the mcp package: {MCP_EXTRA_HINT}") from None


def transport_urls(server_url: str) -> list[tuple[str, str]]:
    """The (transport, URL) pairs tried in order for ``server_url``: ``"streamable_http"`` or
    ``"sse"`` (see the module docstring)."""
    url = server_url.rstrip("/")
    path = urlsplit(url).path
    if path.endswith("/sse"):
        return [("sse", url)]
    if not path:
        return [("streamable_http", url + "/mcp"), ("sse", url + "/sse")]
    return [("streamable_http", url), ("sse", url)]


def _leaf_messages(e: BaseException) -> list[str]:
    """The messages of ``e``'s innermost exceptions (task groups wrap them in groups)."""
    if isinstance(e, BaseExceptionGroup):
        return [m for sub in e.exceptions for m in _leaf_messages(sub)]
    return [f"{type(e).__name__}: {e}" if str(e) else type(e).__name__]


async def _with_session(server: McpServer, fn: Callable[[Any], Awaitable[Any]]) -> Any:
    """``await fn(session)`` on an initialized ``mcp.ClientSession``, trying each transport.

    Raises:
        McpConnectionError: when no transport connects and initializes within ``timeout_s``.
        Exception: what ``fn`` raised once a session was up.
    """
    import anyio
    from mcp import ClientSession
    from mcp.client.sse import sse_client
    from mcp.client.streamable_http import streamablehttp_client

    failures = []
    for kind, url in transport_urls(server.server_url):
        initialized = False
        try:
            with anyio.fail_after(server.timeout_s):
                if kind == "sse":
                    transport = sse_client(url, headers=server.headers, timeout=server.timeout_s)
                else:
                    transport = streamablehttp_client(url, headers=server.headers, timeout=server.timeout_s)
                async with transport as streams, ClientSession(streams[0], streams[1]) as session:
                    await session.initialize()
                    initialized = True
                    return await fn(session)
        except Exception as e:   # TimeoutError, httpx errors, task-group exception groups
            if initialized:
                raise
            failures.append(f"{kind} {url}: {'; '.join(_leaf_messages(e))}")
            logger.debug("MCP server %s: %s", server.server_label, failures[-1])
    raise McpConnectionError("; ".join(failures))


async def list_tools(server: McpServer) -> list[Any]:
    """The server's tools (``mcp.types.Tool``: ``name``, ``description``, ``inputSchema``,
    ``annotations``), all pages.

    Raises:
        McpUnavailableError: without the SDK.
        McpConnectionError: when the server cannot be reached within ``timeout_s`` seconds.
    """
    require_sdk()

    async def fn(session):
        tools, cursor = [], None
        while True:
            page = await session.list_tools(cursor=cursor) if cursor else await session.list_tools()
            tools += page.tools
            cursor = page.nextCursor
            if not cursor:
                return tools
    return await _with_session(server, fn)


async def call_tool(server: McpServer, name: str, arguments: dict[str, Any]) -> Any:
    """Call tool ``name`` with ``arguments``; the ``mcp.types.CallToolResult`` (``isError`` true
    when the tool itself failed).

    Raises:
        McpUnavailableError: without the SDK.
        McpConnectionError: when the server cannot be reached within ``timeout_s`` seconds.
        Exception: the SDK's ``McpError`` for a protocol error the server answered.
    """
    require_sdk()
    return await _with_session(server, lambda session: session.call_tool(name, arguments))
