"""vLLM's ``serve_http`` (``vllm.entrypoints.launchers.launcher``): run a FastAPI app under uvicorn
until SIGINT / SIGTERM, then hand back the engine's shutdown to await."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from typing import Any, Awaitable

logger = logging.getLogger(__name__)


def _make_server(config):
    """A ``uvicorn.Server`` that installs no signal handlers (``serve_http`` owns SIGINT / SIGTERM)."""
    import uvicorn

    class _NoSignalServer(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self):
            yield

    return _NoSignalServer(config)


async def serve_http(app, sock: socket.socket | None = None, enable_ssl_refresh: bool = False,
                     **uvicorn_kwargs: Any) -> Awaitable[None]:
    """Serve ``app`` with uvicorn until SIGINT / SIGTERM (or until uvicorn stops by itself).

    On the signal uvicorn stops accepting connections and lets the open ones finish (graceful
    shutdown), then this returns. What it returns is the shutdown still to do, to be awaited: the
    engine of ``app.state.engine_client`` (when set) is shut down in a thread, failing requests
    still queued in it.

    Args:
        app: the FastAPI app; ``app.state.server`` is set to the uvicorn server.
        sock: a bound socket to serve on (None: uvicorn binds ``host`` / ``port``).
        enable_ssl_refresh: vLLM's reload of changed certificate files; only False.
        **uvicorn_kwargs: ``uvicorn.Config`` arguments (``host``, ``port``, ``log_level``,
            ``timeout_keep_alive``, ``ssl_keyfile``, ``ssl_certfile``, ``ssl_ca_certs``,
            ``ssl_cert_reqs``, ...).
    Returns:
        An awaitable that shuts the engine down.
    Raises:
        ValueError: ``enable_ssl_refresh``.
        SystemExit: uvicorn could not start (e.g. the port is taken; uvicorn logs why).
    """
    import uvicorn

    if enable_ssl_refresh:
        raise ValueError("enable_ssl_refresh is not supported by pagedllm (restart the server after "
                         "replacing the certificate files)")
    for route in app.routes:
        methods = getattr(route, "methods", None)
        if methods:
            logger.info("Route: %s, Methods: %s", route.path, ", ".join(sorted(methods)))
    server = _make_server(uvicorn.Config(app, **uvicorn_kwargs))
    app.state.server = server
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    serving = loop.create_task(server.serve(sockets=[sock] if sock is not None else None))
    stopping = loop.create_task(stop.wait())
    try:
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        if not serving.done():
            logger.info("shutting down the HTTP server")
            server.should_exit = True
        await serving   # re-raises what stopped uvicorn (SystemExit on a failed start)
    finally:
        stopping.cancel()
        for sig in signals:
            loop.remove_signal_handler(sig)
    return _shutdown_engine(getattr(app.state, "engine_client", None))


async def _shutdown_engine(engine) -> None:
    """``engine.shutdown()`` in a thread (it joins the engine thread), when there is an engine."""
    if engine is not None:
        await asyncio.get_running_loop().run_in_executor(None, engine.shutdown)
        logger.info("engine stopped")
