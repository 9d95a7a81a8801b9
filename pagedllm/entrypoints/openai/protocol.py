"""Request and response bodies of the OpenAI-compatible API (pydantic 2).

Field names and defaults follow the OpenAI API reference, plus vLLM's extra sampling fields
(``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``, ``stop_token_ids``,
``allowed_token_ids``, ``include_stop_str_in_output``, ``skip_special_tokens``, ...). Pydantic
checks types only; value ranges are checked by ``SamplingParams`` and the serving layer, whose
``ValueError`` messages name the field (HTTP 400 with OpenAI's error body).

Fields nobody defines are accepted and ignored (``extra="allow"``; the server logs a warning), as
vLLM does, so newer clients keep working. Fields OpenAI or vLLM define that this server does not
implement yet are refused by the handlers (``serving_engine.UNSUPPORTED_FIELDS``), never ignored.
"""

from __future__ import annotations

import time
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_serializer

from pagedllm.tokenizer import check_text


class OpenAIBaseModel(BaseModel):
    """A request body: unknown fields are kept (``model_extra``); every field's text is checked
    for lone UTF-16 surrogates (JSON can carry ``"\\ud800"``; no tokenizer takes it): a 400
    naming the field, not a 500 from the tokenizer."""

    model_config = ConfigDict(extra="allow")

    @field_validator("*", mode="before")
    @classmethod
    def _text_is_unicode(cls, value: Any, info) -> Any:
        check_text(value, info.field_name)
        return value


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    """``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorInfo


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class PromptTokenUsageInfo(BaseModel):
    """OpenAI's ``usage.prompt_tokens_details``: ``cached_tokens`` = prompt tokens found in the
    prefix cache (sent only with ``--enable-prompt-tokens-details``)."""
    cached_tokens: int | None = None


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = None

    @model_serializer(mode="wrap")
    def _drop_absent_details(self, handler):
        data = handler(self)
        if data.get("prompt_tokens_details", 0) is None:  # only with --enable-prompt-tokens-details
            del data["prompt_tokens_details"]
        return data


class _SamplingRequest(OpenAIBaseModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    frequency_penalty: float | None = 0.0
    presence_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    n: int | None = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    user: str | None = None
    # vLLM's extra sampling fields.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = 0
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False
    skip_special_tokens: bool | None = True
    spaces_between_special_tokens: bool | None = True
    watermarking: bool | None = None   # vLLM's: False opts out of the engine's --watermark-config
    # vLLM's beam search: n = the beam width; length_penalty applies only with it.
    use_beam_search: bool | None = False
    length_penalty: float | None = 1.0
    # Structured output: OpenAI's response_format, vLLM's structured_outputs and older guided_*.
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None


PromptInput = Union[str, list[str], list[int], list[list[int]]]


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``. An omitted ``max_tokens`` means 16 (OpenAI's default).
    ``prompt_embeds`` (vLLM's, with ``--enable-prompt-embeds``): base64 of ``torch.save`` bytes
    of a [num_tokens, hidden_size] tensor, or a list of them; with ``prompt`` too, both run (the
    embeddings' choices first, as vLLM)."""

    prompt: PromptInput | None = None
    best_of: int | None = None
    echo: bool | None = False
    logprobs: int | None = None
    suffix: str | None = None
    # vLLM extras.
    prompt_logprobs: int | None = None
    add_special_tokens: bool | None = True
    prompt_embeds: str | list[str] | None = None


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``. Messages stay plain dicts; ``chat_utils`` checks them. An
    omitted ``max_tokens`` means up to ``max_model_len``."""

    messages: list[Any]
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    # vLLM extras.
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    echo: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = False


class BatchChatCompletionRequest(ChatCompletionRequest):
    """``POST /v1/chat/completions/batch`` (vLLM's): ``messages`` is a list of conversations, each
    answered on its own as ``/v1/chat/completions`` would; one choice per conversation, ``index``
    0..N-1. No streaming, tools, beam search or ``n`` > 1 (400 naming the field)."""

    messages: list[list[Any]] = Field(min_length=1)


# -- completions responses ---------------------------------------------------------------------

class CompletionLogProbs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


class CompletionStreamResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo | None = None


# -- chat responses ----------------------------------------------------------------------------

class ChatCompletionLogProb(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(BaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatMessage(BaseModel):
    """A reply message; ``tool_calls`` is left out of the JSON when there are none (as OpenAI
    answers; the openai client reads it as None), and so is ``reasoning_content`` when None.
    ``reasoning`` (``--reasoning-parser``; ``reasoning_content`` is vLLM's older name for the same
    text) is always there, null without a reasoning part, as vLLM sends it (scripts read
    ``message.reasoning`` as an attribute)."""

    role: str
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_empty_tool_calls(self, handler):
        data = handler(self)
        if not data.get("tool_calls"):
            data.pop("tool_calls", None)
        if data.get("reasoning_content") is None:
            data.pop("reasoning_content", None)
        return data


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    """A streamed delta: only the fields that are set are sent (``{"role": ...}`` first, then
    ``{"content": ...}``, and ``{}`` with the finish reason)."""

    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler):
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatCompletionResponseStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatCompletionResponseStreamChoice]
    usage: UsageInfo | None = None


# -- models, tokenize, version ---------------------------------------------------------------

class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedllm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeRequest(OpenAIBaseModel):
    """``POST /tokenize``: either ``prompt`` (text) or ``messages`` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[Any] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool | None = False


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str
