"""A small MCP server for vLLM's ``tool_calling/openai_responses_client_with_mcp_tools.py``: the
stand-in for ``vllm serve ... --tool-server demo`` (whose demo tools are gpt-oss's python and
browser). Built with the ``mcp`` SDK's ``FastMCP``; it offers

- ``python(code)``: runs ``code`` in a fresh ``python -I`` subprocess on THIS machine (10 s
  limit) and returns its stdout and stderr. A demo: bind it to localhost only.
- ``search(query)``, ``open(id)``, ``find(pattern)``: a canned browser over three fixed pages
  (no network).

Usage (from the repository root)::

    python tools/vllm_examples/demo_mcp_server.py --port 8888           # streamable HTTP at /mcp
    python tools/vllm_examples/demo_mcp_server.py --port 8888 --transport sse   # SSE at /sse

``server_url: "http://localhost:8888"`` reaches either (pagedllm tries ``/mcp`` then ``/sse``).
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from mcp.server.fastmcp import FastMCP

PAGES = {
    "1": ("Python programming tutorials", "The official Python tutorial starts with an informal introduction."),
    "2": ("Machine learning", "Machine learning studies algorithms that improve through experience."),
    "3": ("Model Context Protocol", "MCP is an open protocol connecting models to tools and data."),
}


def build_server(host: str = "127.0.0.1", port: int = 8888) -> FastMCP:
    """The demo ``FastMCP`` server (not started) listening on ``host:port``."""
    server = FastMCP("demo", host=host, port=port)

    @server.tool()
    def python(code: str) -> str:
        """Run Python code and return what it printed (stdout, then stderr)."""
        done = subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, timeout=10)
        return done.stdout + done.stderr

    @server.tool()
    def search(query: str) -> str:
        """Search the web; returns result ids and titles."""
        words = query.lower().split()
        hits = [f"[{k}] {title}" for k, (title, _) in PAGES.items() if any(w in title.lower() for w in words)]
        return "\n".join(hits) or "no results"

    @server.tool()
    def open(id: str) -> str:   # noqa: A001 - the browser tool's name
        """Open a search result by its id; returns the page text."""
        title, text = PAGES.get(id, ("not found", ""))
        return f"{title}\n{text}"

    @server.tool()
    def find(pattern: str) -> str:
        """Find a pattern in the pages; returns the ids of the pages holding it."""
        return ", ".join(k for k, (t, x) in PAGES.items() if pattern.lower() in (t + x).lower()) or "not found"

    return server


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8888)
    parser.add_argument("--transport", choices=["streamable-http", "sse"], default="streamable-http")
    args = parser.parse_args()
    build_server(args.host, args.port).run(transport=args.transport)


if __name__ == "__main__":
    main()
