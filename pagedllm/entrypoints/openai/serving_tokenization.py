"""``POST /tokenize`` and ``POST /detokenize`` (vLLM's extra endpoints), computed in the handlers'
thread pool (a long prompt takes seconds; the event loop keeps serving meanwhile)."""

from __future__ import annotations

from fastapi.responses import Response

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
        super().__init__(chat.engine, chat.models, chat.log_requests, chat.max_n, chat.pool)
        self.chat = chat

    async def create_tokenize(self, request: TokenizeRequest) -> Response:
        """``/tokenize``: :meth:`tokenize` and its JSON body (millions of ids for a long prompt)
        built in the pool."""
        body = await self.run_in_pool(lambda: self.tokenize(request).model_dump_json(exclude_none=True))
        return Response(body, media_type="application/json")

    async def create_detokenize(self, request: DetokenizeRequest) -> Response:
        """``/detokenize``: :meth:`detokenize` and its JSON body built in the pool."""
        body = await self.run_in_pool(lambda: self.detokenize(request).model_dump_json())
        return Response(body, media_type="application/json")

    def tokenize(self, request: TokenizeRequest) -> TokenizeResponse:
        """Tokenize (blocking: seconds for a long prompt or a slow template; any thread).

        Raises:
            OpenAIError: 404 unknown model; 400 neither or both of prompt/messages, bad messages,
                or an untrusted request ``chat_template``."""
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
        """Decode (blocking; any thread).

        Raises:
            OpenAIError: 404 unknown model; 400 token ids outside the vocabulary."""
        self.models.resolve(request.model)
        limit = min(self.engine.vocab_size, self.tokenizer.vocab_size)
        bad = [t for t in request.tokens if not 0 <= t < limit]
        if bad:
            raise bad_request(f"tokens must be in [0, {limit}), got {bad[:5]}", param="tokens")
        return DetokenizeResponse(prompt=self.tokenizer.decode(request.tokens, skip_special_tokens=False))
