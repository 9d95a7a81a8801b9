"""What the completion and chat handlers share: request -> ``SamplingParams``, the limits on ``n``
and the context length, the fields that are refused until implemented, logprob token formatting,
character offsets, disconnect handling, and the thread pool that tokenizes and renders off the
event loop."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import json
import logging
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from pagedllm.engine.async_engine import AsyncLLM, EngineDeadError, EngineStepError, OutputStream
from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.engine.detokenizer import IncrementalDetokenizer
from pagedllm.entrypoints.openai.errors import ConstraintOrigin, bad_request, error_from_exception
from pagedllm.entrypoints.openai.protocol import PromptTokenUsageInfo, UsageInfo
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from pagedllm.config import StructuredOutputsConfig
from pagedllm.structured_output.backend import STRUCTURED_OUTPUTS_BACKENDS, resolve_backend_name
from pagedllm.tracing import extract_trace_headers

logger = logging.getLogger(__name__)

# JSON has no -inf; a token the sampler could never pick gets this logprob (vLLM's convention).
MIN_LOGPROB = -9999.0
# OpenAI's limit on n (and best_of); the server's --max-n.
DEFAULT_MAX_N = 128


def _unset(value: Any) -> bool:
    return value is None or value is False or value == [] or value == {}


# Fields vLLM or OpenAI define that this server does not implement yet: field -> "this value asks
# for nothing" (such values pass; any other is a 400 naming the field).
UNSUPPORTED_FIELDS: dict[str, Callable[[Any], bool]] = {
    "guided_whitespace_pattern": _unset,
    "logits_processors": _unset, "return_tokens_as_token_ids": _unset, "return_token_ids": _unset,
    "truncate_prompt_tokens": lambda v: v is None, "priority": lambda v: v in (None, 0),
    "kv_transfer_params": _unset, "vllm_xargs": _unset, "mm_processor_kwargs": _unset,
}
CHAT_UNSUPPORTED_FIELDS: dict[str, Callable[[Any], bool]] = {
    **UNSUPPORTED_FIELDS,
    "functions": _unset, "function_call": lambda v: v in (None, "none", "auto"),
    "audio": _unset, "modalities": lambda v: _unset(v) or v == ["text"], "prediction": _unset,
    "reasoning_effort": lambda v: v is None, "web_search_options": _unset, "documents": _unset,
    "prompt_logprobs": lambda v: v is None, "prompt_embeds": _unset,
}


# Sampling fields beam search cannot honour (it ranks raw log-probabilities greedily): field -> "this
# value asks for nothing"; any other value with use_beam_search is a 400 naming the field.
BEAM_SEARCH_UNSUPPORTED_FIELDS: dict[str, Callable[[Any], bool]] = {
    "best_of": lambda v: v is None, "logprobs": lambda v: v is None or v is False,
    "top_logprobs": lambda v: v is None, "prompt_logprobs": lambda v: v is None,
    "top_p": lambda v: v in (None, 1.0), "top_k": lambda v: v in (None, 0, -1), "min_p": lambda v: v in (None, 0.0),
    "presence_penalty": lambda v: v in (None, 0.0), "frequency_penalty": lambda v: v in (None, 0.0),
    "repetition_penalty": lambda v: v in (None, 1.0), "stop": _unset, "stop_token_ids": _unset,
    "min_tokens": lambda v: v in (None, 0), "logit_bias": _unset, "allowed_token_ids": _unset,
    "bad_words_token_ids": _unset, "skip_special_tokens": lambda v: v in (None, True),
}


def readable_token(data: bytes) -> str:
    """A logprob token's string: its text when ``data`` is valid UTF-8 on its own, else
    ``"bytes:"`` and each byte as ``\\xNN`` (lower-case hex), as OpenAI's API writes partial
    characters (``b"\\xf0"`` -> ``"bytes:\\xf0"``)."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data)


class TextOffsets:
    """Character offsets of tokens in a text decoded incrementally (OpenAI's ``text_offset``).

    A token's offset is the length of the text before it; tokens that only add part of a
    character share the offset where that character starts. A whole token whose text comes out
    together with earlier tokens' bytes (which decode to U+FFFD) starts where its own text does.
    Offsets are capped at ``limit`` (a text cut by a stop string).

    Args:
        tokenizer: the ``tokenizers.Tokenizer``.
        context_ids: ids before the first token (a prompt; decoded as context, not counted).
        skip_special_tokens: as the text was decoded.
    """

    def __init__(self, tokenizer, context_ids: list[int], skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._detok = IncrementalDetokenizer(tokenizer, context_ids,
                                             SamplingParams(skip_special_tokens=skip_special_tokens))
        self._count = 0

    def advance(self, token_ids: list[int], base: int = 0, limit: int | None = None) -> list[int]:
        """Offsets of ``token_ids`` (continuing the earlier calls), plus ``base``, capped at
        ``base + limit`` when given."""
        offsets = []
        for tok in token_ids:
            before = len(self._detok.output_text)
            self._count += 1
            self._detok.update([tok], self._count)
            after = len(self._detok.output_text)
            own = self._tokenizer.decode([tok], skip_special_tokens=self._skip_special_tokens)
            offset = before
            if own and "\ufffd" not in own and after - before > len(own) and \
                    self._detok.output_text.endswith(own):
                offset = after - len(own)
            offsets.append(base + (offset if limit is None else min(offset, limit)))
        return offsets


def clamp_logprob(value: float) -> float:
    return value if value >= MIN_LOGPROB else MIN_LOGPROB


class OpenAIServing:
    """Base of the endpoint handlers.

    Args:
        engine: the shared async engine.
        models: the served model names.
        log_requests: log each request (id, prompt length, params) at INFO.
        max_n: the most samples (``n``, ``best_of``) one request may ask for (``--max-n``).
        pool: where tokenizing and chat-template rendering run (``run_in_pool``), so that a long
            prompt or a slow template never stalls the event loop (every other client); owned by
            the server (``api_server.build_state``). None: asyncio's default executor.
    """

    def __init__(self, engine: AsyncLLM, models: OpenAIServingModels, log_requests: bool = True,
                 max_n: int = DEFAULT_MAX_N, pool: concurrent.futures.Executor | None = None) -> None:
        self.engine = engine
        self.models = models
        self.tokenizer = engine.tokenizer
        self.log_requests = log_requests
        self.max_n = max_n
        self.pool = pool
        # --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens (prefix cache).
        self.enable_prompt_tokens_details = False
        self._warned_tracing_disabled = False

    def trace_headers(self, raw_request: Request | None) -> dict[str, str] | None:
        """The HTTP request's W3C trace headers (``traceparent``, ``tracestate``, no others) for
        the engine's request spans (vLLM's ``_get_trace_headers``); None without any, or when the
        server records no spans (then, once, a WARNING says trace context is being ignored)."""
        headers = extract_trace_headers(raw_request.headers) if raw_request is not None else {}
        if not headers:
            return None
        if getattr(self.engine, "request_tracer", None) is None:
            if not self._warned_tracing_disabled:
                self._warned_tracing_disabled = True
                logger.warning("received a request with trace context but tracing is disabled "
                               "(start with --otlp-traces-endpoint to export request spans)")
            return None
        return headers

    async def run_in_pool(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` in ``self.pool``, awaited (vLLM runs its tokenizer in an executor
        too). The tokenizer releases the GIL on long inputs (``Tokenizer.encode``), so the loop
        keeps answering (``/health``, other streams) meanwhile. Exceptions (``ValueError``,
        ``OpenAIError``) come back unchanged. Cancelling the await (a client disconnect) does not
        stop a call already running; its result is dropped."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.pool, functools.partial(fn, *args, **kwargs))

    @staticmethod
    async def sse_events(request_id: str, outputs: OutputStream, chunks: AsyncIterator[str],
                         final_usage: Callable[[], BaseModel] | None = None) -> AsyncIterator[str]:
        """One streamed response's server-sent events: each of ``chunks`` (``data: ...`` lines),
        then the usage-only chunk ``final_usage()`` (``stream_options.include_usage``), then
        ``data: [DONE]``. A failed engine step ends the stream with an OpenAI error body instead of
        raising (the status line is already sent). ``outputs`` is aborted on the way out, whether
        the request finished, failed or the client went away, so its blocks are freed."""
        try:
            async for piece in chunks:
                yield piece
            if final_usage is not None:
                yield f"data: {final_usage().model_dump_json()}\n\n"
        except (EngineStepError, EngineDeadError) as e:
            logger.error("request %s failed: %s", request_id, e)
            yield f"data: {json.dumps(error_from_exception(e).to_body())}\n\n"
        finally:
            outputs.abort()
        yield "data: [DONE]\n\n"

    def usage(self, num_prompt: int, num_completion: int, num_cached: int | None) -> UsageInfo:
        """The ``usage`` object; ``prompt_tokens_details`` only with ``--enable-prompt-tokens-details``."""
        details = PromptTokenUsageInfo(cached_tokens=num_cached or 0) if self.enable_prompt_tokens_details else None
        return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_completion,
                         total_tokens=num_prompt + num_completion, prompt_tokens_details=details)

    @staticmethod
    async def final_outputs(outputs: OutputStream) -> dict[str, RequestOutput]:
        """Wait for the stream's requests to finish; their last outputs by request id. The stream
        is aborted at the end, or when the wait is cancelled (a client disconnect).

        Raises:
            OpenAIError: 500 when an engine step fails, 503 when the engine is dead or stopping.
        """
        finals: dict[str, RequestOutput] = {}
        try:
            async for out in outputs:
                if out.finished:
                    finals[out.request_id] = out
        except (EngineStepError, EngineDeadError) as e:
            raise error_from_exception(e) from e
        finally:
            outputs.abort()
        return finals

    # -- checks -------------------------------------------------------------------------------

    def check_n(self, n: int | None, best_of: int | None = None) -> None:
        """Raises:
            OpenAIError: 400 when ``n`` or ``best_of`` exceeds the server's ``--max-n``."""
        for name, value in (("n", n), ("best_of", best_of)):
            if isinstance(value, int) and value > self.max_n:
                raise bad_request(f"{name} must be <= {self.max_n} (this server's --max-n, at most --max-num-seqs; "
                                  f"OpenAI's limit is {DEFAULT_MAX_N}), got {value}", param=name)

    @staticmethod
    def check_unsupported_fields(request, table: dict[str, Callable[[Any], bool]]) -> None:
        """Refuse a field vLLM or OpenAI defines but this server does not implement yet, unless its
        value asks for nothing (``priority: 0``, ``functions: []``).

        Raises:
            OpenAIError: 400 naming the field.
        """
        extra = request.model_extra or {}
        for name, is_noop in table.items():
            if name in type(request).model_fields:
                value = getattr(request, name)
            elif name in extra:
                value = extra[name]
            else:
                continue
            if not is_noop(value):
                raise bad_request(f"{name}={value!r} is not supported by this server yet", param=name)

    def check_beam_search(self, request) -> bool:
        """vLLM's ``use_beam_search``: ``n`` is the beam width; greedy only, never streamed.
        Without it, ``length_penalty`` must ask for nothing.

        Returns:
            Whether the request asks for beam search.
        Raises:
            OpenAIError: 400 naming the field: ``stream`` true, ``temperature`` > 0, ``n`` < 1, a
                sampling field beam search cannot honour (``BEAM_SEARCH_UNSUPPORTED_FIELDS``), or
                ``length_penalty`` without beam search.
        """
        if not request.use_beam_search:
            if request.length_penalty not in (None, 1.0):
                raise bad_request(f"length_penalty={request.length_penalty!r} is not supported without "
                                  "use_beam_search", param="length_penalty")
            return False
        if request.stream:
            raise bad_request("use_beam_search cannot be combined with stream=true: the best beams are known "
                              "only at the end", param="stream")
        if request.temperature not in (None, 0.0):
            raise bad_request(f"temperature must be 0 (or omitted) with use_beam_search, got {request.temperature}",
                              param="temperature")
        if request.n is not None and request.n < 1:
            raise bad_request(f"n (the beam width with use_beam_search) must be >= 1, got {request.n}", param="n")
        if request.n is not None and request.n > self.engine.max_num_seqs:
            raise bad_request(f"n (the beam width with use_beam_search) must be <= max_num_seqs "
                              f"({self.engine.max_num_seqs}): the beams run as one group, got {request.n}", param="n")
        for name, is_noop in BEAM_SEARCH_UNSUPPORTED_FIELDS.items():
            if name in type(request).model_fields and not is_noop(getattr(request, name)):
                raise bad_request(f"{name}={getattr(request, name)!r} is not supported with use_beam_search",
                                  param=name)
        return True

    @staticmethod
    def beam_search_params(request, max_tokens: int) -> BeamSearchParams:
        """``BeamSearchParams`` of a checked ``use_beam_search`` request (``n`` beams).

        Raises:
            ValueError: an invalid value, naming the field (-> 400).
        """
        return BeamSearchParams(beam_width=1 if request.n is None else request.n, max_tokens=max_tokens,
                                ignore_eos=bool(request.ignore_eos),
                                length_penalty=1.0 if request.length_penalty is None else request.length_penalty)

    @staticmethod
    def requested_max_tokens(request, allow_zero: bool = False) -> tuple[int | None, str]:
        """The completion length the request asks for and the field that says so:
        ``max_completion_tokens`` (OpenAI's newer name) wins over ``max_tokens``.

        Args:
            allow_zero: 0 is accepted (a completion with ``echo``: the prompt only).
        Returns:
            (the value or None when neither is set, the field's name).
        Raises:
            OpenAIError: 400 naming that field when the value is below 1 (0 without
                ``allow_zero``), with vLLM's message.
        """
        field = "max_completion_tokens" if getattr(request, "max_completion_tokens", None) is not None \
            else "max_tokens"
        value = getattr(request, field, None)
        if value is not None and (value < 0 or (value == 0 and not allow_zero)):
            raise bad_request(f"{field} must be at least 1, got {value}.", param=field)
        return value, field

    @property
    def structured_outputs_config(self) -> StructuredOutputsConfig:
        """The engine's grammar settings (its backend), or the defaults for an engine without."""
        return getattr(self.engine, "structured_outputs_config", None) or StructuredOutputsConfig()

    def check_guided_decoding_backend(self, request) -> None:
        """Raises:
            OpenAIError: 400 naming ``guided_decoding_backend`` when the request asks for a
                backend other than the engine's (vLLM V1 no longer selects one per request either)."""
        asked = getattr(request, "guided_decoding_backend", None)
        backend = self.structured_outputs_config.backend
        running = resolve_backend_name(backend)
        if asked not in (None, "auto", backend, running):
            known = asked in STRUCTURED_OUTPUTS_BACKENDS
            raise bad_request(f"guided_decoding_backend {asked!r}: "
                              + ("" if known else f"not a structured-output backend (they are {STRUCTURED_OUTPUTS_BACKENDS}); ")
                              + f"this server runs {running!r} (--structured-outputs-backend) and a request cannot "
                              f"choose another; leave the field out", param="guided_decoding_backend")

    def structured_outputs(self, request) -> tuple[StructuredOutputsParams | None, ConstraintOrigin | None]:
        """The request's constraint, from ``response_format``, ``structured_outputs`` or the
        older ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar``, and
        the field it came from (the input processor checks that the backend can build it; its
        error is answered naming that field through ``error_from_exception(constraint=...)``).

        Raises:
            OpenAIError: 400 naming the field: an unknown ``response_format`` type, a
                ``json_schema`` without ``schema``, two constraints at once, or a
                ``guided_decoding_backend`` that is not the engine's.
        """
        self.check_guided_decoding_backend(request)
        found: list[tuple[str, StructuredOutputsParams]] = []

        def make(field: str, **kwargs) -> StructuredOutputsParams:
            try:
                return StructuredOutputsParams(**kwargs)
            except (TypeError, ValueError) as e:
                raise bad_request(f"{field}: {e}", param=field) from None

        rf = request.response_format
        if rf is not None:
            kind = rf.get("type", "text") if isinstance(rf, dict) else None
            if kind == "json_object":
                found.append(("response_format", make("response_format", json_object=True)))
            elif kind == "json_schema":
                spec = rf.get("json_schema")
                schema = spec.get("schema") if isinstance(spec, dict) else None
                if not isinstance(schema, dict):
                    raise bad_request("response_format.json_schema.schema must be a JSON schema object",
                                      param="response_format")
                found.append(("response_format", make("response_format", json=schema)))
            elif kind == "structural_tag":   # vLLM's: {"type", "structures": [{begin, schema, end}], "triggers"}
                found.append(("response_format", make("response_format", structural_tag=dict(rf))))
            elif kind != "text":
                raise bad_request(f"response_format.type must be 'text', 'json_object', 'json_schema' or "
                                  f"'structural_tag', got {kind!r}", param="response_format")
        if request.structured_outputs:
            allowed = {"json", "regex", "choice", "grammar", "json_object", "structural_tag", "disable_any_whitespace"}
            unknown = sorted(set(request.structured_outputs) - allowed)
            if unknown:
                raise bad_request(f"structured_outputs has unknown field(s) {unknown}; supported: {sorted(allowed)}",
                                  param="structured_outputs")
            found.append(("structured_outputs", make("structured_outputs", **request.structured_outputs)))
        for field, key in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            value = getattr(request, field)
            if value is not None:
                found.append((field, make(field, **{key: value})))
        if len(found) > 1:
            names = [f for f, _ in found]
            raise bad_request(f"only one structured output constraint may be given, got {names}", param=names[1])
        if not found:
            return None, None
        field, params = found[0]
        return params, ConstraintOrigin(field)

    @staticmethod
    def sampling_params(request, max_tokens: int | None, logprobs: int | None, output_kind: RequestOutputKind,
                        best_of: int | None = None, prompt_logprobs: int | None = None,
                        structured_outputs: StructuredOutputsParams | None = None) -> SamplingParams:
        """Request fields -> ``SamplingParams`` (OpenAI defaults: temperature 1, top_p 1).

        Raises:
            ValueError: an invalid value, naming the field (-> 400).
        """
        def pick(value, default):
            return default if value is None else value

        logit_bias = None
        if request.logit_bias:
            logit_bias = {}
            for key, bias in request.logit_bias.items():
                try:
                    logit_bias[int(key)] = bias
                except ValueError:
                    raise ValueError(f"logit_bias keys must be token ids, got {key!r}") from None
        return SamplingParams(
            n=pick(request.n, 1), best_of=best_of, temperature=pick(request.temperature, 1.0),
            top_p=pick(request.top_p, 1.0), top_k=pick(request.top_k, 0), min_p=pick(request.min_p, 0.0),
            seed=request.seed, presence_penalty=pick(request.presence_penalty, 0.0),
            frequency_penalty=pick(request.frequency_penalty, 0.0),
            repetition_penalty=pick(request.repetition_penalty, 1.0), stop=request.stop,
            stop_token_ids=request.stop_token_ids, ignore_eos=bool(request.ignore_eos), max_tokens=max_tokens,
            min_tokens=pick(request.min_tokens, 0), logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=pick(request.skip_special_tokens, True),
            spaces_between_special_tokens=pick(request.spaces_between_special_tokens, True),
            include_stop_str_in_output=bool(request.include_stop_str_in_output), logit_bias=logit_bias,
            allowed_token_ids=request.allowed_token_ids, bad_words_token_ids=request.bad_words_token_ids,
            output_kind=output_kind, structured_outputs=structured_outputs, watermarking=request.watermarking)

    @staticmethod
    def warn_unknown_fields(request, known: dict[str, Any] | None = None) -> None:
        """Log fields neither OpenAI, vLLM nor this server defines (they are ignored)."""
        extra = sorted(k for k in (request.model_extra or {}) if k not in (known or {}))
        if extra:
            logger.warning("ignoring unknown request field(s) %s", extra)

    def log_request(self, request_id: str, prompt: Any, num_prompt_tokens: int, params: SamplingParams) -> None:
        if self.log_requests:
            text = prompt if isinstance(prompt, str) else None
            logger.info("Received request %s: prompt: %r (%d tokens), params: %s", request_id,
                        None if text is None else (text[:200] + ("..." if len(text) > 200 else "")),
                        num_prompt_tokens, params)

    # -- logprobs -------------------------------------------------------------------------------

    def token_bytes(self, token_id: int) -> list[int]:
        """The exact bytes of a token (a byte-fallback token ``<0xF0>`` is its one byte)."""
        return list(self.tokenizer.token_bytes(token_id))

    def token_str(self, token_id: int) -> str:
        """A logprob token's string (see :func:`readable_token`)."""
        return readable_token(self.tokenizer.token_bytes(token_id))


async def _wait_for_disconnect(raw_request: Request) -> None:
    while True:
        message = await raw_request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(handler: Awaitable[Response], raw_request: Request) -> Response:
    """Await ``handler`` but cancel it if the client disconnects first (non-streaming requests:
    the handler's ``finally`` aborts its engine requests, freeing their blocks).

    A handler that returns a ``StreamingResponse`` returns at once; the stream's own disconnect
    handling (Starlette cancels the body iterator) takes over from there.
    """
    task = asyncio.ensure_future(handler)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw_request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    logger.info("client disconnected; request cancelled")
    return Response(status_code=499)
