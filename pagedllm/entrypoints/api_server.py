"""vLLM's demo server (``vllm.entrypoints.api_server``, the server of its
``examples/applications/api_server``): ``POST /generate`` over an ``AsyncLLM``, for demos and
simple benchmarks; ``pagedllm serve`` is the OpenAI-compatible server.

Routes: ``GET /health``; ``GET /metrics`` (Prometheus, as ``pagedllm serve``'s, one engine);
``POST /generate`` with a JSON body ``{"prompt": str, "stream": bool, <SamplingParams fields>}``.
The answer is ``{"text": [prompt + completion, one per sample]}``; with ``"stream": true`` one such
JSON object per line, each with the texts so far. A bad body is a 400 ``{"error": message}``. A
client that disconnects aborts its request (blocks freed), streaming or not.

Run: ``python -m pagedllm.entrypoints.api_server --model MODEL [--host H] [--port P] [engine flags]``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger(__name__)


def _bad_request(message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=400)


def _texts(output) -> list[str]:
    """``prompt + completion`` per sample of a ``RequestOutput`` (a token-id prompt has no text:
    the completion alone)."""
    return [(output.prompt or "") + sample.text for sample in output.outputs]


def build_app(engine, registry=None, root_path: str | None = None) -> FastAPI:
    """The demo app over ``engine`` (an ``AsyncLLM``; ``app.state.engine_client``).

    Args:
        registry: the Prometheus registry ``/metrics`` reads (None: no ``/metrics`` route).
        root_path: FastAPI's ``root_path`` (behind a path-based proxy).
    """
    from pagedllm.entrypoints.serve.utils.api_utils import with_cancellation
    from pagedllm.sampling_params import SamplingParams
    from pagedllm.utils import random_uuid

    app = FastAPI(root_path=root_path or "")
    app.state.engine_client = engine

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    if registry is not None:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        try:
            body = await request.json()
        except ValueError as e:
            return _bad_request(f"the body is not JSON: {e}")
        if not isinstance(body, dict) or not isinstance(body.get("prompt"), str):
            return _bad_request("the body must be a JSON object with a string 'prompt'")
        return await _generate(body, raw_request=request)

    @with_cancellation
    async def _generate(body: dict[str, Any], raw_request: Request) -> Response:
        body = dict(body)
        prompt, stream = body.pop("prompt"), bool(body.pop("stream", False))
        try:
            params = SamplingParams(**body)
        except TypeError as e:   # an unknown field
            return _bad_request(f"bad sampling parameters: {e}")
        except ValueError as e:
            return _bad_request(str(e))
        outputs = engine.generate(prompt, params, random_uuid())
        try:
            first = await outputs.__anext__()   # a bad prompt (too long, ...) fails here: 400
        except ValueError as e:
            return _bad_request(str(e))
        except StopAsyncIteration:
            return _bad_request("the request produced no output")

        async def rest() -> AsyncIterator:
            yield first
            async for out in outputs:
                yield out

        if stream:
            async def lines() -> AsyncIterator[bytes]:
                async for out in rest():
                    yield (json.dumps({"text": _texts(out)}) + "\n").encode("utf-8")

            return StreamingResponse(lines(), media_type="application/x-ndjson")
        final = first
        async for out in outputs:
            final = out
        return JSONResponse({"text": _texts(final)})

    return app


def make_arg_parser():
    """The server's flags (vLLM's demo server's: ``--host``, ``--port``, ``--root-path``,
    ``--log-level``, SSL files) and every engine flag (``AsyncEngineArgs.add_cli_args``)."""
    from pagedllm.engine.arg_utils import AsyncEngineArgs
    from pagedllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="python -m pagedllm.entrypoints.api_server",
                                    description="pagedllm's demo /generate server (vLLM's api_server)")
    parser.add_argument("--host", default=None, help="address to bind (default: every interface)")
    parser.add_argument("--port", type=parser.check_port, default=8000)
    parser.add_argument("--root-path", default=None, help="FastAPI root_path behind a path-based proxy")
    parser.add_argument("--ssl-keyfile", default=None)
    parser.add_argument("--ssl-certfile", default=None)
    parser.add_argument("--ssl-ca-certs", default=None, help="the CA certificates file")
    parser.add_argument("--log-level", default="info", help="uvicorn's and pagedllm's log level")
    parser.add_argument("--disable-uvicorn-access-log", action="store_true")
    AsyncEngineArgs.add_cli_args(parser)
    return parser


async def run_server(args: argparse.Namespace, llm_engine=None, **uvicorn_kwargs: Any) -> None:
    """Build the engine (unless ``llm_engine`` is given), serve until SIGINT / SIGTERM
    (``launchers.launcher.serve_http``), then shut the engine down.

    Raises:
        ValueError: bad engine flags.
    """
    from prometheus_client import CollectorRegistry

    from pagedllm import envs
    from pagedllm.engine.arg_utils import AsyncEngineArgs
    from pagedllm.engine.async_engine import AsyncLLM
    from pagedllm.entrypoints.launchers.launcher import serve_http
    from pagedllm.metrics.prometheus import PrometheusStatLogger
    from pagedllm.usage.usage_lib import UsageContext
    from pagedllm.utils.system_utils import set_ulimit

    set_ulimit()
    engine = llm_engine
    if engine is None:
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs.from_cli_args(args), usage_context=UsageContext.API_SERVER)
    registry = None
    if isinstance(engine, AsyncLLM):   # one in-process engine (a data-parallel front end has no /metrics here)
        registry = CollectorRegistry()
        PrometheusStatLogger.attach(engine.engine, args.model or "default", registry)
    app = build_app(engine, registry, args.root_path)
    shutdown = await serve_http(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                                timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
                                access_log=not args.disable_uvicorn_access_log, ssl_keyfile=args.ssl_keyfile,
                                ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs, **uvicorn_kwargs)
    await shutdown


def main(argv: list[str] | None = None) -> int:
    ns = make_arg_parser().parse_args(argv)
    logging.basicConfig(level=getattr(logging, ns.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        asyncio.run(run_server(ns))
    except ValueError as e:
        print(f"pagedllm: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    from pagedllm.utils.process_exit import exit_process

    exit_process(main())   # no interpreter finalization at the end of a server process
