"""``POST /v1/completions``: prompts (text, list of texts, token ids, list of token-id lists),
``echo``, ``logprobs``, ``n``, ``best_of``, ``stop``, ``seed``, ``logit_bias``; streamed as
server-sent events (``data: {...}`` chunks, then ``data: [DONE]``)."""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedllm.core.sched_output import Logprob
from pagedllm.engine.async_engine import EngineDeadError, EngineStepError, OutputStream
from pagedllm.entrypoints.openai.protocol import (CompletionLogProbs, CompletionRequest, CompletionResponse,
                                                  CompletionResponseChoice, CompletionStreamResponse, UsageInfo)
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing, bad_request, clamp_logprob, error_from_exception
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import RequestOutputKind

logger = logging.getLogger(__name__)


@dataclass
class _Prompt:
    text: str
    token_ids: list[int]


def _parse_prompts(prompt) -> list[str | list[int]]:
    """The request's ``prompt`` as a list of engine prompts.

    Raises:
        OpenAIError: 400 for an empty prompt (``""``, ``[]``, ``[[]]``) or a mixed list.
    """
    empty = bad_request("prompt must not be empty", param="prompt")
    if isinstance(prompt, str):
        if not prompt:
            raise empty
        return [prompt]
    if not prompt:
        raise empty
    if all(isinstance(p, int) and not isinstance(p, bool) for p in prompt):
        return [list(prompt)]
    if all(isinstance(p, str) for p in prompt):
        if any(not p for p in prompt):
            raise empty
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
        self.warn_unknown_fields(request)
        if request.suffix:
            raise bad_request("suffix is not supported: no model served here can insert text (fill-in-the-middle)",
                              param="suffix")
        stream = bool(request.stream)
        n = 1 if request.n is None else request.n
        if request.best_of is not None:
            if stream and request.best_of > 1:
                raise bad_request(f"best_of={request.best_of} cannot be streamed: the best completions are known "
                                  "only at the end", param="best_of")
            if request.best_of < n:
                raise bad_request(f"best_of must be >= n ({n}), got {request.best_of}", param="best_of")
        if request.stream_options is not None and not stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        prompts = _parse_prompts(request.prompt)
        max_tokens = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        num_top = request.logprobs
        prompt_logprobs = request.prompt_logprobs
        if request.echo and num_top is not None:
            prompt_logprobs = max(prompt_logprobs or 0, num_top)
        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        best_of = request.best_of if request.best_of is not None and request.best_of > n else None
        try:
            base = self.sampling_params(request, max_tokens, num_top, kind, best_of, prompt_logprobs)
            cmpl_id = f"cmpl-{uuid.uuid4().hex}"
            engine_requests, infos = [], []
            for i, prompt in enumerate(prompts):
                if isinstance(prompt, str) and request.add_special_tokens is False:
                    prompt = {"prompt": prompt,
                              "prompt_token_ids": self.tokenizer.encode(prompt, add_special_tokens=False)}
                processed = self.engine.process_inputs(prompt, base)
                ids = processed.prompt_token_ids
                effective = self.check_max_tokens(len(ids), max_tokens)
                params = self.sampling_params(request, effective, num_top, kind, best_of, prompt_logprobs)
                text = processed.prompt if processed.prompt is not None else \
                    self.tokenizer.decode(ids, skip_special_tokens=False)
                request_id = f"{cmpl_id}-{i}"
                engine_requests.append((request_id, {"prompt": processed.prompt, "prompt_token_ids": ids}, params))
                infos.append(_Prompt(text, ids))
                self.log_request(request_id, processed.prompt, len(ids), params)
            outputs = self.engine.add_requests(engine_requests, arrival_time=arrival_time)
        except Exception as e:
            raise error_from_exception(e, self.fields) from e
        created = int(time.time())
        if stream:
            return StreamingResponse(self._stream(request, outputs, cmpl_id, created, model_name, infos, n),
                                     media_type="text/event-stream")
        finals: dict[str, RequestOutput] = {}
        try:
            async for out in outputs:
                if out.finished:
                    finals[out.request_id] = out
        except (EngineStepError, EngineDeadError) as e:
            raise error_from_exception(e) from e
        finally:
            outputs.abort()
        choices = []
        num_prompt = num_completion = 0
        for i, (request_id, info) in enumerate(zip(outputs.request_ids, infos)):
            out = finals[request_id]
            num_prompt += len(info.token_ids)
            for o in out.outputs:
                num_completion += len(o.token_ids)
                text = info.text + o.text if request.echo else o.text
                logprobs = None
                if num_top is not None:
                    token_ids, entries = list(o.token_ids), list(o.logprobs or [])
                    if request.echo:
                        token_ids = info.token_ids + token_ids
                        entries = list(out.prompt_logprobs or [None] * len(info.token_ids)) + entries
                    logprobs = self.completion_logprobs(token_ids, entries, num_top, 0)
                choices.append(CompletionResponseChoice(index=i * n + o.index, text=text, logprobs=logprobs,
                                                        finish_reason=o.finish_reason, stop_reason=o.stop_reason))
        choices.sort(key=lambda c: c.index)
        response = CompletionResponse(id=cmpl_id, created=created, model=model_name, choices=choices,
                                      usage=self.usage(num_prompt, num_completion,
                                                       sum(finals[r].num_cached_tokens or 0 for r in finals)))
        return JSONResponse(response.model_dump())

    async def _stream(self, request: CompletionRequest, outputs: OutputStream, cmpl_id: str, created: int,
                      model_name: str, infos: list[_Prompt], n: int) -> AsyncIterator[str]:
        include_usage = bool(request.stream_options and request.stream_options.include_usage)
        exclude = None if include_usage else {"usage"}
        num_top = request.logprobs
        index_of = {rid: i for i, rid in enumerate(outputs.request_ids)}
        echoed: set[int] = set()
        offsets: dict[int, int] = {}
        prompt_lps: dict[int, list] = {}
        num_completion = 0
        cached: dict[int, int] = {}
        try:
            async for out in outputs:
                i = index_of[out.request_id]
                if out.num_cached_tokens is not None:
                    cached[i] = out.num_cached_tokens
                if out.prompt_logprobs is not None:
                    prompt_lps[i] = list(out.prompt_logprobs)
                for o in out.outputs:
                    index = i * n + o.index
                    num_completion += len(o.token_ids)
                    text, token_ids, entries = o.text, list(o.token_ids), list(o.logprobs or [])
                    if request.echo and index not in echoed:
                        echoed.add(index)
                        text = infos[i].text + text
                        token_ids = infos[i].token_ids + token_ids
                        entries = prompt_lps.get(i, [None] * len(infos[i].token_ids)) + entries
                    if not text and not token_ids and o.finish_reason is None:
                        continue
                    logprobs = None
                    if num_top is not None:
                        logprobs = self.completion_logprobs(token_ids, entries, num_top, offsets.get(index, 0))
                    offsets[index] = offsets.get(index, 0) + len(text)
                    chunk = CompletionStreamResponse(
                        id=cmpl_id, created=created, model=model_name,
                        choices=[CompletionResponseChoice(index=index, text=text, logprobs=logprobs,
                                                          finish_reason=o.finish_reason, stop_reason=o.stop_reason)])
                    yield f"data: {chunk.model_dump_json(exclude=exclude)}\n\n"
            if include_usage:
                num_prompt = sum(len(info.token_ids) for info in infos)
                usage = self.usage(num_prompt, num_completion, sum(cached.values()))
                chunk = CompletionStreamResponse(id=cmpl_id, created=created, model=model_name, choices=[],
                                                 usage=usage)
                yield f"data: {chunk.model_dump_json()}\n\n"
        except (EngineStepError, EngineDeadError) as e:
            logger.error("request %s failed: %s", cmpl_id, e)
            yield f"data: {json.dumps(error_from_exception(e).to_body())}\n\n"
        finally:
            outputs.abort()
        yield "data: [DONE]\n\n"

    def completion_logprobs(self, token_ids: list[int], entries: list[dict[int, Logprob] | None], num_top: int,
                            initial_offset: int) -> CompletionLogProbs:
        """OpenAI's completions logprobs: per token its text, logprob, top alternatives (the sampled
        token plus the ``num_top`` most likely) and character offset. A prompt's first token has no
        logprob (None)."""
        result = CompletionLogProbs()
        offset = initial_offset
        for token_id, entry in zip(token_ids, entries):
            chosen = None if entry is None else entry.get(token_id)
            token = self.token_str(token_id, chosen)
            result.tokens.append(token)
            result.text_offset.append(offset)
            offset += len(token)
            if entry is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            result.token_logprobs.append(None if chosen is None else clamp_logprob(chosen.logprob))
            top: dict[str, float] = {}
            for tid, lp in entry.items():
                if tid == token_id or (lp.rank is not None and lp.rank <= num_top):
                    top.setdefault(self.token_str(tid, lp), clamp_logprob(lp.logprob))
            result.top_logprobs.append(top)
        return result
