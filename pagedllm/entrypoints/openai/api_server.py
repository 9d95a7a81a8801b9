"""The OpenAI-compatible HTTP server (FastAPI + uvicorn).

Run it as ``pagedllm serve [MODEL] [flags]`` or, as vLLM users know it,
``python -m pagedllm.entrypoints.openai.api_server --model MODEL --port 8000``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health``, ``GET /version``, ``POST /tokenize``, ``POST /detokenize``, ``GET /metrics``
(Prometheus). Every error is answered with OpenAI's body
``{"error": {"message", "type", "param", "code"}}``: 400 for bad input (including malformed JSON),
401 for a missing or wrong API key on ``/v1`` routes, 404 for an unknown model or route, 500 when
an engine step fails, 503 when the engine is shutting down.

One ``AsyncLLM`` (one engine thread) serves every connection; requests from all clients join the
running batch at the next iteration. On SIGINT/SIGTERM uvicorn stops accepting connections and
gives in-flight requests ``--shutdown-timeout`` seconds to finish; whatever is left is cancelled,
then the engine aborts its remaining requests (their streams get an error event) and the process
exits with status 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import secrets
import signal
import sys
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.engine.arg_utils import EngineArgs, add_engine_cli_args, engine_args_from_cli
from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.entrypoints.chat_utils import GEMMA_CHAT_TEMPLATE_PATH, load_chat_template
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS, get_tool_parser
from pagedllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                  TokenizeRequest, VersionResponse)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.errors import OpenAIError, error_from_exception
from pagedllm.entrypoints.openai.serving_engine import DEFAULT_MAX_N, run_until_disconnect
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagedllm.metrics.loggers import DEFAULT_LOG_INTERVAL_S, LoggingStatLogger
from pagedllm.metrics.prometheus import PrometheusStatLogger
from pagedllm.version import __version__

logger = logging.getLogger(__name__)

API_KEY_ENV = "PAGEDLLM_API_KEY"


@dataclass
class ServerState:
    """Everything the routes need.

    Attributes:
        engine: the shared async engine.
        models: served names.
        completion, chat, tokenization: endpoint handlers.
        registry: the Prometheus registry behind ``/metrics``.
        api_key: required as ``Authorization: Bearer <key>`` on ``/v1`` routes when set.
    """

    engine: AsyncLLM
    models: OpenAIServingModels
    completion: OpenAIServingCompletion
    chat: OpenAIServingChat
    tokenization: OpenAIServingTokenization
    registry: CollectorRegistry
    api_key: str | None = None


def default_served_model_name(args: EngineArgs, model_files) -> str:
    """The model as given (vLLM's default); for the default model, its GGUF file's stem."""
    if args.model in (None, "default"):
        return Path(model_files.gguf_path or model_files.folder).stem
    return args.model


def build_state(engine_args: EngineArgs, served_model_names: list[str] | None = None,
                chat_template: str | None = None, api_key: str | None = None, log_requests: bool = True,
                log_stats_interval_s: float | None = DEFAULT_LOG_INTERVAL_S, max_n: int = DEFAULT_MAX_N,
                enable_prompt_tokens_details: bool = False, enable_auto_tool_choice: bool = False,
                tool_call_parser: str | None = None, engine_process: bool = False) -> ServerState:
    """Load the model and wire the handlers.

    Args:
        engine_args: engine settings.
        served_model_names: names for ``model`` (default: see :func:`default_served_model_name`).
        chat_template: template text (already loaded with ``load_chat_template``), or None.
        api_key: see ``ServerState``.
        log_requests: log each request at INFO.
        log_stats_interval_s: seconds between periodic stats lines; None disables them.
        max_n: the most samples (``n``, ``best_of``) one request may ask for.
        enable_prompt_tokens_details: send ``usage.prompt_tokens_details.cached_tokens``.
        enable_auto_tool_choice: accept ``tool_choice: "auto"`` (calls found by ``tool_call_parser``).
        tool_call_parser: a ``tool_parsers.TOOL_PARSERS`` name ("hermes", "pythonic").
        engine_process: run the engine in its own process even with one replica (vLLM V1's
            ``EngineCoreProc``; ``pagedllm serve``'s default): the server's Python (HTTP, JSON,
            streaming) then never holds the GIL the engine loop needs between its ops. False: the
            engine loop runs in a thread of this process (``AsyncLLM``).
    Raises:
        ValueError: bad engine arguments, an unparsable chat template, ``max_n < 1``, an unknown
            tool-call parser, or ``enable_auto_tool_choice`` without one.
    """
    from pagedllm.engine.llm_engine import LLMEngine

    if not isinstance(max_n, int) or max_n < 1:
        raise ValueError(f"max_n must be an int >= 1, got {max_n!r}")
    tool_parser = None
    if enable_auto_tool_choice:
        if tool_call_parser is None:
            raise ValueError(f"--enable-auto-tool-choice requires --tool-call-parser (one of {sorted(TOOL_PARSERS)})")
        tool_parser = get_tool_parser(tool_call_parser)
    elif tool_call_parser is not None:
        get_tool_parser(tool_call_parser)  # a bad name is still an error
        logger.warning("--tool-call-parser %s has no effect without --enable-auto-tool-choice", tool_call_parser)
    if chat_template is not None:
        import jinja2
        try:
            jinja2.Environment().parse(chat_template)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"the chat template does not parse: {e}") from e
    registry = CollectorRegistry()
    if engine_args.data_parallel_size > 1 or engine_process:
        # D replica processes behind this server (engine/dp_client.py); metrics carry engine="i".
        from pagedllm.engine.dp_client import DPAsyncLLM, DPEngineClient

        engine = DPEngineClient(engine_args)
        names = list(served_model_names or [default_served_model_name(engine_args, engine.model_files)])
        loggers = PrometheusStatLogger.for_engines(names[0], engine.max_model_len,
                                                   engine.scheduler_config.max_num_batched_tokens, registry,
                                                   initial=engine.initial_stats)
        for stat_loggers, prometheus in zip(engine.stat_loggers, loggers):
            stat_loggers.append(prometheus)
            if log_stats_interval_s:   # one periodic line per engine, as the in-process engine logs
                stat_loggers.append(LoggingStatLogger(log_stats_interval_s, log_on_record=True))
        async_engine = DPAsyncLLM(engine)
    else:
        engine = LLMEngine(engine_args)
        names = list(served_model_names or [default_served_model_name(engine_args, engine.model_files)])
        prometheus = PrometheusStatLogger(names[0], engine.max_model_len,
                                          engine.scheduler_config.max_num_batched_tokens, registry,
                                          initial=engine.scheduler.make_stats())
        async_engine = AsyncLLM(engine, stat_loggers=[prometheus], log_stats_interval_s=log_stats_interval_s)
    root = engine_args.model if engine_args.model not in (None, "default") else \
        (engine.model_files.gguf_path or engine.model_files.folder)
    models = OpenAIServingModels(names, root, engine.max_model_len)
    chat = OpenAIServingChat(async_engine, models, chat_template, engine_args.max_logprobs, log_requests, max_n,
                             tool_parser)
    if chat_template is None and engine.tokenizer.chat_template is None:
        logger.warning("the model has no chat template: /v1/chat/completions will answer 400; start with "
                       "--chat-template (e.g. %s for Gemma models)", GEMMA_CHAT_TEMPLATE_PATH)
    completion = OpenAIServingCompletion(async_engine, models, log_requests, max_n)
    completion.enable_prompt_tokens_details = chat.enable_prompt_tokens_details = enable_prompt_tokens_details
    return ServerState(engine=async_engine, models=models, completion=completion, chat=chat,
                       tokenization=OpenAIServingTokenization(chat), registry=registry, api_key=api_key)


class APIKeyMiddleware:
    """Pure ASGI middleware: ``/v1`` routes need ``Authorization: Bearer <api_key>`` (401 otherwise).

    (A pure ASGI middleware, unlike ``BaseHTTPMiddleware``, leaves streaming and disconnect
    detection untouched.)
    """

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or not scope["path"].startswith("/v1"):
            await self.app(scope, receive, send)
            return
        given = Headers(scope=scope).get("authorization", "").encode()
        if not secrets.compare_digest(given, self.expected):
            message = ("Missing API key: send 'Authorization: Bearer <key>'" if not given
                       else "Incorrect API key provided")
            response = OpenAIError(401, message, "invalid_request_error", code="invalid_api_key").to_response()
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    parts, param = [], None
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error") or err.get("msg")
            return OpenAIError(400, f"Malformed JSON body: {detail}", "invalid_request_error")
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if param is None and loc:
            param = loc[0]
        text = f"{'.'.join(loc)}: {err.get('msg')}" if loc else str(err.get("msg"))
        if text not in parts:
            parts.append(text)
    message = "; ".join(parts[:6]) or "invalid request body"
    return OpenAIError(400, message, "invalid_request_error", param=param)


def build_app(state: ServerState) -> FastAPI:
    """The FastAPI app over ``state`` (the engine thread starts with the app's lifespan)."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start()
        yield
        await asyncio.get_running_loop().run_in_executor(None, state.engine.shutdown)

    app = FastAPI(title="pagedllm OpenAI-compatible server", version=__version__, lifespan=lifespan)
    app.state.server = state
    if state.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=state.api_key)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_request: Request, exc: OpenAIError):
        return exc.to_response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError):
        return _validation_error(exc).to_response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return OpenAIError(exc.status_code, str(exc.detail), kind).to_response()

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception):
        logger.exception("unhandled error")
        return error_from_exception(exc).to_response()

    @app.get("/health")
    async def health() -> Response:
        try:
            state.engine.check_health()
        except Exception as e:
            return error_from_exception(e).to_response()
        if hasattr(state.engine, "health"):   # data parallelism: {"status": "ok" | "degraded", "engines": {...}}
            return JSONResponse(state.engine.health())
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def show_models():
        return JSONResponse(state.models.show_available_models().model_dump())

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request):
        return await run_until_disconnect(state.completion.create_completion(request, raw_request), raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request):
        return await run_until_disconnect(state.chat.create_chat_completion(request, raw_request), raw_request)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        # vLLM's semantics: clears only while no request holds KV blocks; 409 otherwise.
        if await state.engine.reset_prefix_cache():
            return Response(status_code=200)
        return OpenAIError(409, "cannot reset the prefix cache while requests hold KV blocks; retry when idle",
                           "invalid_request_error").to_response()

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest):
        return JSONResponse(state.tokenization.tokenize(request).model_dump(exclude_none=True))

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest):
        return JSONResponse(state.tokenization.detokenize(request).model_dump())

    return app


def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the server's flags (vLLM's names) and every engine flag to ``parser``."""
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help="HF folder or .gguf file (same as --model; default: the default model)")
    add_engine_cli_args(parser)
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="0.0.0.0", help="address to listen on (default: all interfaces)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use as 'model' (default: the model as given; for the default model, "
                        "its file name)")
    g.add_argument("--chat-template", default=None,
                   help=f"Jinja chat template: a file, the template text, or 'gemma' ({GEMMA_CHAT_TEMPLATE_PATH.name}, "
                        "shipped for the default base model, which has none; 'gemma-tools' adds the request's tools "
                        "and tool turns, for --tool-call-parser hermes)")
    g.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer KEY' on /v1 routes "
                                                   f"(default: ${API_KEY_ENV})")
    g.add_argument("--disable-log-requests", action="store_true", help="do not log each request")
    g.add_argument("--max-n", type=int, default=DEFAULT_MAX_N,
                   help=f"most samples one request may ask for with n or best_of (default: {DEFAULT_MAX_N}, "
                        "OpenAI's limit); more is a 400")
    g.add_argument("--log-stats-interval", type=float, default=DEFAULT_LOG_INTERVAL_S,
                   help="seconds between stats log lines (--disable-log-stats turns them off)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGINT/SIGTERM")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    g.add_argument("--disable-uvicorn-access-log", action="store_true")
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="add usage.prompt_tokens_details.cached_tokens (prompt tokens found in the prefix cache)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accept tool_choice 'auto': the model writes calls in its own format, found by "
                        "--tool-call-parser")
    g.add_argument("--engine-in-process", action="store_true",
                   help="run the engine loop in a thread of the server process instead of its own process "
                        "(one process less; each token then waits for the server's Python: on 2 cores "
                        "about 20%% slower for one client, docs/benchmarks.md)")
    g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="how calls are found in a reply under tool_choice 'auto': hermes (JSON in <tool_call> "
                        "tags; the bundled 'gemma-tools' template asks for it) or pythonic ([f(a=1), g()])")
    return parser


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(0)


# After ``--shutdown-timeout`` the requests still running are failed (an error response, or an
# error event and ``[DONE]`` on a stream); uvicorn then waits this many more seconds for those
# responses to be written before it cancels what is left.
SHUTDOWN_FLUSH_S = 5.0


def _make_server(config, engine, shutdown_timeout_s: float):
    """A ``uvicorn.Server`` whose graceful shutdown fails the engine's requests still running
    ``shutdown_timeout_s`` seconds after it began, so that each gets a clean error instead of a
    dropped connection (uvicorn alone cancels the handlers' tasks at its timeout).

    Args:
        config: the ``uvicorn.Config`` (its ``timeout_graceful_shutdown`` should be
            ``shutdown_timeout_s + SHUTDOWN_FLUSH_S``).
        engine: the server's engine front end (``shutdown()`` fails its running requests with
            ``EngineDeadError``, HTTP 503; idempotent).
        shutdown_timeout_s: seconds in-flight requests get to finish (``--shutdown-timeout``).
    """
    import threading

    import uvicorn

    class _Server(uvicorn.Server):
        # The thread that stops the engine at the timeout (None: not started); the caller joins
        # it before its own ``engine.shutdown()``, so the two never run at once.
        engine_stopper: threading.Thread | None = None

        async def shutdown(self, sockets=None) -> None:
            def stop_engine() -> None:
                self.engine_stopper = threading.Thread(target=engine.shutdown, name="engine-shutdown", daemon=True)
                self.engine_stopper.start()

            fail = asyncio.get_running_loop().call_later(shutdown_timeout_s, stop_engine)
            try:
                await super().shutdown(sockets)
            finally:
                fail.cancel()

    return _Server(config)


def run_server(ns: argparse.Namespace) -> int:
    """Load the model, serve until SIGINT/SIGTERM, shut down gracefully.

    Returns:
        0 after a graceful shutdown.
    Raises:
        ValueError: bad flags (the CLI prints them and exits with status 2).
    """
    import uvicorn

    chat_template = load_chat_template(ns.chat_template)
    args = engine_args_from_cli(ns, getattr(ns, "model_tag", None))
    api_key = ns.api_key or os.environ.get(API_KEY_ENV) or None
    # After uvicorn's graceful shutdown it re-raises the signal: exit with status 0, not -15.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    state = build_state(args, ns.served_model_name, chat_template, api_key,
                        log_requests=not ns.disable_log_requests,
                        log_stats_interval_s=None if ns.disable_log_stats else ns.log_stats_interval,
                        max_n=ns.max_n, enable_prompt_tokens_details=ns.enable_prompt_tokens_details,
                        enable_auto_tool_choice=ns.enable_auto_tool_choice, tool_call_parser=ns.tool_call_parser,
                        engine_process=not ns.engine_in_process)
    app = build_app(state)
    config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level,
                            access_log=not ns.disable_uvicorn_access_log,
                            timeout_graceful_shutdown=ns.shutdown_timeout + SHUTDOWN_FLUSH_S)
    server = _make_server(config, state.engine, ns.shutdown_timeout)
    logger.info("serving %s as %s on http://%s:%d (api key %s)", state.models.root, state.models.served_model_names,
                ns.host, ns.port, "required" if api_key else "off")
    try:
        asyncio.run(server.serve())
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        if server.engine_stopper is not None:
            server.engine_stopper.join()
        state.engine.shutdown()
    logger.info("server stopped")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pagedllm.entrypoints.openai.api_server",
                                     description="pagedllm's OpenAI-compatible server")
    parser.add_argument("--log-level", default="INFO")
    make_arg_parser(parser)
    ns = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, str(ns.log_level).upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    try:
        return run_server(ns)
    except ValueError as e:
        print(f"pagedllm: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
