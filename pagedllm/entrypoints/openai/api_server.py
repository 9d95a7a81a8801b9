"""The OpenAI-compatible HTTP server (FastAPI + uvicorn).

Run it as ``pagedllm serve [MODEL] [flags]`` or, as vLLM users know it,
``python -m pagedllm.entrypoints.openai.api_server --model MODEL --port 8000``.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``POST /v1/responses`` (with
``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``), ``GET /v1/models``,
``GET /health``, ``GET /version``, ``POST /tokenize``, ``POST /detokenize``, ``GET /metrics``
(Prometheus). Every error is answered with OpenAI's body
``{"error": {"message", "type", "param", "code"}}``: 400 for bad input (including malformed JSON,
and a request ``chat_template`` without ``--trust-request-chat-template``), 401 for a missing or
wrong API key (with ``--api-key``: every route but ``/health``, ``/version``, ``/metrics`` and the
API docs), 404 for an unknown model or route, 413 for a body over ``--max-request-body-bytes``,
500 when an engine step fails, 503 when the engine is shutting down.

No one client stalls the others: tokenizing and chat-template rendering run in a thread pool
(``ServerState.pool``), never on the event loop, so ``/health`` and every stream keep answering
while a long prompt is tokenized.

One ``AsyncLLM`` (one engine thread) serves every connection; requests from all clients join the
running batch at the next iteration. On SIGINT/SIGTERM uvicorn stops accepting connections and
gives in-flight requests ``--shutdown-timeout`` seconds to finish; whatever is left is cancelled,
then the engine aborts its remaining requests (their streams get an error event) and the process
exits with status 0.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import concurrent.futures
import logging
import secrets
import signal
import sys
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm import envs
from pagedllm.engine.arg_utils import EngineArgs, add_engine_cli_args, engine_args_from_cli
from pagedllm.metrics.request_tracing import RequestTracer
from pagedllm.engine.async_engine import AsyncLLM
from pagedllm.entrypoints.chat_utils import (GEMMA_CHAT_TEMPLATE_PATH, NoChatTemplateError, check_self_contained,
                                            load_chat_template, resolve_chat_template)
from pagedllm.entrypoints.openai.tool_parsers import TOOL_PARSERS, get_tool_parser
from pagedllm.reasoning import REASONING_PARSERS, get_reasoning_parser
from pagedllm.entrypoints.openai.protocol import (BatchChatCompletionRequest, ChatCompletionRequest,
                                                  CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                                  VersionResponse)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from pagedllm.entrypoints.openai.protocol_responses import ResponsesRequest
from pagedllm.entrypoints.openai.serving_responses import (DEFAULT_MAX_STORED_RESPONSES, OpenAIServingResponses,
                                                           ResponseStore)
from pagedllm.entrypoints.openai.errors import OpenAIError, bad_request, error_from_exception
from pagedllm.entrypoints.openai.serving_engine import DEFAULT_MAX_N, run_until_disconnect
from pagedllm.entrypoints.openai.serving_lora import parse_lora_modules
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from pagedllm.entrypoints.openai.serving_tokens import OpenAIServingTokens, add_token_routes
from pagedllm.metrics.loggers import DEFAULT_LOG_INTERVAL_S, LoggingStatLogger
from pagedllm.metrics.prometheus import PrometheusStatLogger
from pagedllm.version import __version__

logger = logging.getLogger(__name__)

API_KEY_ENV = envs.PAGEDLLM_API_KEY

# Routes open without the API key (those of vLLM's PUBLIC_ENDPOINTS this server has): the health
# probe, the version, metrics scraping, the API docs. With --api-key every other route needs it.
PUBLIC_PATHS = ("/health", "/version", "/metrics", "/docs", "/redoc", "/openapi.json")

# --max-request-body-bytes (bytes). A prompt of max_model_len tokens is far smaller: ~4 bytes of
# text per token (at worst ~12 with every character JSON-escaped as \uXXXX), or <= 8 per token as
# token ids, so 128k tokens are ~0.5-1.5 MB; 32 MiB leaves room for lists of prompts, long chat
# histories and million-token contexts, and still bounds what one body can make the server
# buffer, parse and tokenize (~30 s of tokenizer time).
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 << 20

# Threads of the pool that tokenizes and renders chat templates (ServerState.pool): a few, so a
# slow template render does not queue every other request's tokenizing behind it.
TOKENIZER_POOL_WORKERS = 4


@dataclass
class ServerState:
    """Everything the routes need.

    Attributes:
        engine: the shared async engine.
        models: served names.
        completion, chat, tokenization: endpoint handlers.
        responses: the ``/v1/responses`` handler (None: the route answers 404).
        registry: the Prometheus registry behind ``/metrics``.
        api_key: required as ``Authorization: Bearer <key>`` on every route but ``PUBLIC_PATHS``
            when set.
        pool: the thread pool where the handlers tokenize and render (shut down with the app).
        max_request_body_bytes: the largest request body accepted (413 above); None: no limit.
        request_exit: stops the HTTP server (``run_server`` sets it; None in-process, e.g. tests).
        exit_code: the process's exit status once the server stops (1 after the engine died).
    """

    engine: AsyncLLM
    models: OpenAIServingModels
    completion: OpenAIServingCompletion
    chat: OpenAIServingChat
    tokenization: OpenAIServingTokenization
    registry: CollectorRegistry
    api_key: str | None = None
    pool: concurrent.futures.ThreadPoolExecutor | None = None
    max_request_body_bytes: int | None = DEFAULT_MAX_REQUEST_BODY_BYTES
    request_exit: Callable[[], None] | None = None
    exit_code: int = 0
    responses: OpenAIServingResponses | None = None
    enable_runtime_lora_updating: bool = False   # [LoRA] the load / unload routes (serving_lora.py)
    tokens: OpenAIServingTokens | None = None   # /inference/v1/generate (--enable-scale-out; serving_tokens.py)


# Seconds between two looks at whether the engine died (``watch_engine``).
ENGINE_WATCH_INTERVAL_S = 0.5


async def watch_engine(state: ServerState, interval_s: float = ENGINE_WATCH_INTERVAL_S) -> None:
    """Until cancelled: once the engine can serve nothing more (``engine.dead_reason``: its loop
    died, a worker of a multi-rank executor died, every data-parallel replica is dead), log why,
    set ``state.exit_code`` to 1 and stop the server (``state.request_exit``), so that a
    supervisor (systemd, Kubernetes) restarts it. In-flight requests have already failed with
    ``EngineDeadError`` (503; a stream ends with an error event and ``[DONE]``), and ``/health``
    answers 503 meanwhile. A dead replica of several is not fatal (``/health`` says "degraded")."""
    while True:
        reason = state.engine.dead_reason
        if reason is not None:
            logger.error("the engine is dead (%s); the server stops and exits with status 1", reason)
            state.exit_code = 1
            if state.request_exit is not None:
                state.request_exit()
            return
        await asyncio.sleep(interval_s)


def default_served_model_names(args: EngineArgs, model_files) -> list[str]:
    """The names a server started without ``--served-model-name`` answers to: the model as given
    (vLLM's default); for the default model, its GGUF file's stem, then ``"default"`` (what
    ``--model default`` and vLLM examples edited to the default model send)."""
    if args.model in (None, "default"):
        return [Path(model_files.gguf_path or model_files.folder).stem, "default"]
    return [args.model]


def build_state(engine_args: EngineArgs, served_model_names: list[str] | None = None,
                chat_template: str | None = None, api_key: str | None = None, log_requests: bool = True,
                log_stats_interval_s: float | None = DEFAULT_LOG_INTERVAL_S, max_n: int | None = None,
                enable_prompt_tokens_details: bool = False, enable_auto_tool_choice: bool = False,
                tool_call_parser: str | None = None, engine_process: bool = False,
                reasoning_parser: str | None = None,
                trust_request_chat_template: bool = False,
                max_request_body_bytes: int | None = DEFAULT_MAX_REQUEST_BODY_BYTES,
                max_stored_responses: int = DEFAULT_MAX_STORED_RESPONSES,
                lora_modules: list[tuple[str, str]] = (),
                enable_runtime_lora_updating: bool = False, enable_scale_out: bool = False) -> ServerState:
    """Load the model and wire the handlers.

    Args:
        engine_args: engine settings.
        served_model_names: names for ``model`` (default: see :func:`default_served_model_names`).
        chat_template: template text (already loaded with ``load_chat_template``), or None.
        api_key: see ``ServerState``.
        log_requests: log each request at INFO.
        log_stats_interval_s: seconds between periodic stats lines; None disables them.
        max_n: the most samples (``n``, ``best_of``) one request may ask for; None: OpenAI's
            limit (``DEFAULT_MAX_N``) or ``max_num_seqs`` if smaller (a request's samples run as
            one group in one step, so more could never be scheduled).
        enable_prompt_tokens_details: send ``usage.prompt_tokens_details.cached_tokens``.
        enable_auto_tool_choice: accept ``tool_choice: "auto"`` (calls found by ``tool_call_parser``).
        tool_call_parser: a ``tool_parsers.TOOL_PARSERS`` name ("hermes", "llama3_json", "pythonic",
            "xlam").
        reasoning_parser: a ``reasoning.REASONING_PARSERS`` name ("deepseek_r1", "qwen3"): chat
            replies' reasoning goes to ``message.reasoning``; None: replies are all content. An
            unknown name is a ``ValueError`` naming ``--reasoning-parser`` and the choices.
        engine_process: run the engine in its own process even with one replica (vLLM V1's
            ``EngineCoreProc``; ``pagedllm serve``'s default): the server's Python (HTTP, JSON,
            streaming) then never holds the GIL the engine loop needs between its ops. False: the
            engine loop runs in a thread of this process (``AsyncLLM``).
        trust_request_chat_template: render a ``chat_template`` a request carries (False: 400).
        max_request_body_bytes: the largest request body (bytes; 413 above); None or 0: no limit.
        max_stored_responses: the most ``/v1/responses`` responses kept in memory for
            ``previous_response_id`` and ``GET`` (least recently used dropped first; 0: none).
        lora_modules: [LoRA] (name, PEFT folder) adapters served beside the base model (the
            request's ``model`` picks one); needs ``engine_args.enable_lora``.
        enable_runtime_lora_updating: [LoRA] serve ``/v1/load_lora_adapter`` and
            ``/v1/unload_lora_adapter``.
        enable_scale_out: serve vLLM's token-in / token-out routes ``/inference/v1/generate`` and
            ``/inference/v1/abort_requests`` (``serving_tokens.py``).
    With ``engine_args.otlp_traces_endpoint`` each finished request exports one span, parented on
    the trace in its ``traceparent`` / ``tracestate`` headers (``metrics/request_tracing.py``).

    Raises:
        ValueError: bad engine arguments (an OTLP endpoint without the ``otel`` extra among them,
            before the model loads), an unparsable chat template, ``max_n < 1``, an unknown
            tool-call parser, ``enable_auto_tool_choice`` without one, or a negative body limit or
            ``max_stored_responses``.
    """
    if max_n is not None and (not isinstance(max_n, int) or max_n < 1):
        raise ValueError(f"max_n must be an int >= 1, got {max_n!r}")
    if (lora_modules or enable_runtime_lora_updating) and not engine_args.enable_lora:
        raise ValueError("--lora-modules and --enable-runtime-lora-updating need --enable-lora")
    if lora_modules:   # a bad adapter folder fails before the model loads
        from pagedllm.lora.adapter import read_peft_config

        for _, path in lora_modules:
            read_peft_config(path, engine_args.max_lora_rank)
    if max_request_body_bytes is not None and (not isinstance(max_request_body_bytes, int)
                                               or max_request_body_bytes < 0):
        raise ValueError(f"--max-request-body-bytes must be an int >= 0 (0: no limit), got {max_request_body_bytes!r}")
    tool_parser = None
    if enable_auto_tool_choice:
        if tool_call_parser is None:
            raise ValueError(f"--enable-auto-tool-choice requires --tool-call-parser (one of {sorted(TOOL_PARSERS)})")
        tool_parser = get_tool_parser(tool_call_parser)
    elif tool_call_parser is not None:
        get_tool_parser(tool_call_parser)  # a bad name is still an error
        logger.warning("--tool-call-parser %s has no effect without --enable-auto-tool-choice", tool_call_parser)
    reasoning = None if reasoning_parser is None else get_reasoning_parser(reasoning_parser)
    if chat_template is not None:
        check_self_contained(chat_template)   # a ValueError: it does not parse, or loads other files
    response_store = ResponseStore(max_stored_responses)   # a bad size fails before the model loads
    observability = engine_args.create_observability_config()   # so does an OTLP endpoint without the extra
    registry = CollectorRegistry()
    if engine_args.data_parallel_size > 1 or engine_process:
        # D replica processes behind this server (engine/dp_client.py); metrics carry engine="i".
        from pagedllm.engine.dp_client import DPAsyncLLM, EngineCoreClient

        engine = EngineCoreClient(engine_args)
        names = list(served_model_names or default_served_model_names(engine_args, engine.model_files))
        PrometheusStatLogger.attach(engine, names[0], registry)
        if log_stats_interval_s:   # one periodic line per engine, as the in-process engine logs
            for stat_loggers in engine.stat_loggers:
                stat_loggers.append(LoggingStatLogger(log_stats_interval_s, log_on_record=True))
        async_engine = DPAsyncLLM(engine)
    else:
        from pagedllm.engine.llm_engine import LLMEngine   # torch: only this process runs the engine

        engine = LLMEngine(engine_args)
        names = list(served_model_names or default_served_model_names(engine_args, engine.model_files))
        PrometheusStatLogger.attach(engine, names[0], registry)
        async_engine = AsyncLLM(engine, log_stats_interval_s=log_stats_interval_s)
    async_engine.request_tracer = RequestTracer.from_config(observability, names[0])
    root = engine_args.model if engine_args.model not in (None, "default") else \
        (engine.model_files.gguf_path or engine.model_files.folder)
    models = OpenAIServingModels(names, root, engine.max_model_len, lora_modules)
    max_num_seqs = engine.scheduler_config.max_num_seqs
    if max_n is None:
        max_n = min(DEFAULT_MAX_N, max_num_seqs)
    elif max_n > max_num_seqs:
        raise ValueError(f"--max-n ({max_n}) must be <= --max-num-seqs ({max_num_seqs}): a request's n (or best_of) "
                         "samples run together in one step")
    pool = concurrent.futures.ThreadPoolExecutor(TOKENIZER_POOL_WORKERS, thread_name_prefix="pagedllm-tokenize")
    chat = OpenAIServingChat(async_engine, models, chat_template, engine_args.max_logprobs, log_requests, max_n,
                             tool_parser, pool=pool, trust_request_chat_template=trust_request_chat_template,
                             reasoning_parser=reasoning)
    if chat_template is None and engine.tokenizer.chat_template is None:
        try:   # the bundled fallback for the model type, with its own WARNING, or none
            resolve_chat_template(engine.tokenizer, None)
        except NoChatTemplateError:
            logger.warning("the model has no chat template: /v1/chat/completions will answer 400; start with "
                           "--chat-template (e.g. %s for Gemma models)", GEMMA_CHAT_TEMPLATE_PATH)
    completion = OpenAIServingCompletion(async_engine, models, log_requests, max_n, pool=pool)
    completion.enable_prompt_tokens_details = chat.enable_prompt_tokens_details = enable_prompt_tokens_details
    responses = OpenAIServingResponses(async_engine, models, chat, log_requests, max_n, pool=pool,
                                       store=response_store)
    return ServerState(engine=async_engine, models=models, completion=completion, chat=chat,
                       tokenization=OpenAIServingTokenization(chat), registry=registry, api_key=api_key,
                       pool=pool, max_request_body_bytes=max_request_body_bytes or None, responses=responses,
                       enable_runtime_lora_updating=enable_runtime_lora_updating,
                       tokens=OpenAIServingTokens(async_engine, models, log_requests, max_n, pool=pool)
                       if enable_scale_out else None)


def is_public_path(path: str) -> bool:
    """``path`` is one of ``PUBLIC_PATHS`` or below one (on a segment boundary: ``/healthz`` is not)."""
    return any(path == p or path.startswith(p + "/") for p in PUBLIC_PATHS)


class APIKeyMiddleware:
    """Pure ASGI middleware: every route but ``PUBLIC_PATHS`` needs ``Authorization: Bearer
    <api_key>`` (401 otherwise): the ``/v1`` API, the routes that cost compute or change state
    (``/tokenize``, ``/detokenize``, ``/reset_prefix_cache``), and unknown paths (fail closed).
    This is vLLM's current rule (``AuthenticationMiddleware``: every route unless public); its
    older releases guarded only the ``/v1`` prefix.

    (A pure ASGI middleware, unlike ``BaseHTTPMiddleware``, leaves streaming and disconnect
    detection untouched.)
    """

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or is_public_path(scope["path"]):
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


class RequestBodyLimitMiddleware:
    """Pure ASGI middleware: a request body over ``max_bytes`` is answered 413 with OpenAI's error
    body (naming the limit and ``--max-request-body-bytes``) before any route sees it.

    A declared ``Content-Length`` over the limit is refused before the body is read. Otherwise
    (a chunked upload, or a declared length within the limit) the body is read here, its bytes
    counted, and handed to the app unchanged once complete; a byte past the limit is a 413. So
    no route buffers, parses or tokenizes more than ``max_bytes``. Later ``receive`` calls (the
    disconnect watch) go to the server as before.

    Args:
        app: the ASGI app.
        max_bytes: the largest body accepted (bytes, >= 1).
    """

    def __init__(self, app, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    def too_large(self, size: str) -> OpenAIError:
        return OpenAIError(413, f"the request body is {size}, over this server's limit of {self.max_bytes} bytes "
                                "(--max-request-body-bytes)", "invalid_request_error", code="request_too_large")

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self.too_large(f"{int(declared)} bytes").to_response()(scope, receive, send)
            return
        messages: collections.deque = collections.deque()
        received = 0
        while True:
            message = await receive()
            messages.append(message)
            if message["type"] != "http.request":   # the client left: the app sees the disconnect
                break
            received += len(message.get("body", b""))
            if received > self.max_bytes:
                await self.too_large(f"more than {self.max_bytes} bytes").to_response()(scope, receive, send)
                return
            if not message.get("more_body", False):
                break

        async def replay():
            return messages.popleft() if messages else await receive()

        await self.app(scope, replay, send)


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    parts, param = [], None
    for err in exc.errors():
        if err.get("type") == "json_invalid":
            detail = (err.get("ctx") or {}).get("error") or err.get("msg")
            return OpenAIError(400, f"Malformed JSON body: {detail}", "invalid_request_error")
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if param is None and loc:
            param = loc[0]
        msg = str(err.get("msg"))
        if msg.startswith("Value error, "):   # a validator's ValueError: its own message names the field
            msg = msg[len("Value error, "):]
        text = f"{'.'.join(loc)}: {msg}" if loc else msg
        if text not in parts:
            parts.append(text)
    message = "; ".join(parts[:6]) or "invalid request body"
    return OpenAIError(400, message, "invalid_request_error", param=param)


def build_app(state: ServerState) -> FastAPI:
    """The FastAPI app over ``state`` (the engine thread starts with the app's lifespan)."""
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.engine.start()
        watcher = asyncio.create_task(watch_engine(state))
        yield
        watcher.cancel()
        await asyncio.get_running_loop().run_in_executor(None, state.engine.shutdown)
        if state.pool is not None:
            state.pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="pagedllm OpenAI-compatible server", version=__version__, lifespan=lifespan)
    app.state.server = state
    if state.max_request_body_bytes:
        app.add_middleware(RequestBodyLimitMiddleware, max_bytes=state.max_request_body_bytes)
    if state.api_key:   # added last, so outermost: a request without the key is refused before its body is read
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

    if state.enable_runtime_lora_updating:   # [LoRA] vLLM's load / unload routes
        from pagedllm.entrypoints.openai.serving_lora import add_lora_routes

        add_lora_routes(app, state)

    if state.tokens is not None:   # vLLM's token-in / token-out routes (--enable-scale-out)
        add_token_routes(app, state)

    @app.post("/v1/completions")
    async def create_completion(request: CompletionRequest, raw_request: Request):
        return await run_until_disconnect(state.completion.create_completion(request, raw_request), raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request):
        return await run_until_disconnect(state.chat.create_chat_completion(request, raw_request), raw_request)

    @app.post("/v1/chat/completions/batch")
    async def create_batch_chat_completion(request: BatchChatCompletionRequest, raw_request: Request):
        return await run_until_disconnect(state.chat.create_batch_chat_completion(request, raw_request), raw_request)

    def responses_handler() -> OpenAIServingResponses:
        if state.responses is None:
            raise OpenAIError(404, "/v1/responses is not served", "invalid_request_error")
        return state.responses

    @app.post("/v1/responses")
    async def create_responses(request: ResponsesRequest, raw_request: Request):
        return await run_until_disconnect(responses_handler().create_responses(request, raw_request), raw_request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_responses(response_id: str):
        return await responses_handler().retrieve_responses(response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_responses(response_id: str):
        return await responses_handler().cancel_responses(response_id)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        # vLLM's semantics: clears only while no request holds KV blocks; 409 otherwise.
        if await state.engine.reset_prefix_cache():
            return Response(status_code=200)
        return OpenAIError(409, "cannot reset the prefix cache while requests hold KV blocks; retry when idle",
                           "invalid_request_error").to_response()

    # vLLM's RL routes: pause generation (e.g. around a weight update), resume, ask.
    @app.post("/pause")
    async def pause_generation(mode: str = "abort", clear_cache: bool = True):
        try:
            await state.engine.pause_generation(mode=mode, clear_cache=clear_cache)
        except ValueError as e:
            raise bad_request(str(e), param="mode") from e
        return {"status": "paused"}

    @app.post("/resume")
    async def resume_generation():
        await state.engine.resume_generation()
        return {"status": "resumed"}

    @app.get("/is_paused")
    async def is_paused():
        return {"is_paused": await state.engine.is_paused()}

    @app.post("/tokenize")
    async def tokenize(request: TokenizeRequest):
        return await state.tokenization.create_tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: DetokenizeRequest):
        return await state.tokenization.create_detokenize(request)

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
                        "its file name and 'default')")
    g.add_argument("--chat-template", default=None,
                   help=f"Jinja chat template: a file, the template text, or 'gemma' ({GEMMA_CHAT_TEMPLATE_PATH.name}, "
                        "what a Gemma 3 model without its own template (the default base model) gets; 'gemma-tools' adds the request's tools "
                        "and tool turns, for --tool-call-parser hermes)")
    g.add_argument("--api-key", default=None,
                   help=f"require 'Authorization: Bearer KEY' on every route (/v1/*, /tokenize, /detokenize, "
                        f"/reset_prefix_cache, ...) but {', '.join(PUBLIC_PATHS[:3])} and the API docs "
                        f"(default: ${API_KEY_ENV}; unset: no key)")
    g.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a chat_template sent in a request (/v1/chat/completions, /tokenize); by default "
                        "(vLLM's) such a request is a 400, since a template is code the server runs")
    g.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                   help=f"largest request body accepted, in bytes; a larger one is a 413 (default: "
                        f"{DEFAULT_MAX_REQUEST_BODY_BYTES} = {DEFAULT_MAX_REQUEST_BODY_BYTES >> 20} MiB, far above a "
                        "max_model_len prompt; 0: no limit)")
    g.add_argument("--max-stored-responses", type=int, default=DEFAULT_MAX_STORED_RESPONSES,
                   help=f"most /v1/responses responses kept in memory for previous_response_id and GET "
                        f"/v1/responses/{{id}} (least recently used dropped first; default: "
                        f"{DEFAULT_MAX_STORED_RESPONSES}; 0: none stored)")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (PEFT folders) served beside the model, as name=path or "
                        "'{\"name\": ..., \"path\": ...}'; a request's model picks one (needs --enable-lora)")
    g.add_argument("--enable-runtime-lora-updating", action="store_true",
                   help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (default: off)")
    g.add_argument("--enable-scale-out", action="store_true",
                   help="serve vLLM's token-in / token-out routes POST /inference/v1/generate and "
                        "/inference/v1/abort_requests (default: off)")
    g.add_argument("--disable-log-requests", action="store_true", help="do not log each request")
    g.add_argument("--max-n", type=int, default=None,
                   help=f"most samples one request may ask for with n or best_of, at most --max-num-seqs "
                        f"(default: {DEFAULT_MAX_N}, OpenAI's limit, or --max-num-seqs if smaller); more is a 400")
    g.add_argument("--log-stats-interval", type=float, default=DEFAULT_LOG_INTERVAL_S,
                   help="seconds between stats log lines (--disable-log-stats turns them off)")
    g.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests get to finish on SIGINT/SIGTERM (with --headless: "
                        "those of its data-parallel ranks, before they leave the front end)")
    g.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"])
    g.add_argument("--disable-uvicorn-access-log", action="store_true")
    g.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="add usage.prompt_tokens_details.cached_tokens (prompt tokens found in the prefix cache)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accept tool_choice 'auto': the model writes calls in its own format, found by "
                        "--tool-call-parser")
    g.add_argument("--headless", action="store_true",
                   help="run data-parallel engine ranks only (-dpr and up), no API server: they connect to the "
                        "front end at --data-parallel-address:--data-parallel-rpc-port (README, \"Data parallelism\")")
    g.add_argument("--engine-in-process", action="store_true",
                   help="run the engine loop in a thread of the server process instead of its own process "
                        "(one process less; each token then waits for the server's Python: on 2 cores "
                        "about 20%% slower for one client, docs/benchmarks.md)")
    g.add_argument("--tool-call-parser", default=None, choices=sorted(TOOL_PARSERS),
                   help="how calls are found in a reply under tool_choice 'auto': hermes (JSON in <tool_call> "
                        "tags; the bundled 'gemma-tools' template asks for it), llama3_json ({\"name\": ..., "
                        "\"parameters\": {...}}, several joined by ';'), pythonic ([f(a=1), g()]) or xlam (a JSON "
                        "array of {\"name\", \"arguments\"})")
    g.add_argument("--reasoning-parser", default=None, choices=sorted(REASONING_PARSERS),
                   help="split chat replies of reasoning models: the text before </think> (after an optional "
                        "<think>) goes to message.reasoning / reasoning_content, the rest is the content: "
                        "deepseek_r1, or qwen3 (chat_template_kwargs enable_thinking=false: all content)")
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
        0 after a graceful shutdown; 1 when the server stopped because the engine died
        (``watch_engine``).
    Raises:
        ValueError: bad flags (the CLI prints them and exits with status 2).
    """
    import uvicorn

    if getattr(ns, "headless", False):
        from pagedllm.entrypoints.headless import run_headless

        return run_headless(engine_args_from_cli(ns, getattr(ns, "model_tag", None)), ns.shutdown_timeout)
    chat_template = load_chat_template(ns.chat_template)
    args = engine_args_from_cli(ns, getattr(ns, "model_tag", None))
    api_key = ns.api_key or envs.read(API_KEY_ENV)
    # After uvicorn's graceful shutdown it re-raises the signal: exit with status 0, not -15.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    state = build_state(args, ns.served_model_name, chat_template, api_key,
                        log_requests=not ns.disable_log_requests,
                        log_stats_interval_s=None if ns.disable_log_stats else ns.log_stats_interval,
                        max_n=ns.max_n, enable_prompt_tokens_details=ns.enable_prompt_tokens_details,
                        enable_auto_tool_choice=ns.enable_auto_tool_choice, tool_call_parser=ns.tool_call_parser,
                        reasoning_parser=ns.reasoning_parser,
                        engine_process=not ns.engine_in_process,
                        trust_request_chat_template=ns.trust_request_chat_template,
                        max_request_body_bytes=ns.max_request_body_bytes,
                        max_stored_responses=ns.max_stored_responses,
                        lora_modules=parse_lora_modules(ns.lora_modules),
                        enable_runtime_lora_updating=ns.enable_runtime_lora_updating,
                        enable_scale_out=ns.enable_scale_out)
    app = build_app(state)
    config = uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.uvicorn_log_level,
                            access_log=not ns.disable_uvicorn_access_log,
                            timeout_graceful_shutdown=ns.shutdown_timeout + SHUTDOWN_FLUSH_S)
    server = _make_server(config, state.engine, ns.shutdown_timeout)
    state.request_exit = lambda: setattr(server, "should_exit", True)
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
    logger.info("server stopped" + (" (the engine died: exit status 1)" if state.exit_code else ""))
    return state.exit_code


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
    from pagedllm.utils.process_exit import exit_process

    exit_process(main())   # no interpreter finalization at the end of a server process
