"""vLLM's ``with_cancellation`` (``vllm.entrypoints.serve.utils.api_utils``): a route handler that
stops when its client disconnects."""

from __future__ import annotations

import functools

from pagedllm.entrypoints.openai.serving_engine import run_until_disconnect


def with_cancellation(handler_func):
    """Decorate an ``async`` route handler so that a client disconnect cancels it
    (``serving_engine.run_until_disconnect``): the ``asyncio.CancelledError`` lands where the
    handler awaits, so leaving an ``AsyncLLM.generate`` loop aborts its request and frees its
    blocks; the disconnected client gets a 499 it never reads.

    The request is the handler's second positional argument or its ``raw_request`` keyword, and
    its body must already be read (the wrapper consumes the request's further ASGI messages,
    looking for ``http.disconnect``). A handler that returns a ``StreamingResponse`` returns at once;
    Starlette then cancels the stream's body iterator on a disconnect.
    """
    @functools.wraps(handler_func)
    async def wrapper(*args, **kwargs):
        request = args[1] if len(args) > 1 else kwargs["raw_request"]
        return await run_until_disconnect(handler_func(*args, **kwargs), request)

    return wrapper
