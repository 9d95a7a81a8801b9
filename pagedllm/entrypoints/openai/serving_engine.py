"""What the completion and chat handlers share: OpenAI errors, the served-model check, request ->
``SamplingParams``, the strict context-length check, logprob formatting and disconnect handling."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from typing import Any, Awaitable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedllm.core.sched_output import Logprob
from pagedllm.engine.async_engine import AsyncLLM, EngineDeadError, EngineStepError
from pagedllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse, PromptTokenUsageInfo, UsageInfo
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

# JSON has no -inf; a token the sampler could never pick gets this logprob (vLLM's convention).
MIN_LOGPROB = -9999.0
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


class OpenAIError(Exception):
    """An error the server answers with OpenAI's body ``{"error": {message, type, param, code}}``.

    Args:
        status_code: HTTP status (400, 401, 404, 500, 503).
        message: what went wrong, naming the field and value.
        type: OpenAI's error type (``invalid_request_error``, ``server_error``, ...).
        param: the request field at fault, if known.
        code: OpenAI's machine-readable code (``model_not_found``, ``context_length_exceeded``, ...).
    """

    def __init__(self, status_code: int, message: str, type: str | None = None, param: str | None = None,
                 code: int | str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type or ("invalid_request_error" if status_code < 500 else "server_error")
        self.param = param
        self.code = code

    def to_body(self) -> dict[str, Any]:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()

    def to_response(self) -> JSONResponse:
        return JSONResponse(self.to_body(), status_code=self.status_code)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, "invalid_request_error", param, code)


def error_from_exception(e: BaseException, fields: set[str] | None = None) -> OpenAIError:
    """Map an exception to an ``OpenAIError``: ``ValueError`` -> 400 (``param`` guessed from the
    message's first word when it names a request field), engine failures -> 500 / 503."""
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, EngineStepError):
        return OpenAIError(500, str(e), "server_error")
    if isinstance(e, EngineDeadError):
        return OpenAIError(503, str(e), "server_error")
    if isinstance(e, ValueError):
        message = str(e)
        first = message.split(" ", 1)[0].split("[", 1)[0]
        return bad_request(message, param=first if fields and first in fields else None)
    return OpenAIError(500, f"internal error: {type(e).__name__}: {e}", "server_error")


def clamp_logprob(value: float) -> float:
    return value if value >= MIN_LOGPROB else MIN_LOGPROB


class OpenAIServing:
    """Base of the endpoint handlers.

    Args:
        engine: the shared async engine.
        models: the served model names.
        log_requests: log each request (id, prompt length, params) at INFO.
    """

    def __init__(self, engine: AsyncLLM, models: OpenAIServingModels, log_requests: bool = True) -> None:
        self.engine = engine
        self.models = models
        self.tokenizer = engine.tokenizer
        self.log_requests = log_requests
        # --enable-prompt-tokens-details: usage.prompt_tokens_details.cached_tokens (prefix cache).
        self.enable_prompt_tokens_details = False

    def usage(self, num_prompt: int, num_completion: int, num_cached: int | None) -> UsageInfo:
        """The ``usage`` object; ``prompt_tokens_details`` only with ``--enable-prompt-tokens-details``."""
        details = PromptTokenUsageInfo(cached_tokens=num_cached or 0) if self.enable_prompt_tokens_details else None
        return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_completion,
                         total_tokens=num_prompt + num_completion, prompt_tokens_details=details)

    # -- checks -------------------------------------------------------------------------------

    def check_max_tokens(self, prompt_len: int, max_tokens: int | None, what: str = "prompt") -> int:
        """The strict length check (the engine itself only caps).

        Returns:
            The effective max_tokens: as given, or ``max_model_len - prompt_len`` when omitted.
        Raises:
            OpenAIError: 400 when prompt + max_tokens exceeds max_model_len (both numbers named).
        """
        limit = self.engine.max_model_len
        if max_tokens is None:
            if prompt_len >= limit:
                raise bad_request(
                    f"This model's maximum context length is {limit} tokens. However, your {what} has "
                    f"{prompt_len} tokens, which leaves no room for the completion. Please reduce the length "
                    f"of the {what}.", param="max_tokens", code="context_length_exceeded")
            return limit - prompt_len
        if prompt_len + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the {what}, {max_tokens} in the completion). "
                f"Please reduce the length of the {what} or completion.",
                param="max_tokens", code="context_length_exceeded")
        return max_tokens

    @staticmethod
    def sampling_params(request, max_tokens: int | None, logprobs: int | None, output_kind: RequestOutputKind,
                        best_of: int | None = None, prompt_logprobs: int | None = None) -> SamplingParams:
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
            output_kind=output_kind)

    def warn_unknown_fields(self, request) -> None:
        extra = sorted((request.model_extra or {}).keys())
        if extra:
            logger.warning("ignoring unknown request field(s) %s", extra)

    def log_request(self, request_id: str, prompt: Any, num_prompt_tokens: int, params: SamplingParams) -> None:
        if self.log_requests:
            text = prompt if isinstance(prompt, str) else None
            logger.info("Received request %s: prompt: %r (%d tokens), params: %s", request_id,
                        None if text is None else (text[:200] + ("..." if len(text) > 200 else "")),
                        num_prompt_tokens, params)

    # -- logprobs -------------------------------------------------------------------------------

    def token_str(self, token_id: int, logprob: Logprob | None = None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int, text: str) -> list[int]:
        """UTF-8 bytes of a token; a byte-fallback token (``<0xF0>``) gives its one raw byte."""
        piece = self.tokenizer.backend.id_to_token(token_id)
        if piece is not None and (m := _BYTE_TOKEN.match(piece)):
            return [int(m.group(1), 16)]
        return list(text.encode("utf-8", errors="replace"))


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
