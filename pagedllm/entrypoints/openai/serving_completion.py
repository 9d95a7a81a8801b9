"""``POST /v1/completions``: prompts (text, list of texts, token ids, list of token-id lists,
vLLM's base64 ``prompt_embeds``), ``echo``, ``logprobs``, ``n``, ``best_of``, ``stop``, ``seed``,
``logit_bias``; streamed as server-sent events (``data: {...}`` chunks, then ``data: [DONE]``).

``max_tokens`` defaults to 16 (OpenAI's and vLLM's default on this route); 0 returns the prompt
only (with ``echo``, its text and logprobs). Echoed text, logprob tokens and ``text_offset`` agree:
``text_offset[i]`` is where token ``i``'s text starts in the choice's ``text`` (tokens that add no
text there, such as a BOS the tokenizer added or part of a character, share the next offset).
"""

from __future__ import annotations

import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedllm.engine.async_engine import OutputStream
from pagedllm.engine.detokenizer import incomplete_tail_length
from pagedllm.engine.input_processor import LengthCheck, ProcessedInput
from pagedllm.entrypoints.openai.errors import bad_request, error_from_exception
from pagedllm.entrypoints.openai.protocol import (CompletionLogProbs, CompletionRequest, CompletionResponse,
                                                  CompletionResponseChoice, CompletionStreamResponse, UsageInfo)
from pagedllm.entrypoints.openai.serving_engine import (UNSUPPORTED_FIELDS, OpenAIServing, TextOffsets,
                                                       clamp_logprob)
from pagedllm.outputs import Logprob
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)

# OpenAI's and vLLM's max_tokens when a completions request omits it.
DEFAULT_COMPLETION_MAX_TOKENS = 16


@dataclass
class _Prompt:
    """One prompt of the request.

    Attributes:
        text: the prompt string, or None for token ids.
        token_ids: its tokens.
        tail: trailing tokens that end partway through a character (token-id prompts only).
    """

    text: str | None
    token_ids: list[int]
    tail: int = 0


def _parse_prompts(prompt) -> list[str | list[int]]:
    """The request's ``prompt`` as a list of engine prompts.

    Raises:
        OpenAIError: 400 for an empty token list (``[]``, ``[[]]``) or a mixed list. Text is
            checked after tokenizing: ``""`` is a valid prompt when the tokenizer adds a BOS.
    """
    empty = bad_request("prompt must not be empty", param="prompt")
    if isinstance(prompt, str):
        # "" is tokenized like any text (to [BOS] when the tokenizer adds one), as /tokenize does.
        return [prompt]
    if not prompt:
        raise empty
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if all(isinstance(p, list) for p in prompt):
        if any(not p for p in prompt):
            raise empty
        return [list(p) for p in prompt]
    raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of "
                      "token-id lists", param="prompt")


class OpenAIServingCompletion(OpenAIServing):
    """Handler of ``/v1/completions``."""

    fields = set(CompletionRequest.model_fields)

    async def create_completion(self, request: CompletionRequest, raw_request: Request | None = None) -> Response:
        """Validate everything (400 before any event is streamed), queue one engine request per
        prompt, and answer with a JSON body or an SSE stream.

        Raises:
            OpenAIError: 400 for invalid input, 404 for an unknown model.
        """
        arrival_time = time.monotonic()
        model_name = self.models.resolve(request.model)
        self.check_unsupported_fields(request, UNSUPPORTED_FIELDS)
        self.warn_unknown_fields(request, UNSUPPORTED_FIELDS)
        if request.suffix:
            raise bad_request("suffix is not supported: no model served here can insert text (fill-in-the-middle)",
                              param="suffix")
        beam_search = self.check_beam_search(request)
        if beam_search and self.models.lora_for(model_name) is not None:
            raise bad_request("use_beam_search does not run with LoRA adapters", param="use_beam_search")
        stream = bool(request.stream)
        n = 1 if request.n is None else request.n
        self.check_n(n, request.best_of)
        if request.best_of is not None:
            if stream and request.best_of > 1:
                raise bad_request(f"best_of={request.best_of} cannot be streamed: the best completions are known "
                                  "only at the end", param="best_of")
            if request.best_of < n:
                raise bad_request(f"best_of must be >= n ({n}), got {request.best_of}", param="best_of")
        if request.stream_options is not None and not stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        prompts = await self._embeds_prompts(request) + ([] if request.prompt is None else
                                                          _parse_prompts(request.prompt))
        # max_tokens 0 with echo: the prompt only (vLLM's "echo without generation"); without echo a 400.
        max_tokens, max_tokens_field = self.requested_max_tokens(request, allow_zero=bool(request.echo))
        if max_tokens is None:
            max_tokens = DEFAULT_COMPLETION_MAX_TOKENS
        prompt_only = max_tokens == 0
        num_top = request.logprobs
        prompt_logprobs = request.prompt_logprobs
        if request.echo and num_top is not None:
            prompt_logprobs = max(prompt_logprobs or 0, num_top)
        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        best_of = request.best_of if request.best_of is not None and request.best_of > n else None
        structured_outputs, origin = self.structured_outputs(request)
        try:
            if beam_search and structured_outputs is not None:
                raise ValueError("use_beam_search cannot be combined with a structured output constraint "
                                 "(response_format, structured_outputs, guided_*)")
            # Beam search: the prompt is processed as a plain greedy request, then runs as beams.
            generate = max(max_tokens, 1)
            base = SamplingParams(max_tokens=generate, temperature=0.0) if beam_search else \
                self.sampling_params(request, generate, num_top, kind, best_of, prompt_logprobs,
                                     structured_outputs=structured_outputs)
            base._prompt_only = prompt_only
            cmpl_id = f"cmpl-{uuid.uuid4().hex}"
            # Tokenizing is the slow part (a long prompt: seconds): off the event loop.
            processed_prompts = await self.run_in_pool(self.process_prompts, prompts, base,
                                                       add_special_tokens=request.add_special_tokens is not False,
                                                       max_tokens_field=max_tokens_field)
            engine_requests, infos = [], []
            for i, (processed, info) in enumerate(processed_prompts):
                request_id = f"{cmpl_id}-{i}"
                beam = self.beam_search_params(request, processed.params.max_tokens) if beam_search else None
                processed = processed.with_lora(self.models.lora_for(model_name))   # the adapter `model` names
                engine_requests.append((request_id, processed, beam))
                infos.append(info)
                self.log_request(request_id, processed.prompt, len(info.token_ids), processed.params)
            outputs = self.engine.add_requests(engine_requests, arrival_time=arrival_time,
                                               trace_headers=self.trace_headers(raw_request))
        except Exception as e:
            raise error_from_exception(e, self.fields, constraint=origin) from e
        created = int(time.time())
        skip_special = base.skip_special_tokens
        if stream:
            return StreamingResponse(self._stream(request, outputs, cmpl_id, created, model_name, infos, n,
                                                  skip_special), media_type="text/event-stream")
        finals = await self.final_outputs(outputs)
        choices = []
        num_prompt = num_completion = 0
        for i, (request_id, info) in enumerate(zip(outputs.request_ids, infos)):
            out = finals[request_id]
            num_prompt += len(info.token_ids)
            for o in out.outputs:
                num_completion += len(o.token_ids)
                echo = self.echo_text(info, bool(o.token_ids)) if request.echo else ""
                logprobs = None
                if num_top is not None:
                    logprobs = CompletionLogProbs()
                    if request.echo:
                        self.add_prompt_logprobs(logprobs, info, echo, out.prompt_logprobs, num_top)
                    offsets = TextOffsets(self.tokenizer.backend, info.token_ids, skip_special)
                    self.add_logprobs(logprobs, o.token_ids, o.logprobs or [], num_top,
                                      offsets.advance(o.token_ids, len(echo), len(o.text)))
                choices.append(CompletionResponseChoice(index=i * n + o.index, text=echo + o.text, logprobs=logprobs,
                                                        finish_reason=o.finish_reason, stop_reason=o.stop_reason))
        choices.sort(key=lambda c: c.index)
        response = CompletionResponse(id=cmpl_id, created=created, model=model_name, choices=choices,
                                      usage=self.usage(num_prompt, num_completion,
                                                       sum(finals[r].num_cached_tokens or 0 for r in finals)))
        return JSONResponse(response.model_dump())

    async def _embeds_prompts(self, request: CompletionRequest) -> list[dict]:
        """The request's ``prompt_embeds`` as ``{"prompt_embeds": tensor}`` prompts (decoded in the
        pool), before its text prompts, as vLLM orders them.

        Raises:
            OpenAIError: 400 when neither ``prompt`` nor ``prompt_embeds`` is given, for
                ``prompt_embeds`` with ``echo`` or ``prompt_logprobs``, on a server without
                ``--enable-prompt-embeds`` or for bytes that are no fitting tensor (param
                ``prompt_embeds``).
        """
        items = request.prompt_embeds
        items = [items] if isinstance(items, str) else list(items or [])
        if not items:
            if request.prompt is None:
                raise bad_request("either prompt or prompt_embeds must be given", param="prompt")
            return []
        if request.echo:
            raise bad_request("echo is not supported with prompt_embeds", param="echo")
        if request.prompt_logprobs is not None:
            raise bad_request("prompt_logprobs is not supported with prompt_embeds", param="prompt_logprobs")
        try:
            tensors = await self.run_in_pool(lambda: [self.engine.load_prompt_embeds(item) for item in items])
        except ValueError as e:
            raise bad_request(str(e), param="prompt_embeds") from e
        return [{"prompt_embeds": t} for t in tensors]

    def process_prompts(self, prompts: list[str | list[int] | dict], base: SamplingParams,
                        add_special_tokens: bool = True,
                        max_tokens_field: str = "max_tokens") -> list[tuple[ProcessedInput, _Prompt]]:
        """Tokenize and check each prompt (pure; any thread: the handler runs it in its pool).

        A prompt-only request (``base._prompt_only``, ``max_tokens`` 0) must fit
        ``max_model_len`` alone, and generates the one token that is dropped.

        Returns:
            Per prompt, the engine's ``ProcessedInput`` (its params copy holds the effective
            ``max_tokens``) and what the response needs of it.
        Raises:
            ValueError: as ``InputProcessor.process`` under a ``LengthCheck`` naming
                ``max_tokens_field`` (empty, out of vocabulary, too long, no room for ``max_tokens``, ...).
        """
        result = []
        for prompt in prompts:
            if isinstance(prompt, str) and not add_special_tokens:
                prompt = {"prompt": prompt, "prompt_token_ids": self.tokenizer.encode(prompt, add_special_tokens=False)}
            processed = self.engine.process_inputs(prompt, base, LengthCheck(max_tokens_field))
            ids = processed.prompt_token_ids
            tail = 0 if processed.prompt is not None or processed.prompt_embeds is not None else \
                incomplete_tail_length(self.tokenizer.backend, ids, skip_special_tokens=False)
            result.append((processed, _Prompt(processed.prompt, ids, tail)))
        return result

    def _stream(self, request: CompletionRequest, outputs: OutputStream, cmpl_id: str, created: int,
                model_name: str, infos: list[_Prompt], n: int, skip_special: bool) -> AsyncIterator[str]:
        options = request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous_usage = bool(options and options.continuous_usage_stats)
        num_top = request.logprobs
        num_prompt = sum(len(info.token_ids) for info in infos)
        index_of = {rid: i for i, rid in enumerate(outputs.request_ids)}
        echoed: dict[int, int] = {}  # choice index -> length of its echoed prompt text
        generated: dict[int, int] = {}  # choice index -> characters of generated text sent
        trackers: dict[int, TextOffsets] = {}
        prompt_lps: dict[int, list] = {}
        num_completion = 0
        cached: dict[int, int] = {}

        def usage() -> UsageInfo:
            return self.usage(num_prompt, num_completion, sum(cached.values()))

        async def chunks() -> AsyncIterator[str]:
            nonlocal num_completion
            async for out in outputs:
                i = index_of[out.request_id]
                if out.num_cached_tokens is not None:
                    cached[i] = out.num_cached_tokens
                if out.prompt_logprobs is not None:
                    prompt_lps[i] = list(out.prompt_logprobs)
                for o in out.outputs:
                    index = i * n + o.index
                    num_completion += len(o.token_ids)
                    text = o.text
                    logprobs = CompletionLogProbs() if num_top is not None else None
                    if request.echo and index not in echoed:
                        echo = self.echo_text(infos[i], bool(o.token_ids))
                        echoed[index] = len(echo)
                        text = echo + text
                        if logprobs is not None:
                            self.add_prompt_logprobs(logprobs, infos[i], echo, prompt_lps.get(i), num_top)
                    elif not o.text and not o.token_ids and o.finish_reason is None:
                        continue
                    if logprobs is not None:
                        tracker = trackers.setdefault(
                            index, TextOffsets(self.tokenizer.backend, infos[i].token_ids, skip_special))
                        sent = generated.get(index, 0)
                        offsets = tracker.advance(o.token_ids, echoed.get(index, 0), sent + len(o.text))
                        self.add_logprobs(logprobs, o.token_ids, o.logprobs or [], num_top, offsets)
                    generated[index] = generated.get(index, 0) + len(o.text)
                    chunk = CompletionStreamResponse(
                        id=cmpl_id, created=created, model=model_name,
                        choices=[CompletionResponseChoice(index=index, text=text, logprobs=logprobs,
                                                          finish_reason=o.finish_reason, stop_reason=o.stop_reason)],
                        usage=usage() if continuous_usage else None)
                    yield f"data: {chunk.model_dump_json(exclude=None if continuous_usage else {'usage'})}\n\n"

        def usage_chunk() -> CompletionStreamResponse:
            return CompletionStreamResponse(id=cmpl_id, created=created, model=model_name, choices=[], usage=usage())

        return self.sse_events(cmpl_id, outputs, chunks(), usage_chunk if include_usage else None)

    # -- echo and logprobs ------------------------------------------------------------------------

    def echo_text(self, info: _Prompt, has_output_tokens: bool) -> str:
        """The prompt as echoed: the prompt string, or the token ids decoded with their special
        tokens. A token prompt ending partway through a character leaves that character to the
        generated text (which completes it or drops it); with no generated tokens it is kept."""
        if info.text is not None:
            return info.text
        ids = info.token_ids[:len(info.token_ids) - info.tail] if has_output_tokens else info.token_ids
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def add_prompt_logprobs(self, result: CompletionLogProbs, info: _Prompt, echo: str,
                            entries: list[dict[int, Logprob] | None] | None, num_top: int) -> None:
        """The echoed prompt's tokens, logprobs (the first token's is None) and offsets in ``echo``."""
        ids = info.token_ids
        offsets = TextOffsets(self.tokenizer.backend, [], skip_special_tokens=False).advance(ids)
        decoded = self.tokenizer.decode(ids, skip_special_tokens=False)
        # Tokens the tokenizer added to a text prompt (a BOS) are not in the echoed string.
        shift = len(decoded) - len(echo) if decoded != echo and decoded.endswith(echo) else 0
        offsets = [min(max(o - shift, 0), len(echo)) for o in offsets]
        entries = list(entries) if entries else [None] * len(ids)
        entries += [None] * (len(ids) - len(entries))
        self.add_logprobs(result, ids, entries, num_top, offsets)

    def add_logprobs(self, result: CompletionLogProbs, token_ids: list[int],
                     entries: list[dict[int, Logprob] | None], num_top: int, offsets: list[int]) -> None:
        """Append OpenAI's completions logprobs: per token its string (``bytes:\\xNN`` for part of a
        character), logprob, top alternatives (the sampled token plus the ``num_top`` most likely)
        and character offset. A token without an entry (a prompt's first) gets None."""
        for token_id, entry, offset in zip(token_ids, entries, offsets):
            result.tokens.append(self.token_str(token_id))
            result.text_offset.append(offset)
            if entry is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            chosen = entry.get(token_id)
            result.token_logprobs.append(None if chosen is None else clamp_logprob(chosen.logprob))
            top: dict[str, float] = {}
            for tid, lp in entry.items():
                if tid == token_id or (lp.rank is not None and lp.rank <= num_top):
                    top.setdefault(self.token_str(tid), clamp_logprob(lp.logprob))
            result.top_logprobs.append(top)
