"""Turns a user prompt + SamplingParams into a validated, tokenized request."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Sequence, Union

from pagedllm.config import StructuredOutputsConfig, WatermarkConfig
from pagedllm.core.request import PromptEmbeds
from pagedllm.sampling_params import BeamSearchParams, SamplingParams
from pagedllm.tokenizer import Tokenizer, check_text

# A prompt: text, token ids, or {"prompt": text} / {"prompt_token_ids": ids} / {"prompt_embeds": tensor}.
PromptType = Union[str, list[int], dict[str, Any]]


class PromptTooLongError(ValueError):
    """The prompt alone is longer than ``max_model_len`` (the server answers 400
    ``context_length_exceeded``).

    Attributes:
        num_prompt_tokens: the prompt's length (tokens).
        max_model_len: the limit (tokens).
    """

    def __init__(self, num_prompt_tokens: int, max_model_len: int) -> None:
        super().__init__(f"the prompt is {num_prompt_tokens} tokens long, longer than max_model_len={max_model_len}")
        self.num_prompt_tokens = num_prompt_tokens
        self.max_model_len = max_model_len


class ContextLengthExceededError(ValueError):
    """Prompt + ``max_tokens`` do not fit ``max_model_len`` under a strict ``LengthCheck`` (the
    server answers 400 ``context_length_exceeded`` naming ``param``).

    Attributes:
        param: the request field at fault (``max_tokens``, ``max_completion_tokens``, ...).
    """

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class LengthCheck:
    """Reject a request whose prompt + ``max_tokens`` exceed ``max_model_len`` instead of capping
    ``max_tokens`` (the OpenAI server's rule; offline ``LLM.generate`` caps).

    Attributes:
        max_tokens_field: the request field ``max_tokens`` came from, named in the error.
        prompt_name: what the message calls the prompt ("prompt", "messages", "input").
    """

    max_tokens_field: str = "max_tokens"
    prompt_name: str = "prompt"


@dataclass(frozen=True)
class ProcessedInput:
    """A request ready for the engine; nothing changes it afterwards.

    Attributes:
        prompt: the text, or None when token ids were given.
        prompt_token_ids: the tokens.
        params: a copy of the caller's params, with the model's EOS ids recorded (under a
            ``LengthCheck``, ``max_tokens`` is the effective limit too).
        max_tokens: tokens this request may generate (max_tokens, or what fits in max_model_len);
            at least 1 (a prompt-only request, ``SamplingParams._prompt_only``, samples one token,
            which the output processor drops).
        lora_request: [LoRA] the adapter the request runs with (the server sets it from the
            request's ``model``), or None.
        prompt_embeds: the embedded prompt positions (``prompt_token_ids`` holds placeholder
            ids there), or None for a token prompt.
    """

    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int
    lora_request: object = None
    prompt_embeds: PromptEmbeds | None = field(default=None, compare=False)

    @property
    def detokenizer_prompt_ids(self) -> list[int]:
        """The prompt ids that may prime the detokenizer: those after the last embedded position
        (placeholder ids are no text)."""
        pe = self.prompt_embeds
        if pe is None:
            return self.prompt_token_ids
        embedded = pe.embedded_positions(0, len(self.prompt_token_ids))
        return self.prompt_token_ids[embedded[-1] + 1:] if embedded else self.prompt_token_ids

    def with_lora(self, lora_request) -> "ProcessedInput":
        """A copy that runs with ``lora_request`` (a ``LoRARequest`` or None); this one is unchanged."""
        return self if lora_request is self.lora_request else replace(self, lora_request=lora_request)


class InputProcessor:
    """Tokenizes and checks prompts before anything is scheduled.

    Args:
        tokenizer: the model's tokenizer.
        max_model_len: tokens per request.
        vocab_size: logits width; every token id must be below it.
        max_logprobs: most top logprobs a request may ask for.
        structured_outputs_config: grammar settings (the JSON whitespace default, the backend).
        logits_processor_classes: the engine's class-based logits processors (vLLM V1's and Model
            Runner V2's); each one's ``validate_params`` checks every request (a ``ValueError``
            refuses it).
        enable_trace_replay: accept ``SamplingParams.trace_decode_token_ids``.
        enable_prompt_embeds: accept ``{"prompt_embeds": tensor}`` prompts.
        hidden_size: the model's hidden size (the width ``prompt_embeds`` must have).
        watermark_config: the engine's ``WatermarkConfig`` (None: no watermark); each request's
            ``SamplingParams.watermarking`` is resolved to True / False against it (vLLM's
            ``resolve_watermarking``).
    """

    def __init__(self, tokenizer: Tokenizer, max_model_len: int, vocab_size: int, max_logprobs: int = 20,
                 structured_outputs_config: StructuredOutputsConfig | None = None,
                 logits_processor_classes: Sequence[type] = (), enable_trace_replay: bool = False,
                 enable_prompt_embeds: bool = False, hidden_size: int = 0,
                 watermark_config: WatermarkConfig | None = None) -> None:
        self.watermark_config = watermark_config
        self.enable_trace_replay = enable_trace_replay
        self.enable_prompt_embeds = enable_prompt_embeds
        self.hidden_size = hidden_size
        self.structured_outputs_config = structured_outputs_config or StructuredOutputsConfig()
        self.logits_processor_classes = list(logits_processor_classes)
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size
        self.max_logprobs = max_logprobs

    def process(self, prompt: PromptType, params: SamplingParams | BeamSearchParams,
                length_check: LengthCheck | None = None) -> ProcessedInput:
        """Validate and tokenize.

        Args:
            params: the request's params; a ``BeamSearchParams`` is processed as a plain request
                with its ``max_tokens`` (the beams' own params come later, from the beam search).
            length_check: reject prompt + max_tokens over max_model_len (None: cap max_tokens).
        Raises:
            ValueError: empty prompt; prompt text with a lone UTF-16 surrogate (naming
                ``prompt``); token ids outside [0, vocab_size); prompt longer than
                max_model_len (``PromptTooLongError``, both lengths in the message); logprobs / prompt_logprobs above
                max_logprobs; logit_bias / allowed_token_ids / stop_token_ids outside the vocabulary;
                a prompt of an unknown type; a ``structured_outputs`` constraint the backend
                cannot build (``StructuredOutputsError``, naming ``structured_outputs.json`` /
                ``.regex`` / ``.grammar``); under ``length_check``, prompt + max_tokens over
                max_model_len (``ContextLengthExceededError``); ``prompt_embeds`` on an engine
                without ``enable_prompt_embeds``, of the wrong shape, hidden size or dtype, or with
                ``prompt_logprobs`` (naming ``prompt_embeds``).
        """
        if isinstance(params, BeamSearchParams):
            params = SamplingParams(max_tokens=params.max_tokens)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        embeds = None
        if isinstance(prompt, dict) and "prompt_embeds" in prompt:
            text, token_ids, embeds = self._embeds_prompt(prompt)
            if params.prompt_logprobs is not None:
                raise ValueError("prompt_logprobs is not supported with prompt_embeds (the prompt has no token ids)")
        else:
            text, token_ids = self._tokenize(prompt)
        if not token_ids:
            raise ValueError("prompt must not be empty")
        self._check_ids(token_ids, "prompt token ids")
        if len(token_ids) > self.max_model_len:
            raise PromptTooLongError(len(token_ids), self.max_model_len)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(params, name)
            if value is not None and value > self.max_logprobs:
                raise ValueError(f"{name} must be <= max_logprobs ({self.max_logprobs}), got {value}")
        if params.logit_bias:
            self._check_ids(list(params.logit_bias), "logit_bias token ids")
        if params.allowed_token_ids:
            self._check_ids(params.allowed_token_ids, "allowed_token_ids")
        if params.bad_words_token_ids:
            self._check_ids(params.bad_words_token_ids, "bad_words_token_ids")
        if params.stop_token_ids:
            self._check_ids(params.stop_token_ids, "stop_token_ids")
        if params.trace_decode_token_ids is not None:
            if not self.enable_trace_replay:
                raise ValueError("trace_decode_token_ids needs an engine started with enable_trace_replay=True "
                                 "(--enable-trace-replay)")
            self._check_ids(params.trace_decode_token_ids, "trace_decode_token_ids")
        if params.structured_outputs is not None:
            from pagedllm.structured_output.grammar import validate_structured_outputs

            validate_structured_outputs(params.structured_outputs, self.structured_outputs_config)
        for cls in self.logits_processor_classes:
            cls.validate_params(params)   # ValueError: the processor refuses the request's extra_args
        params = params.clone()
        params.update_from_model(self.tokenizer.eos_token_ids)
        params.watermarking = self.watermark_config is not None and self.watermark_config.watermarks(params)
        if length_check is not None:
            params.max_tokens = max(1, self._strict_max_tokens(len(token_ids), params, length_check))
        room = self.max_model_len - len(token_ids)
        max_tokens = max(1, room) if params.max_tokens is None else max(1, min(params.max_tokens, max(room, 1)))
        return ProcessedInput(text, token_ids, params, max_tokens, prompt_embeds=embeds)

    def load_prompt_embeds(self, data: str | bytes):
        """One HTTP ``prompt_embeds`` item (base64 of ``torch.save`` bytes) as a checked
        [num_tokens, hidden_size] CPU tensor (``prompt_embeds.decode_prompt_embeds``).

        Raises:
            ValueError: naming ``prompt_embeds``: this engine lacks ``enable_prompt_embeds``, or
                the bytes are no tensor of the right shape and dtype.
        """
        from pagedllm.engine.prompt_embeds import NOT_ENABLED, decode_prompt_embeds

        if not self.enable_prompt_embeds:
            raise ValueError(NOT_ENABLED)
        return decode_prompt_embeds(data, self.hidden_size)

    def _embeds_prompt(self, prompt: dict[str, Any]) -> tuple[str | None, list[int], PromptEmbeds]:
        """``{"prompt_embeds": tensor}`` (vLLM's ``EmbedsPrompt``), optionally with the real
        ``prompt_token_ids`` and the ``prompt_is_token_ids`` mask of a mixed prompt.

        Raises:
            ValueError: as ``process`` for ``prompt_embeds``.
        """
        from pagedllm.engine.prompt_embeds import (NOT_ENABLED, PLACEHOLDER_TOKEN_ID, check_prompt_embeds,
                                                   make_prompt_embeds)

        if not self.enable_prompt_embeds:
            raise ValueError(NOT_ENABLED)
        embeds = check_prompt_embeds(prompt["prompt_embeds"], self.hidden_size)
        mask = prompt.get("prompt_is_token_ids")
        ids = prompt.get("prompt_token_ids")
        if mask is None and ids is None:
            ids = [PLACEHOLDER_TOKEN_ID] * len(embeds)
        elif mask is None or ids is None or not len(mask) == len(ids) == len(embeds):
            raise ValueError("prompt_embeds with prompt_token_ids needs prompt_is_token_ids, all three of the same "
                             f"length (got {len(embeds)} embeddings, "
                             f"{None if ids is None else len(ids)} ids, {None if mask is None else len(mask)} flags)")
        else:
            ids = self._as_ids(ids)
        text = prompt.get("prompt")
        return text if isinstance(text, str) else None, ids, make_prompt_embeds(embeds, mask)

    def _strict_max_tokens(self, prompt_len: int, params: SamplingParams, check: LengthCheck) -> int:
        """The effective max_tokens: as given (0 for a prompt-only request), or
        ``max_model_len - prompt_len`` when omitted.

        Raises:
            ContextLengthExceededError: prompt + max_tokens over max_model_len (both numbers named).
        """
        limit, what = self.max_model_len, check.prompt_name
        max_tokens = 0 if params._prompt_only else params.max_tokens
        if max_tokens is None:
            if prompt_len >= limit:
                raise ContextLengthExceededError(
                    f"This model's maximum context length is {limit} tokens. However, your {what} has "
                    f"{prompt_len} tokens, which leaves no room for the completion. Please reduce the length "
                    f"of the {what}.", check.max_tokens_field)
            return limit - prompt_len
        if prompt_len + max_tokens > limit:
            raise ContextLengthExceededError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_len + max_tokens} tokens ({prompt_len} in the {what}, {max_tokens} in the completion). "
                f"Please reduce the length of the {what} or completion.", check.max_tokens_field)
        return max_tokens

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            check_text(prompt["prompt"], "prompt")
        if isinstance(prompt, str):
            check_text(prompt, "prompt")
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self._as_ids(prompt["prompt_token_ids"])
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
            raise ValueError(f"a prompt dict needs 'prompt' or 'prompt_token_ids', got keys {sorted(prompt)}")
        if isinstance(prompt, (list, tuple)):
            return None, self._as_ids(prompt)
        raise ValueError(f"a prompt must be a str, a list of token ids or a dict, got {type(prompt).__name__}")

    @staticmethod
    def _as_ids(ids) -> list[int]:
        if any(not isinstance(t, int) or isinstance(t, bool) for t in ids):
            raise ValueError("prompt_token_ids must be a list of ints")
        return list(ids)

    def _check_ids(self, ids, what: str) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"{what} must be in [0, {self.vocab_size}), got {bad[:5]}")
