"""The server's errors: ``OpenAIError`` (answered with OpenAI's error body) and the mapping from
engine exceptions to HTTP statuses. Its own module so the handlers, the model registry and the app
import it without importing one another."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse

from pagedllm.engine.async_engine import EngineDeadError, EnginePausedError, EngineStepError
from pagedllm.engine.input_processor import ContextLengthExceededError, PromptTooLongError
from pagedllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse
from pagedllm.structured_output.grammar import StructuredOutputsError

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


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
    """A 400 ``invalid_request_error``."""
    return OpenAIError(400, message, "invalid_request_error", param, code)


@dataclass(frozen=True)
class ConstraintOrigin:
    """The request field a structured-output constraint came from, so that the input
    processor's ``StructuredOutputsError`` is answered naming it.

    Attributes:
        param: the field (``response_format``, ``structured_outputs``, ``guided_json``, ``tools``, ...).
        what: the message's prefix after ``param`` (``tools: the parameters of function 'f'``), or None.
    """

    param: str
    what: str | None = None

    def error(self, e: StructuredOutputsError) -> OpenAIError:
        """A 400 naming ``param``; the engine's field name is kept only when it is ``param``."""
        if self.what is not None:
            return bad_request(f"{self.param}: {self.what}: {e.reason}", param=self.param)
        if self.param == "structured_outputs" and str(e).startswith("structured_outputs."):
            return bad_request(str(e), param=self.param)
        return bad_request(f"{self.param}: {e.reason}", param=self.param)


def error_from_exception(e: BaseException, fields: set[str] | None = None, prompt_param: str = "prompt",
                         constraint: ConstraintOrigin | None = None) -> OpenAIError:
    """Map an exception to an ``OpenAIError``.

    ``PromptTooLongError`` -> 400 ``context_length_exceeded`` (param ``prompt_param``);
    ``ContextLengthExceededError`` -> the same, naming its max_tokens field;
    ``StructuredOutputsError`` -> 400 naming ``constraint``'s field; other ``ValueError`` -> 400
    (``param`` guessed from the message's first word when it names one of ``fields``);
    ``EngineStepError`` -> 500; ``EngineDeadError``, ``EnginePausedError`` -> 503; anything else -> 500.
    """
    if isinstance(e, OpenAIError):
        return e
    if isinstance(e, ContextLengthExceededError):
        return bad_request(str(e), param=e.param, code=CONTEXT_LENGTH_EXCEEDED)
    if isinstance(e, StructuredOutputsError) and constraint is not None:
        return constraint.error(e)
    if isinstance(e, EngineStepError):
        return OpenAIError(500, str(e), "server_error")
    if isinstance(e, (EngineDeadError, EnginePausedError)):
        return OpenAIError(503, str(e), "server_error")
    if isinstance(e, PromptTooLongError):
        return bad_request(str(e), param=prompt_param, code=CONTEXT_LENGTH_EXCEEDED)
    if isinstance(e, ValueError):
        message = str(e)
        first = message.split(" ", 1)[0].split("[", 1)[0]
        return bad_request(message, param=first if fields and first in fields else None)
    return OpenAIError(500, f"internal error: {type(e).__name__}: {e}", "server_error")
