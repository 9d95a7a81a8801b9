"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's extra endpoints)."""

from __future__ import annotations

from pagedllm.entrypoints.openai.protocol import (DetokenizeRequest, DetokenizeResponse, TokenizeRequest,
                                                  TokenizeResponse)
from pagedllm.entrypoints.openai.serving_chat import OpenAIServingChat
from pagedllm.entrypoints.openai.errors import bad_request
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing


class OpenAIServingTokenization(OpenAIServing):
    """Tokenize a prompt (or chat messages, rendered like ``/v1/chat/completions``) and back.

    Args:
        chat: the chat handler, whose template rendering is reused.
    """

    def __init__(self, chat: OpenAIServingChat) -> None:
        super().__init__(chat.engine, chat.models, chat.log_requests, chat.max_n)
        self.chat = chat

    def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        """Raises:
            OpenAIError: 404 unknown model; 400 neither or both of prompt/messages, or bad messages."""
        self.models.resolve(request.model)
        if (request.prompt is None) == (request.messages is None):
            raise bad_request("give exactly one of prompt or messages", param="prompt")
        if request.messages is not None:
            ids = self.chat.render(request)["prompt_token_ids"]
        else:
            add_special = True if request.add_special_tokens is None else request.add_special_tokens
            ids = self.tokenizer.encode(request.prompt, add_special_tokens=add_special)
        strs = self.tokenizer.convert_ids_to_tokens(ids) if request.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.engine.max_model_len, tokens=ids, token_strs=strs)

    def detokenize(self, request: DetokenizeRequest) -> DetokenizeResponse:
        """Raises:
            OpenAIError: 404 unknown model; 400 token ids outside the vocabulary."""
        self.models.resolve(request.model)
        limit = min(self.engine.vocab_size, self.tokenizer.vocab_size)
        bad = [t for t in request.tokens if not 0 <= t < limit]
        if bad:
            raise bad_request(f"tokens must be in [0, {limit}), got {bad[:5]}", param="tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens, skip_special_tokens=False))
