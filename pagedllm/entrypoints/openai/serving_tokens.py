"""vLLM's token-in / token-out API (behind ``--enable-scale-out``, off by default):
``POST /inference/v1/generate`` takes prompt token ids and a ``sampling_params`` object and answers
with the generated token ids (``output_mode: "tokens"``, the default) or text (``"text"``), as JSON
or as server-sent events (``stream``); ``POST /inference/v1/abort_requests`` aborts requests by id.

The field names are vLLM's (``vllm/entrypoints/scale_out/token_in_token_out/protocol.py``,
vLLM 0.33): a request ``{"token_ids": [...], "sampling_params": {...}, "stream": false,
"request_id": ..., "output_mode": ..., "return_token_ids": ...}``; a response ``{"request_id",
"model", "created", "output_mode", "choices": [{"index", "token_ids", "finish_reason",
"stop_reason", "logprobs"}], "usage", "prompt_token_ids"}``; a streamed chunk the same with each
choice's new ``token_ids`` (and ``text``), then ``data: [DONE]``. Multimodal features, the
``"derender"`` output mode and disaggregated-serving parameters are not served (400 naming them).

``sampling_params`` takes ``SamplingParams``' fields plus vLLM's ``detokenize`` (False: no text is
made for the response; the engine still detokenizes for stop strings). Without ``max_tokens``
a request may generate up to ``max_model_len`` (vLLM's rule on this route, unlike the 16 of
``SamplingParams``).
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from typing import Any, AsyncIterator, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, Field

from pagedllm.engine.async_engine import OutputStream
from pagedllm.engine.input_processor import LengthCheck
from pagedllm.entrypoints.openai.errors import bad_request, error_from_exception
from pagedllm.entrypoints.openai.protocol import OpenAIBaseModel, StreamOptions, UsageInfo
from pagedllm.entrypoints.openai.serving_engine import OpenAIServing, clamp_logprob, run_until_disconnect
from pagedllm.outputs import CompletionOutput, Logprob
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

# SamplingParams fields a client may set here (the private ones and the engine-side objects not).
_CLIENT_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)
                  if not f.name.startswith("_") and f.name not in ("output_kind", "logits_processors",
                                                                   "structured_outputs")}
# vLLM request fields this server does not serve: a 400 naming them when set.
_UNSERVED = ("features", "content_parts", "token_offsets", "parse_context", "kv_transfer_params",
             "ec_transfer_params", "reasoning_parser_kwargs")


class GenerateRequest(OpenAIBaseModel):
    request_id: str | None = None
    token_ids: list[int] = Field(min_length=1)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    model: str | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    output_mode: Literal["tokens", "text", "derender"] = "tokens"
    return_token_ids: bool | None = None
    cache_salt: str | None = None
    priority: int = 0


class GenerateLogProb(BaseModel):
    token_id: int
    logprob: float
    rank: int | None = None


class GenerateLogProbsContent(GenerateLogProb):
    top_logprobs: list[GenerateLogProb] = []


class GenerateLogProbs(BaseModel):
    content: list[GenerateLogProbsContent] | None = None


class GenerateChoice(BaseModel):
    index: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    text: str | None = None
    logprobs: GenerateLogProbs | None = None


class GenerateResponse(BaseModel):
    request_id: str
    model: str | None = None
    created: int | None = None
    output_mode: Literal["tokens", "text"] = "tokens"
    choices: list[GenerateChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None


class AbortRequests(BaseModel):
    request_ids: list[str]


def _dump(response: GenerateResponse) -> dict[str, Any]:
    """The JSON body: ``finish_reason`` / ``stop_reason`` / ``logprobs`` stay (null included, as
    vLLM's); ``text`` only in text mode, ``usage`` and ``prompt_token_ids`` only when set."""
    body = response.model_dump()
    for key in ("usage", "prompt_token_ids"):
        if body[key] is None:
            del body[key]
    if response.output_mode == "tokens":
        for choice in body["choices"]:
            del choice["text"]
    return body


def _logprobs(token_ids: list[int], entries: list[dict[int, Logprob]] | None,
              num_top: int | None) -> GenerateLogProbs | None:
    """Per generated token: its id, logprob and rank, and the ``num_top`` most likely alternatives."""
    if num_top is None:
        return None
    content = []
    for token_id, entry in zip(token_ids, entries or []):
        chosen = entry.get(token_id)
        top = [GenerateLogProb(token_id=t, logprob=clamp_logprob(lp.logprob), rank=lp.rank)
               for t, lp in sorted(entry.items(), key=lambda kv: kv[1].rank or 0)
               if lp.rank is not None and lp.rank <= num_top]
        content.append(GenerateLogProbsContent(
            token_id=token_id, logprob=clamp_logprob(chosen.logprob) if chosen else float("-inf"),
            rank=chosen.rank if chosen else None, top_logprobs=top))
    return GenerateLogProbs(content=content)


class OpenAIServingTokens(OpenAIServing):
    """Handler of ``/inference/v1/generate``."""

    def sampling_params_from(self, values: dict[str, Any], stream: bool) -> tuple[SamplingParams, bool]:
        """The request's ``sampling_params`` object -> (``SamplingParams``, detokenize).

        Raises:
            OpenAIError: 400 naming ``sampling_params.<key>`` for a key ``SamplingParams`` does
                not have, or the field ``SamplingParams`` rejects.
        """
        values = dict(values)
        detokenize = values.pop("detokenize", True)
        if not isinstance(detokenize, bool):
            raise bad_request(f"sampling_params.detokenize must be a boolean, got {detokenize!r}",
                              param="sampling_params.detokenize")
        for key in values:
            if key not in _CLIENT_FIELDS:
                raise bad_request(f"sampling_params.{key} is not a sampling parameter (known: {sorted(_CLIENT_FIELDS)})",
                                  param=f"sampling_params.{key}")
        values.setdefault("max_tokens", None)   # vLLM: up to the context length on this route
        if "logit_bias" in values and isinstance(values["logit_bias"], dict):
            values["logit_bias"] = {int(k): v for k, v in values["logit_bias"].items()}
        try:
            params = SamplingParams(**values)
        except (ValueError, TypeError) as e:
            first = str(e).split(" ", 1)[0]
            raise bad_request(str(e), param=f"sampling_params.{first}" if first in _CLIENT_FIELDS
                              else "sampling_params") from None
        params.output_kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        return params, detokenize

    async def generate(self, request: GenerateRequest) -> Response:
        """Validate (400 before anything is queued), queue one engine request, answer.

        Raises:
            OpenAIError: 400 for invalid input, 404 for an unknown model.
        """
        arrival_time = time.monotonic()
        model_name = self.models.resolve(request.model)
        for name in _UNSERVED:
            if (request.model_extra or {}).get(name) is not None:
                raise bad_request(f"{name} is not served by this server's generate route", param=name)
        if request.output_mode == "derender":
            raise bad_request("output_mode 'derender' is not served (use 'tokens' or 'text')", param="output_mode")
        stream = bool(request.stream)
        if request.stream_options is not None and not stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        params, detokenize = self.sampling_params_from(request.sampling_params, stream)
        if request.output_mode == "text" and not detokenize:
            raise bad_request("output_mode 'text' needs sampling_params.detokenize true",
                              param="sampling_params.detokenize")
        self.check_n(params.n, params.best_of)
        request_id = f"generate-tokens-{request.request_id or uuid.uuid4().hex}"
        try:
            processed = await self.run_in_pool(self.engine.process_inputs, {"prompt_token_ids": list(request.token_ids)},
                                               params, LengthCheck("sampling_params.max_tokens"))
            processed = processed.with_lora(self.models.lora_for(model_name))
            self.log_request(request_id, processed.prompt, len(processed.prompt_token_ids), processed.params)
            outputs = self.engine.add_requests([(request_id, processed, None)], arrival_time=arrival_time)
        except Exception as e:
            raise error_from_exception(e, {"token_ids"}, prompt_param="token_ids") from e
        created = int(time.time())
        prompt_ids = list(processed.prompt_token_ids) if request.return_token_ids else None
        text_mode = request.output_mode == "text"
        num_top = params.logprobs
        if stream:
            return StreamingResponse(self._stream(request, outputs, request_id, created, model_name, prompt_ids,
                                                  text_mode, num_top), media_type="text/event-stream")
        out = (await self.final_outputs(outputs))[request_id]
        choices = [self._choice(o, text_mode, num_top) for o in out.outputs]
        num_prompt = len(out.prompt_token_ids)
        usage = self.usage(num_prompt, sum(len(o.token_ids) for o in out.outputs), out.num_cached_tokens)
        body = GenerateResponse(request_id=request_id, model=model_name, created=created,
                                output_mode=request.output_mode, choices=choices, usage=usage,
                                prompt_token_ids=prompt_ids)
        return JSONResponse(_dump(body))

    @staticmethod
    def _choice(o: CompletionOutput, text_mode: bool, num_top: int | None) -> GenerateChoice:
        return GenerateChoice(index=o.index, finish_reason=o.finish_reason, stop_reason=o.stop_reason,
                              token_ids=list(o.token_ids), text=o.text if text_mode else None,
                              logprobs=_logprobs(list(o.token_ids), o.logprobs, num_top))

    def _stream(self, request: GenerateRequest, outputs: OutputStream, request_id: str, created: int,
                model_name: str, prompt_ids: list[int] | None, text_mode: bool,
                num_top: int | None) -> AsyncIterator[str]:
        options = request.stream_options
        include_usage = bool(options and options.include_usage)
        counts = {"prompt": 0, "completion": 0, "cached": 0}

        def usage() -> UsageInfo:
            return self.usage(counts["prompt"], counts["completion"], counts["cached"])

        async def chunks() -> AsyncIterator[str]:
            first = True
            async for out in outputs:
                counts["prompt"] = len(out.prompt_token_ids)
                counts["cached"] = out.num_cached_tokens or 0
                for o in out.outputs:
                    if not o.token_ids and o.finish_reason is None:
                        continue
                    counts["completion"] += len(o.token_ids)
                    chunk = GenerateResponse(request_id=request_id, model=model_name, created=created,
                                             output_mode=request.output_mode,
                                             choices=[self._choice(o, text_mode, num_top)],
                                             prompt_token_ids=prompt_ids if first else None)
                    first = False
                    yield f"data: {json.dumps(_dump(chunk))}\n\n"

        def usage_chunk() -> GenerateResponse:
            return GenerateResponse(request_id=request_id, model=model_name, created=created,
                                    output_mode=request.output_mode, choices=[], usage=usage())

        return self.sse_events(request_id, outputs, chunks(), usage_chunk if include_usage else None)


def add_token_routes(app: FastAPI, state) -> None:
    """``/inference/v1/generate`` and ``/inference/v1/abort_requests`` on ``app`` (``state``: the
    ``ServerState``: its ``tokens`` handler and ``engine``)."""

    @app.post("/inference/v1/generate")
    async def generate(request: GenerateRequest, raw_request: Request):
        return await run_until_disconnect(state.tokens.generate(request), raw_request)

    @app.post("/inference/v1/abort_requests")
    async def abort_requests(request: AbortRequests):
        await state.engine.abort_requests(request.request_ids)   # their streams end with finish_reason "abort"
        return Response(status_code=200)
