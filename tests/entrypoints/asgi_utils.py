"""Drive the server's app in this process with the real clients (no server, no port)."""

import asyncio

import httpx
import openai

from pagedllm.entrypoints.openai.api_server import build_app


def run_with_clients(state, fn, timeout: float = 300):
    """``await fn(client, http)`` with an ``openai.AsyncOpenAI`` client and an ``httpx.AsyncClient``
    wired to the app of ``state``; returns its result. ``timeout`` in seconds per request."""
    async def main():
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=timeout) as http:
            client = openai.AsyncOpenAI(base_url="http://test/v1", api_key="none", http_client=http, max_retries=0)
            return await fn(client, http)
    return asyncio.run(main())
