"""``POST /v1/chat/completions``: messages rendered with the chat template (``chat_utils``), then
generated like a completion; streamed as ``chat.completion.chunk`` events, the role first.

``echo`` (vLLM's field) puts the last message's content before the reply when that message has the
reply's role (``assistant`` with ``add_generation_prompt``, else the last message's own role, as
with ``continue_final_message``). Logprob entries cover the tokens of the reply's text: a stop
token the text leaves out has none, so the entries' ``bytes`` joined give the content.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedllm.engine.async_engine import AsyncLLM, EngineDeadError, EngineStepError, OutputStream
from pagedllm.engine.input_processor import LengthCheck
from pagedllm.entrypoints.chat_utils import (ChatTemplateError, NoChatTemplateError, RenderBudget,
                                             PROMPT_EMBEDS_MARKER, extract_prompt_embeds_parts,
                                             parse_chat_messages, render_chat_prompt)
from pagedllm.entrypoints.openai.errors import bad_request, error_from_exception
from pagedllm.entrypoints.openai.protocol import (BatchChatCompletionRequest, ChatCompletionLogProb,
                                                  ChatCompletionLogProbs,
                                                  ChatCompletionLogProbsContent, ChatCompletionRequest,
                                                  ChatCompletionResponse, ChatCompletionResponseChoice,
                                                  ChatCompletionResponseStreamChoice, ChatCompletionStreamResponse,
                                                  ChatMessage, DeltaMessage, UsageInfo)
from pagedllm.entrypoints.openai.serving_engine import (CHAT_UNSUPPORTED_FIELDS, DEFAULT_MAX_N, MIN_LOGPROB,
                                                       OpenAIServing, clamp_logprob)
from pagedllm.entrypoints.openai.serving_models import OpenAIServingModels
from pagedllm.entrypoints.openai.tool_calls import ToolPlan, parse_tool_calls, plan_tools
from pagedllm.entrypoints.openai.tool_parsers import ToolCallStream, ToolParser
from pagedllm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedllm.reasoning import ReasoningParser, ReasoningStream
from pagedllm.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class OpenAIServingChat(OpenAIServing):
    """Handler of ``/v1/chat/completions``.

    Args:
        engine, models, log_requests: as ``OpenAIServing``.
        chat_template: the server's template text (``--chat-template``); None = the model's own (or
            its ``model_type``'s fallback: ``chat_utils.resolve_chat_template``).
        max_logprobs: the most ``top_logprobs`` a request may ask for.
        max_n: the most choices (``n``) a request may ask for.
        tool_parser: the ``--tool-call-parser`` when the server runs with
            ``--enable-auto-tool-choice`` (``tool_choice: "auto"``), else None.
        pool: as ``OpenAIServing`` (rendering and tokenizing run there).
        trust_request_chat_template: render a ``chat_template`` the request carries
            (``--trust-request-chat-template``); False (vLLM's default): such a request is a 400.
        render_budget: the bounds on rendering a request's template (``RenderBudget``).
        reasoning_parser: the ``--reasoning-parser``, or None: a reply's reasoning part goes to
            ``reasoning`` / ``reasoning_content`` and the tool-call parser sees only the content
            (not under ``tool_choice`` "required" / a named function, whose grammar makes the
            whole reply the call).
    """

    fields = set(ChatCompletionRequest.model_fields)

    def __init__(self, engine: AsyncLLM, models: OpenAIServingModels, chat_template: str | None,
                 max_logprobs: int, log_requests: bool = True, max_n: int = DEFAULT_MAX_N,
                 tool_parser: ToolParser | None = None, pool: concurrent.futures.Executor | None = None,
                 trust_request_chat_template: bool = False, render_budget: RenderBudget = RenderBudget(),
                 reasoning_parser: ReasoningParser | None = None) -> None:
        super().__init__(engine, models, log_requests, max_n, pool)
        self.chat_template = chat_template
        self.max_logprobs = max_logprobs
        self.tool_parser = tool_parser
        self.trust_request_chat_template = trust_request_chat_template
        self.render_budget = render_budget
        self.reasoning_parser = reasoning_parser

    def check_request_chat_template(self, request) -> None:
        """A template in the request (``chat_template``, or ``chat_template_kwargs.chat_template``)
        is Jinja code the server would run: refused unless ``--trust-request-chat-template``
        (vLLM's rule and message, ``OpenAIServing._validate_chat_template``).

        Raises:
            OpenAIError: 400 naming ``chat_template``.
        """
        if self.trust_request_chat_template:
            return
        if request.chat_template is not None or (request.chat_template_kwargs or {}).get("chat_template") is not None:
            raise bad_request("Chat template is passed with request, but --trust-request-chat-template is not set. "
                              "Refused request with untrusted chat template.", param="chat_template")

    def render(self, request) -> dict:
        """Render ``request.messages`` with the request's (when trusted) or the server's template,
        and tokenize it (seconds for a long conversation or a slow template: the handlers call
        it in their pool).

        Raises:
            OpenAIError: 400 for empty or malformed messages, an untrusted request template, a
                model without a template, or a template that rejects the conversation.
        """
        self.check_request_chat_template(request)
        if not request.messages:
            raise bad_request("messages must not be empty", param="messages")
        messages, embeds_data = extract_prompt_embeds_parts(request.messages)
        if embeds_data and request.echo:
            raise bad_request("echo is not supported with prompt_embeds content parts", param="echo")
        kwargs = dict(request.chat_template_kwargs or {})
        template = request.chat_template if request.chat_template is not None else kwargs.get("chat_template")
        kwargs.pop("chat_template", None)
        # A request's own template is metered (RenderBudget); the server's or model's runs free.
        budget = None if template is None else self.render_budget
        if template is None:
            template = self.chat_template
        try:
            prompt = render_chat_prompt(self.tokenizer, messages, template,
                                        add_generation_prompt=bool(request.add_generation_prompt),
                                        continue_final_message=bool(request.continue_final_message),
                                        tools=getattr(request, "tools", None) or None, budget=budget,
                                        **kwargs)
        except NoChatTemplateError as e:
            raise bad_request(str(e)) from e
        except ChatTemplateError as e:   # the template rejected the conversation, or failed itself
            raise bad_request(str(e), param=e.param) from e
        except ValueError as e:
            raise bad_request(str(e), param="messages") from e
        if embeds_data:
            return self._embeds_prompt(prompt["prompt"], embeds_data, bool(request.add_special_tokens))
        if request.add_special_tokens:
            prompt["prompt_token_ids"] = self.tokenizer.encode(prompt["prompt"], add_special_tokens=True)
        return prompt

    def _embeds_prompt(self, text: str, embeds_data: list, add_special_tokens: bool) -> dict:
        """The rendered ``text`` cut at its ``prompt_embeds`` markers: each piece tokenized (special
        tokens added to the first only), each marker replaced by its part's embeddings (vLLM drops
        a part the template does not render).

        Raises:
            OpenAIError: 400 naming ``prompt_embeds``: the server lacks ``--enable-prompt-embeds``,
                a part's data is no fitting tensor, or the template rendered a part twice.
        """
        from pagedllm.engine.prompt_embeds import mixed_prompt

        pieces, tensors = [text], []
        try:
            for i, data in enumerate(embeds_data):
                tensor = self.engine.load_prompt_embeds(data)
                marker = PROMPT_EMBEDS_MARKER.format(i)
                count = text.count(marker)
                if count > 1:
                    raise ValueError(f"prompt_embeds content part {i} is rendered {count} times by the chat template")
                if count == 1:
                    head, tail = pieces[-1].split(marker)
                    pieces[-1:] = [head, tail]
                    tensors.append(tensor)
        except ValueError as e:
            raise bad_request(str(e), param="prompt_embeds") from e
        segments = [self.tokenizer.encode(p, add_special_tokens=add_special_tokens and i == 0) if p else []
                    for i, p in enumerate(pieces)]
        return {"prompt": text, **mixed_prompt(segments, tensors)}

    def plan_tools_and_constraint(self, request, format_fields: str = "response_format or structured_outputs",
                                  tool_choice=None) -> tuple:
        """(``ToolPlan``, the reply's constraint, the ``ConstraintOrigin`` naming its field): a
        forced tool call's grammar, else the request's own.

        Args:
            request: a ``ChatCompletionRequest``.
            format_fields: how the error names the request's own constraint fields.
            tool_choice: the value the error shows (the request's own when None).
        Raises:
            OpenAIError: 400 naming ``tool_choice`` when a forced call meets another constraint; as
                ``plan_tools`` and ``structured_outputs``.
        """
        tool_plan = plan_tools(request.tools, request.tool_choice, request.parallel_tool_calls, self.tool_parser)
        structured_outputs, origin = self.structured_outputs(request)
        if tool_plan.structured_outputs is not None:
            if structured_outputs is not None:
                shown = request.tool_choice if tool_choice is None else tool_choice
                raise bad_request(f"tool_choice={shown!r} constrains the reply to a tool call; it "
                                  f"cannot be combined with {format_fields}", param="tool_choice")
            structured_outputs, origin = tool_plan.structured_outputs, tool_plan.origin
        return tool_plan, structured_outputs, origin

    async def create_chat_completion(self, request: ChatCompletionRequest,
                                     raw_request: Request | None = None) -> Response:
        """Validate and render (400 before any event is streamed), queue one engine request with
        ``n`` samples, and answer with a JSON body or an SSE stream.

        Raises:
            OpenAIError: 400 for invalid input, 404 for an unknown model.
        """
        arrival_time = time.monotonic()
        model_name = self.models.resolve(request.model)
        self.check_unsupported_fields(request, CHAT_UNSUPPORTED_FIELDS)
        self.warn_unknown_fields(request, CHAT_UNSUPPORTED_FIELDS)
        beam_search = self.check_beam_search(request)
        if beam_search and self.models.lora_for(model_name) is not None:
            raise bad_request("use_beam_search does not run with LoRA adapters", param="use_beam_search")
        stream = bool(request.stream)
        n = 1 if request.n is None else request.n
        self.check_n(n)
        if request.stream_options is not None and not stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        tool_plan, structured_outputs, origin = self.plan_tools_and_constraint(request)
        num_top = None
        if request.logprobs:
            num_top = 0 if request.top_logprobs is None else request.top_logprobs
        elif request.top_logprobs:
            raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
        if num_top is not None and not 0 <= num_top <= self.max_logprobs:
            raise bad_request(f"top_logprobs must be in [0, {self.max_logprobs}], got {num_top}", param="top_logprobs")
        prompt = await self.run_in_pool(self.render, request)   # off the event loop
        echo = self.echo_content(request)
        max_tokens, max_tokens_field = self.requested_max_tokens(request)
        kind = RequestOutputKind.DELTA if stream else RequestOutputKind.FINAL_ONLY
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        try:
            if beam_search and structured_outputs is not None:
                raise ValueError("use_beam_search cannot be combined with a structured output constraint "
                                 "(response_format, structured_outputs, guided_*, tools)")
            # Beam search: the prompt is processed as a plain greedy request, then runs as beams.
            base = SamplingParams(max_tokens=max_tokens, temperature=0.0) if beam_search else \
                self.sampling_params(request, max_tokens, num_top, kind, structured_outputs=structured_outputs)
            processed = await self.run_in_pool(self.engine.process_inputs, prompt, base,
                                               LengthCheck(max_tokens_field, "messages"))
            processed = processed.with_lora(self.models.lora_for(model_name))   # the adapter `model` names
            ids = processed.prompt_token_ids
            self.log_request(request_id, processed.prompt, len(ids), processed.params)
            beam = self.beam_search_params(request, processed.params.max_tokens) if beam_search else None
            outputs = self.engine.add_request(request_id, processed, beam, arrival_time=arrival_time,
                                              trace_headers=self.trace_headers(raw_request))
        except Exception as e:
            raise error_from_exception(e, self.fields, prompt_param="messages", constraint=origin) from e
        created = int(time.time())
        if stream:
            return StreamingResponse(self._stream(request, outputs, request_id, created, model_name, n, len(ids),
                                                  num_top, echo, tool_plan), media_type="text/event-stream")
        final: RequestOutput | None = None
        try:
            async for out in outputs:
                if out.finished:
                    final = out
        except (EngineStepError, EngineDeadError) as e:
            raise error_from_exception(e) from e
        finally:
            outputs.abort()
        choices = []
        num_completion = 0
        for o in final.outputs:
            num_completion += len(o.token_ids)
            logprobs = None
            if num_top is not None:
                logprobs = ChatCompletionLogProbs(content=self.chat_logprobs(*self.text_tokens(o), num_top))
            text, reasoning = o.text, None
            if self._parses_reasoning(tool_plan):
                reasoning, text = self.reasoning_parser.extract_reasoning(o.text, request.chat_template_kwargs)
                text = text or ""
            message = ChatMessage(role="assistant", content=(echo + text) or (None if reasoning else ""),
                                  reasoning=reasoning, reasoning_content=reasoning)
            finish_reason = o.finish_reason
            if tool_plan.mode == "auto":  # the model's own call format, found by the parser
                found = tool_plan.parser.extract_tool_calls(text)
                if found.tools_called:
                    message = ChatMessage(role="assistant", content=found.content, tool_calls=found.tool_calls,
                                          reasoning=reasoning, reasoning_content=reasoning)
                    finish_reason = "tool_calls"
            else:
                tool_calls = parse_tool_calls(tool_plan, o.text)
                if tool_calls is not None:
                    message = ChatMessage(role="assistant", content=None, tool_calls=tool_calls)
                    finish_reason = _tool_finish_reason(tool_plan, o.finish_reason)
            choices.append(ChatCompletionResponseChoice(
                index=o.index, message=message, logprobs=logprobs,
                finish_reason=finish_reason, stop_reason=o.stop_reason))
        choices.sort(key=lambda c: c.index)
        response = ChatCompletionResponse(id=request_id, created=created, model=model_name, choices=choices,
                                          usage=self.usage(len(ids), num_completion, final.num_cached_tokens))
        return JSONResponse(response.model_dump())

    async def create_batch_chat_completion(self, request: BatchChatCompletionRequest,
                                           raw_request: Request | None = None) -> Response:
        """``/v1/chat/completions/batch``: each conversation as its own ``/v1/chat/completions``
        request (same fields, ``n`` 1), run together; one response whose choice ``i`` answers
        conversation ``i`` and whose usage is the sum. A conversation's error (400, ...) is the
        response's; the others are then aborted.

        Raises:
            OpenAIError: 400 for ``stream``, ``tools``, ``use_beam_search``, ``n`` > 1, an empty
                conversation or any conversation's invalid input; 404 for an unknown model.
        """
        model_name = self.models.resolve(request.model)
        fields = request.model_dump(exclude_unset=True)
        for field, refused in (("stream", bool(request.stream)), ("tools", bool(request.tools)),
                               ("use_beam_search", bool(fields.get("use_beam_search"))),
                               ("n", request.n not in (None, 1))):
            if refused:
                raise bad_request(f"{field} is not supported by /v1/chat/completions/batch", param=field)
        for i, conversation in enumerate(request.messages):
            if not conversation:
                raise bad_request(f"messages[{i}] is an empty conversation", param="messages")
        tasks = [asyncio.ensure_future(self.create_chat_completion(
                     ChatCompletionRequest.model_validate({**fields, "messages": conversation}), raw_request))
                 for conversation in request.messages]
        try:
            answers = [ChatCompletionResponse.model_validate_json(r.body) for r in await asyncio.gather(*tasks)]
        except BaseException:
            for task in tasks:
                task.cancel()   # their handlers abort their engine requests
            raise
        choices = [choice.model_copy(update={"index": i}) for i, a in enumerate(answers) for choice in a.choices]
        num_cached = sum(a.usage.prompt_tokens_details.cached_tokens for a in answers
                         if a.usage.prompt_tokens_details is not None)
        response = ChatCompletionResponse(
            id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=model_name, choices=choices,
            usage=self.usage(sum(a.usage.prompt_tokens for a in answers),
                             sum(a.usage.completion_tokens for a in answers), num_cached))
        return JSONResponse(response.model_dump())

    def _stream(self, request: ChatCompletionRequest, outputs: OutputStream, request_id: str, created: int,
                model_name: str, n: int, num_prompt: int, num_top: int | None,
                echo: str = "", tool_plan: ToolPlan | None = None) -> AsyncIterator[str]:
        options = request.stream_options
        include_usage = bool(options and options.include_usage)
        continuous_usage = bool(options and options.continuous_usage_stats)
        num_completion = 0
        num_cached = None

        def usage() -> UsageInfo:
            return self.usage(num_prompt, num_completion, num_cached)

        def chunk(index: int, delta: DeltaMessage, logprobs=None, finish_reason=None, stop_reason=None) -> str:
            body = ChatCompletionStreamResponse(
                id=request_id, created=created, model=model_name,
                choices=[ChatCompletionResponseStreamChoice(index=index, delta=delta, logprobs=logprobs,
                                                            finish_reason=finish_reason, stop_reason=stop_reason)],
                usage=usage() if continuous_usage else None)
            return f"data: {body.model_dump_json(exclude=None if continuous_usage else {'usage'})}\n\n"

        tool_text: dict[int, str] = {}  # [tools] a call is sent whole once its sample ends
        auto_streams: dict[int, ToolCallStream] = {}  # [tools] "auto": one parser state per choice
        reasoning_streams: dict[int, ReasoningStream] = {}  # --reasoning-parser: one state per choice

        async def chunks() -> AsyncIterator[str]:
            nonlocal num_completion, num_cached
            for index in range(n):
                yield chunk(index, DeltaMessage(role="assistant", content=""))
            if echo:
                for index in range(n):
                    yield chunk(index, DeltaMessage(content=echo))
            async for out in outputs:
                num_cached = out.num_cached_tokens if out.num_cached_tokens is not None else num_cached
                for o in out.outputs:
                    num_completion += len(o.token_ids)
                    if self._parses_reasoning(tool_plan):
                        stream = reasoning_streams.setdefault(
                            o.index, ReasoningStream(self.reasoning_parser, request.chat_template_kwargs))
                        reasoning, content = stream.feed(o.text, final=o.finish_reason is not None)
                        if reasoning:
                            yield chunk(o.index, DeltaMessage(reasoning=reasoning, reasoning_content=reasoning))
                        o = dataclasses.replace(o, text=content)  # the rest of the path sees the content
                    if tool_plan is not None and tool_plan.mode == "auto":
                        for piece in self._auto_tool_chunks(auto_streams, tool_plan.parser, o, num_top, chunk):
                            yield piece
                        continue
                    if tool_plan is not None and tool_plan.mode != "none":
                        tool_text[o.index] = tool_text.get(o.index, "") + o.text
                        if o.finish_reason is None:
                            continue
                        calls = parse_tool_calls(tool_plan, tool_text[o.index])
                        if calls is None:  # cut short: the text as content
                            yield chunk(o.index, DeltaMessage(content=tool_text[o.index]))
                            yield chunk(o.index, DeltaMessage(), None, o.finish_reason, o.stop_reason)
                            continue
                        # The OpenAI client accumulates delta.tool_calls by index.
                        yield chunk(o.index, DeltaMessage(tool_calls=[{"index": k, **call}
                                                                      for k, call in enumerate(calls)]))
                        yield chunk(o.index, DeltaMessage(), None, _tool_finish_reason(tool_plan, o.finish_reason),
                                    o.stop_reason)
                        continue
                    if not o.text and o.finish_reason is None and (num_top is None or not o.token_ids):
                        continue
                    logprobs = None
                    if num_top is not None:
                        logprobs = ChatCompletionLogProbs(content=self.chat_logprobs(*self.text_tokens(o), num_top))
                    delta = DeltaMessage(content=o.text) if o.text or o.finish_reason is None else DeltaMessage()
                    yield chunk(o.index, delta, logprobs, o.finish_reason, o.stop_reason)

        def usage_chunk() -> ChatCompletionStreamResponse:
            return ChatCompletionStreamResponse(id=request_id, created=created, model=model_name, choices=[],
                                                usage=usage())

        return self.sse_events(request_id, outputs, chunks(), usage_chunk if include_usage else None)

    def _auto_tool_chunks(self, streams: dict[int, ToolCallStream], parser: ToolParser, o: CompletionOutput,
                          num_top: int | None, chunk) -> list[str]:
        """The SSE chunks of one output delta under ``tool_choice: "auto"``: content the parser
        knows is content, each complete call as a ``delta.tool_calls`` entry with its ``index``,
        and at the end the rest (finish_reason "tool_calls" when a call was sent)."""
        stream = streams.setdefault(o.index, ToolCallStream(parser))
        content, calls = stream.feed(o.text)
        pieces = []
        logprobs = None
        if num_top is not None and o.token_ids:
            logprobs = ChatCompletionLogProbs(content=self.chat_logprobs(*self.text_tokens(o), num_top))
        if content or logprobs is not None:
            pieces.append(chunk(o.index, DeltaMessage(content=content) if content else DeltaMessage(), logprobs))
        if o.finish_reason is not None:
            rest, more = stream.finish()
            if rest:
                pieces.append(chunk(o.index, DeltaMessage(content=rest)))
            calls = calls + more
        if calls:
            pieces.append(chunk(o.index, DeltaMessage(tool_calls=calls)))
        if o.finish_reason is not None:
            reason = "tool_calls" if stream.tools_called else o.finish_reason
            pieces.append(chunk(o.index, DeltaMessage(), None, reason, o.stop_reason))
        return pieces

    def _parses_reasoning(self, tool_plan: ToolPlan | None) -> bool:
        """Whether replies go through the reasoning parser: one is set and the reply is free text
        (no tool call forced by a grammar)."""
        return self.reasoning_parser is not None and (tool_plan is None or tool_plan.mode in ("none", "auto"))

    @staticmethod
    def echo_content(request: ChatCompletionRequest) -> str:
        """With ``echo``: the last message's text when its role is the reply's (``assistant`` when
        a generation prompt is added, else the last message's role), else ""."""
        if not request.echo:
            return ""
        last = parse_chat_messages(request.messages)[-1]
        role = "assistant" if request.add_generation_prompt else last["role"]
        return last.get("content") or "" if last["role"] == role else ""

    @staticmethod
    def text_tokens(o: CompletionOutput) -> tuple[list[int], list[dict[int, Logprob] | None]]:
        """The sample's token ids and logprob entries, less a final stop token (EOS or a
        ``stop_token_ids`` id, which the content never holds)."""
        token_ids, entries = list(o.token_ids), list(o.logprobs or [])
        if (o.finish_reason == "stop" and isinstance(o.stop_reason, int) and token_ids
                and token_ids[-1] == o.stop_reason):
            token_ids, entries = token_ids[:-1], entries[:len(token_ids) - 1]
        return token_ids, entries

    def chat_logprobs(self, token_ids: list[int], entries: list[dict[int, Logprob] | None],
                      num_top: int) -> list[ChatCompletionLogProbsContent]:
        """OpenAI's chat logprobs: per token its string (``bytes:\\xNN`` when it is part of a
        character), logprob, exact bytes and the ``num_top`` most likely alternatives (by rank)."""
        content = []
        for token_id, entry in zip(token_ids, entries):
            if entry is None:
                continue
            chosen = entry.get(token_id)
            ranked = sorted(((lp.rank, tid, lp) for tid, lp in entry.items()
                             if lp.rank is not None and lp.rank <= num_top), key=lambda x: x[0])[:num_top]
            top = [ChatCompletionLogProb(token=self.token_str(tid), logprob=clamp_logprob(lp.logprob),
                                         bytes=self.token_bytes(tid)) for _, tid, lp in ranked]
            content.append(ChatCompletionLogProbsContent(
                token=self.token_str(token_id),
                logprob=clamp_logprob(chosen.logprob) if chosen is not None else MIN_LOGPROB,
                bytes=self.token_bytes(token_id), top_logprobs=top))
        return content


def _tool_finish_reason(plan: ToolPlan, finish_reason: str | None) -> str | None:
    """"tool_calls" for a complete call under ``tool_choice: "required"``; a named function keeps
    "stop", as OpenAI answers a forced function."""
    return "tool_calls" if plan.mode == "required" and finish_reason == "stop" else finish_reason
