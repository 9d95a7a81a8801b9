"""The asynchronous engine: one ``LLMEngine`` loop in a background thread, shared by every caller.

``AsyncLLM`` runs the synchronous ``LLMEngine`` in ONE daemon thread (torch releases the GIL inside
its kernels, so the asyncio event loop keeps serving HTTP while a step runs). The thread loops:

1. drain the thread-safe inbox of new requests and aborts (under a ``threading.Condition``);
2. ``engine.step()`` when any request is unfinished, so a request added by any client joins the
   running batch at the next iteration (continuous batching across clients);
3. push each ``RequestOutput`` to its caller's ``asyncio.Queue`` with
   ``loop.call_soon_threadsafe`` (one call per event loop per step);
4. sleep on the condition when idle (no busy spin), waking for new work, an abort, shutdown, or
   the periodic stats log line.

Callers validate synchronously: :meth:`AsyncLLM.add_requests` runs the (pure)
``InputProcessor.process`` in the caller's thread (unless given an already ``ProcessedInput``), so a
bad request raises ``ValueError`` before anything is queued (the server turns that into HTTP 400
before a streamed response starts); the engine thread gets the processed request unchanged.

Failure isolation: if ``engine.step()`` raises, every request that was in the engine gets an
``EngineStepError`` on its stream and is aborted (its KV blocks are freed); the loop logs the
traceback and keeps serving new requests, unless the executor itself is broken
(``LLMEngine.check_health`` raises: a worker process died): then the loop dies, every caller gets
``EngineDeadError`` and ``dead_reason`` says why. An abort (client disconnect, ``OutputStream.abort``,
leaving ``generate`` early) removes the request at the next iteration and frees its blocks.

Usage::

    llm = AsyncLLM.from_engine_args(EngineArgs(model=None))
    async for out in llm.generate("Hello", SamplingParams(output_kind=RequestOutputKind.DELTA), "r1"):
        print(out.outputs[0].text, end="")
    llm.shutdown()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import itertools
import logging
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Callable, Iterable, Iterator, Mapping, Sequence

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core_proc import ABORTING_CALLS, PAUSE_MODES
from pagedllm.engine.beam_search import BeamSearchParams
from pagedllm.engine.input_processor import LengthCheck, ProcessedInput, PromptType
from pagedllm.metrics.loggers import DEFAULT_LOG_INTERVAL_S, LoggingStatLogger
from pagedllm.metrics.request_tracing import RequestTracer, TracedRequest
from pagedllm.metrics.stats import StatLogger
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams

if TYPE_CHECKING:   # imported when an in-process engine is built: a front end of engine processes never loads torch
    from pagedllm.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

# Longest idle sleep when no stats line is due (s); the condition wakes the thread earlier on work.
_MAX_IDLE_WAIT_S = 60.0


class EngineDeadError(RuntimeError):
    """The engine loop is not running (shut down, or it crashed); no request can be served."""


class EnginePausedError(RuntimeError):
    """A new request while generation is paused in ``abort`` or ``wait`` mode (vLLM's
    retryable error: the server answers 503; retry after ``resume_generation``)."""


class EngineStepError(RuntimeError):
    """An engine step raised while this request was in the batch; the request was aborted."""


@dataclass
class _NewRequest:
    request_id: str
    processed: ProcessedInput
    arrival_time: float
    beam_params: BeamSearchParams | None = None   # a beam search (LLMEngine.add_beam_search_request)
    data_parallel_rank: int | None = None          # the replica it must run on (None: the balancer's choice)


@dataclass
class _Sink:
    """Where a request's outputs go: a queue owned by the caller's event loop."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


@dataclass
class _Failure:
    request_id: str
    error: BaseException


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for queue, item in items:
        queue.put_nowait(item)


def _send_to_loops(batches: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Queue, object]]]) -> None:
    """Put each (queue, item) on its queue from any thread: one ``call_soon_threadsafe`` per event loop.
    A closed loop (its caller is gone) is skipped."""
    for loop, items in batches.items():
        try:
            loop.call_soon_threadsafe(_put_all, items)
        except RuntimeError:  # the caller's loop is closed: nobody is listening
            pass


class OutputStream:
    """The outputs of the requests added by one :meth:`AsyncLLM.add_requests` call, in the order the
    engine produced them, until every one has finished.

    Iterate with ``async for``; each item is a ``RequestOutput`` (its ``request_id`` says which
    request). A failed request raises ``EngineStepError`` / ``EngineDeadError`` from ``__anext__``.
    Leaving early (``break``, cancellation, disconnect) must be followed by :meth:`abort` (or use
    ``async with``), which aborts the unfinished requests and frees their blocks.

    Args:
        tracer, traced: [tracing] the front end's ``RequestTracer`` and what each request's span
            reports; the span of a request is recorded when its final output is read here.

    Attributes:
        request_ids: the requests, in the order they were added.
    """

    def __init__(self, engine: "AsyncLLM", request_ids: list[str], queue: asyncio.Queue,
                 tracer: RequestTracer | None = None, traced: dict[str, TracedRequest] | None = None) -> None:
        self._engine = engine
        self.request_ids = list(request_ids)
        self._unfinished = set(request_ids)
        self._queue = queue
        self._tracer = tracer
        self._traced = traced or {}

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def __aiter__(self) -> "OutputStream":
        return self

    async def __anext__(self) -> RequestOutput:
        while self._unfinished:
            item = await self._queue.get()
            if isinstance(item, _Failure):
                if item.request_id not in self._unfinished:
                    continue
                self._unfinished.discard(item.request_id)
                raise item.error
            if item.request_id not in self._unfinished:
                continue
            if item.finished:
                self._unfinished.discard(item.request_id)
                if self._tracer is not None:
                    self._tracer.record(item, self._traced[item.request_id])
            return item
        raise StopAsyncIteration

    def abort(self) -> None:
        """Abort every unfinished request of this stream (thread-safe, idempotent, non-blocking)."""
        if self._unfinished:
            ids, self._unfinished = list(self._unfinished), set()
            self._engine.abort(ids)

    def __del__(self) -> None:
        # A stream dropped unread (e.g. a streaming response cancelled before its body started)
        # must not leave its requests running.
        if getattr(self, "_unfinished", None):
            try:
                self.abort()
            except Exception:
                pass

    async def __aenter__(self) -> "OutputStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.abort()




def _traced(request: _NewRequest, trace_headers: Mapping[str, str] | None) -> TracedRequest:
    """What the span of ``request`` reports besides its output (its params, adapter, headers)."""
    processed = request.processed
    return TracedRequest.of(request.beam_params or processed.params, processed.max_tokens, processed.lora_request,
                            trace_headers)


class AsyncFrontEnd:
    """What ``AsyncLLM`` and ``DPAsyncLLM`` (``engine/dp_client.py``) share: the read-only
    information, request validation, ``add_request`` and ``generate``.

    Subclasses set ``_core`` (the ``LLMEngine`` or ``EngineCoreClient``: it has ``tokenizer``,
    ``max_model_len``, ``scheduler_config``, ``vocab_size`` and ``input_processor``), ``_thread``,
    ``_stopping``, ``_ids`` and ``_sinks``, and define ``_submit``, ``abort`` and ``data_parallel_size``.
    """

    _core: object
    _thread: threading.Thread | None
    _stopping: bool
    _ids: Iterator[int]
    _sinks: dict[str, _Sink]   # request id -> where its outputs go, while it runs
    # The pause mode while paused (``pause_generation``), else None; read by add_requests.
    _pause_mode: str | None = None
    # [tracing] one span per finished request (``--otlp-traces-endpoint``), or None: no spans.
    request_tracer: RequestTracer | None = None

    # -- read-only information (any thread) -------------------------------------------------

    @property
    def tokenizer(self):
        return self._core.tokenizer

    @property
    def max_model_len(self) -> int:
        return self._core.max_model_len

    @property
    def max_num_seqs(self) -> int:
        """Most sequences in one step of one engine (a beam search's width must fit)."""
        return self._core.scheduler_config.max_num_seqs

    @property
    def vocab_size(self) -> int:
        return self._core.vocab_size

    @property
    def structured_outputs_config(self):
        """The engine's ``StructuredOutputsConfig`` (backend, JSON whitespace default)."""
        return self._core.input_processor.structured_outputs_config

    @property
    def data_parallel_size(self) -> int:
        raise NotImplementedError

    @property
    def is_running(self) -> bool:
        """True while the background thread is alive and not shutting down."""
        return self._thread is not None and self._thread.is_alive() and not self._stopping

    def process_inputs(self, prompt: PromptType, params: SamplingParams | BeamSearchParams,
                       length_check: LengthCheck | None = None) -> ProcessedInput:
        """Validate and tokenize without queueing (pure; any thread).

        Raises:
            ValueError: as ``InputProcessor.process`` (empty prompt, out-of-vocabulary ids, prompt
                over max_model_len, logprobs over max_logprobs, ...).
        """
        return self._core.input_processor.process(prompt, params, length_check)

    def load_prompt_embeds(self, data: str | bytes):
        """One HTTP ``prompt_embeds`` item (base64 ``torch.save`` bytes) as a checked CPU tensor
        (pure; any thread).

        Raises:
            ValueError: as ``InputProcessor.load_prompt_embeds`` (naming ``prompt_embeds``).
        """
        return self._core.input_processor.load_prompt_embeds(data)

    # -- requests (event loop thread) -------------------------------------------------------

    def add_requests(self, requests: Sequence[tuple[str | None, PromptType | ProcessedInput,
                                                    SamplingParams | BeamSearchParams | None]],
                     arrival_time: float | None = None,
                     trace_headers: Mapping[str, str] | None = None,
                     data_parallel_rank: int | None = None) -> OutputStream:
        """Validate every request, then queue them all (all or nothing).

        Must be called from the event loop that will iterate the returned stream.

        Args:
            requests: (request_id or None for a fresh id, prompt, params) triples; the prompt may
                be a ``ProcessedInput`` from :meth:`process_inputs` (params None), which is passed
                on unchanged. With ``BeamSearchParams`` the request is a beam search
                (``engine/beam_search.py``; its beams are scheduled with the other requests): it
                yields one final ``RequestOutput`` whose ``outputs`` are the ``beam_width`` best
                sequences, best first.
            arrival_time: ``time.monotonic()`` of arrival (for TTFT / latency metrics); now if None.
            trace_headers: [tracing] the caller's W3C ``traceparent`` / ``tracestate`` headers:
                with a ``request_tracer``, each request's span continues that trace (None: root
                spans); without one they are ignored.
            data_parallel_rank: the data-parallel replica all of them run on (vLLM's); None: the
                load balancer picks one per request.
        Returns:
            One ``OutputStream`` over all of them.
        Raises:
            ValueError: a bad prompt or params, a request id that is in use, or a
                ``data_parallel_rank`` outside [0, data_parallel_size) (nothing is queued).
            EngineDeadError: the engine is shut down or dead.
            EnginePausedError: generation is paused in ``abort`` / ``wait`` mode.
        """
        self.check_health()
        self._check_not_paused()
        loop = asyncio.get_running_loop()
        arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self._check_data_parallel_rank(data_parallel_rank)
        prepared = self._prepare_requests(requests, arrival_time)
        for r in prepared:
            r.data_parallel_rank = data_parallel_rank
        queue: asyncio.Queue = asyncio.Queue()
        traced = None if self.request_tracer is None else {r.request_id: _traced(r, trace_headers) for r in prepared}
        self._submit(prepared, {r.request_id: _Sink(loop, queue) for r in prepared})
        return OutputStream(self, [r.request_id for r in prepared], queue, self.request_tracer, traced)

    def _submit(self, prepared: list[_NewRequest], sinks: dict[str, _Sink]) -> None:
        """Register each request's sink and hand the requests to the engine (all or nothing).

        Raises:
            ValueError: a request id that is in use (nothing is queued).
            EngineDeadError: the engine is shutting down or dead.
        """
        raise NotImplementedError

    def _claim_request_ids(self, sinks: dict[str, _Sink]) -> None:
        """Take the ids of ``sinks`` for new requests (the caller holds the lock that guards ``_sinks``).

        Raises:
            ValueError: an id belongs to a running request (nothing is taken).
        """
        in_use = [rid for rid in sinks if rid in self._sinks]
        if in_use:
            raise ValueError(f"request_id(s) {in_use} are already running")
        self._sinks.update(sinks)

    def abort(self, request_ids: str | Iterable[str]) -> None:
        raise NotImplementedError

    async def _engine_call(self, method: str, **kwargs) -> list:
        """``LLMEngine.<method>(**kwargs)`` between steps, on the engine (every live replica's);
        the answers, one per engine. The aborted outputs ``pause_generation`` returns reach their
        callers."""
        raise NotImplementedError

    async def add_lora(self, lora_request) -> bool:
        """[LoRA] Load an adapter on every engine now (vLLM's ``add_lora``); False if loaded already.

        Raises:
            ValueError: as ``LLMEngine.add_lora``.
        """
        return all(await self._engine_call("add_lora", lora_request=lora_request))

    async def abort_requests(self, request_ids: str | Iterable[str]) -> int:
        """Abort requests by id and end their streams (vLLM's ``/abort_requests``): unlike
        :meth:`abort`, each caller still gets its final output, finish_reason "abort". Unknown or
        finished ids are ignored.

        Returns:
            How many requests were aborted.
        Raises:
            EngineDeadError: if the engine has died.
        """
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        return sum(await self._engine_call("abort_request", request_ids=ids))

    async def remove_lora(self, lora_id: int) -> bool:
        """[LoRA] Forget an adapter on every engine (vLLM's ``remove_lora``)."""
        return any(await self._engine_call("remove_lora", lora_id=lora_id))

    def _check_not_paused(self) -> None:
        if self._pause_mode in ("abort", "wait"):
            raise EnginePausedError(f"generation is paused (mode {self._pause_mode!r}); retry after "
                                    "resume_generation")

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        """Pause generation (vLLM's ``AsyncLLM.pause_generation``, e.g. around a weight update).

        Args:
            mode: ``"abort"``: abort the unfinished requests now (each caller gets its final
                output, finish_reason "abort"); ``"wait"``: return once they finished; ``"keep"``:
                freeze them (their streams go quiet) until :meth:`resume_generation`. In
                ``abort`` / ``wait`` mode new requests raise ``EnginePausedError`` until then; in
                ``keep`` mode they are queued.
            clear_cache: reset the prefix cache once drained (``abort`` / ``wait``; ``keep``
                keeps the frozen requests' blocks).
        Raises:
            ValueError: an unknown ``mode``.
            EngineDeadError: the engine is dead.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {list(PAUSE_MODES)}, got {mode!r}")
        self._pause_mode = mode
        await self._engine_call("pause_generation", mode=mode)
        while mode == "wait" and any(await self._engine_call("has_unfinished_requests")):
            await asyncio.sleep(0.01)
        if clear_cache and mode != "keep":
            await self._engine_call("reset_prefix_cache")

    async def resume_generation(self) -> None:
        """End a pause: frozen requests go on, new ones are accepted."""
        await self._engine_call("resume_generation")
        self._pause_mode = None

    async def is_paused(self) -> bool:
        return self._pause_mode is not None

    def add_request(self, request_id: str | None, prompt: PromptType | ProcessedInput,
                    params: SamplingParams | BeamSearchParams | None = None,
                    arrival_time: float | None = None, trace_headers: Mapping[str, str] | None = None,
                    data_parallel_rank: int | None = None) -> OutputStream:
        """:meth:`add_requests` for one request."""
        return self.add_requests([(request_id, prompt, params)], arrival_time, trace_headers, data_parallel_rank)

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
                       request_id: str | None = None, *, lora_request=None, tokenization_kwargs=None,
                       trace_headers=None, priority: int = 0,
                       data_parallel_rank: int | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request until it finishes; leaving the loop early aborts it (vLLM V1's
        ``AsyncLLM.generate``, same argument names).

        Args:
            prompt: a string, token ids, ``{"prompt": text}`` or ``{"prompt_token_ids": [...]}``.
            sampling_params: the request's params (None: ``SamplingParams()``);
                ``output_kind`` decides what each output holds (``DELTA`` for streaming).
            request_id: the caller's id (None: a fresh one).
            lora_request: the ``LoRARequest`` it runs with, or None (the base model).
            trace_headers: the caller's W3C trace headers (see :meth:`add_requests`).
            tokenization_kwargs: vLLM's; only None is supported.
            priority: vLLM's priority scheduling; only 0 (first come, first served).
            data_parallel_rank: the data-parallel replica to run on (vLLM's); None: the load
                balancer picks one (see :meth:`add_requests`).
        Raises:
            ValueError: at the first ``__anext__``, for a bad prompt or params, or an unsupported
                keyword (naming it; use :meth:`add_request` to get errors synchronously).
        """
        for name, value, default in (("tokenization_kwargs", tokenization_kwargs, None),
                                     ("priority", priority, 0)):
            if value != default and not (name == "tokenization_kwargs" and value == {}):
                raise ValueError(f"{name}={value!r} is not supported by pagedllm (only {default!r})")
        params = SamplingParams() if sampling_params is None else sampling_params
        if lora_request is not None:   # [LoRA] the processed request carries its adapter to the engine
            from pagedllm.lora.request import LoRARequest

            if not isinstance(lora_request, LoRARequest):
                raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}")
            prompt, params = self.process_inputs(prompt, params).with_lora(lora_request), None
        stream = self.add_request(request_id, prompt, params, trace_headers=trace_headers,
                                  data_parallel_rank=data_parallel_rank)
        try:
            async for out in stream:
                yield out
        finally:
            stream.abort()

    def _prepare_requests(self, requests: Sequence[tuple[str | None, PromptType | ProcessedInput,
                                                         SamplingParams | BeamSearchParams | None]],
                          arrival_time: float) -> list[_NewRequest]:
        """Give ids, validate and tokenize every request (the caller's thread; nothing is queued).

        Raises:
            ValueError: a bad prompt or params, an id given twice, no requests, or what
                ``_check_request`` raises.
        """
        prepared: list[_NewRequest] = []
        for request_id, prompt, params in requests:
            request_id = f"async-{next(self._ids)}" if request_id is None else str(request_id)
            if any(r.request_id == request_id for r in prepared):
                raise ValueError(f"request_id {request_id!r} is given twice")
            beam = params if isinstance(params, BeamSearchParams) else None
            if isinstance(prompt, ProcessedInput):
                if params is not None and beam is None:
                    raise ValueError("params must be None when the prompt is a ProcessedInput (it carries its params)")
                processed = prompt
            else:
                processed = self.process_inputs(prompt, params)
            self._check_request(processed, beam)
            prepared.append(_NewRequest(request_id, processed, arrival_time, beam))
        if not prepared:
            raise ValueError("no requests given")
        return prepared

    def _check_request(self, processed: ProcessedInput, beam: BeamSearchParams | None) -> None:
        """Checks a subclass adds after tokenizing one request (raise ``ValueError``)."""

    def _check_data_parallel_rank(self, data_parallel_rank: int | None) -> None:
        """Raises:
            ValueError: ``data_parallel_rank`` is not None and not a replica (one engine: only 0)."""
        if data_parallel_rank not in (None, 0) or isinstance(data_parallel_rank, bool):
            raise ValueError(f"data_parallel_rank must be None or an int in [0, data_parallel_size=1), "
                             f"got {data_parallel_rank!r}")

    async def do_log_stats(self) -> None:
        """Log the periodic stats line(s) now (vLLM's ``do_log_stats``): every stat logger with a
        ``log`` method (``AggregatedLoggingStatLogger``, ``LoggingStatLogger``) logs what it has."""
        for stat_logger in self._stat_loggers():
            log = getattr(stat_logger, "log", None)
            if callable(log):
                log()

    def _stat_loggers(self) -> list:
        """The stat loggers of this front end's engine(s) (each once): those ``from_engine_args``
        built from its ``stat_loggers``."""
        return list(getattr(self, "extra_stat_loggers", []))

    def close_tracer(self) -> None:
        """[tracing] Export the spans still buffered and stop the exporter (shutdown calls it)."""
        if self.request_tracer is not None:
            self.request_tracer.shutdown()


def check_not_external_launcher(backend: str | None) -> None:
    """Raises:
        ValueError: for ``distributed_executor_backend="external_launcher"``: its ranks stay in
            lockstep only by scheduling the same inputs in the same order, which a server's
            requests, arriving at one rank's port at their own times, do not give."""
    if backend == "external_launcher":
        raise ValueError("distributed_executor_backend='external_launcher' is for offline inference "
                         "(LLM.generate in every torchrun rank); a server or AsyncLLM needs 'mp' or 'ray'")


class AsyncLLM(AsyncFrontEnd):
    """An ``LLMEngine`` driven by a background thread, for many concurrent asyncio callers.

    Args:
        engine: the engine; from now on only the background thread may call its mutating methods
            (``add_request``, ``step``, ``abort_request``). Its ``input_processor`` and
            ``tokenizer`` stay usable from any thread.
        stat_loggers: extra ``StatLogger``s (e.g. ``PrometheusStatLogger``), called in the engine
            thread after every step and abort.
        log_stats_interval_s: seconds between periodic log lines (throughput, queues, KV usage);
            None disables them.
        log_requests: log each request's id, prompt length and params at INFO when it is added
            (``AsyncEngineArgs.enable_log_requests``).
    Raises:
        ValueError: for an external_launcher engine (offline ``LLM`` only, as in vLLM).
    """

    def __init__(self, engine: LLMEngine, stat_loggers: Iterable[StatLogger] = (),
                 log_stats_interval_s: float | None = DEFAULT_LOG_INTERVAL_S, log_requests: bool = False) -> None:
        check_not_external_launcher(engine.args.distributed_executor_backend)
        self.engine = engine
        self.log_requests = log_requests
        self._stats_log = LoggingStatLogger(log_stats_interval_s) if log_stats_interval_s else None
        engine.stat_loggers.extend(stat_loggers)
        if self._stats_log is not None:
            engine.stat_loggers.append(self._stats_log)
        self._cv = threading.Condition()
        # Guarded by _cv: the inbox, the sinks of live requests, the stop flag.
        self._pending: list[_NewRequest] = []
        self._aborts: list[str] = []
        self._calls: list[tuple[Callable[[], object], concurrent.futures.Future]] = []  # run in the engine thread
        self._sinks: dict[str, _Sink] = {}
        self._stopping = False
        self._dead: BaseException | None = None
        # Engine-thread only: requests added to the engine and not yet finished or aborted.
        self._in_engine: set[str] = set()
        self._thread: threading.Thread | None = None
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs, start_engine_loop: bool = True, usage_context=None,
                         stat_loggers: Iterable[StatLogger] | None = None, enable_log_requests: bool | None = None,
                         disable_log_stats: bool | None = None, **kwargs) -> "AsyncLLM | DPAsyncLLM":
        """Build the engine (loads the model) and wrap it (vLLM's ``AsyncLLM.from_engine_args``).

        Args:
            args: ``AsyncEngineArgs`` (or ``EngineArgs``); ``data_parallel_size`` > 1 gives a
                ``DPAsyncLLM`` over that many replicas (``engine/dp_client.py``).
            start_engine_loop: start the engine thread now (else at the first request).
            usage_context: vLLM's; ignored.
            stat_loggers: extra stat loggers, vLLM's way: classes or factories called per engine
                with ``(vllm_config, engine_index)``, aggregating ones (``AggregatedLoggingStatLogger``)
                once with the engine indexes, or ready objects (``v1/metrics/loggers.py``).
            enable_log_requests: log each added request; None = ``args.enable_log_requests``.
            disable_log_stats: no periodic stats lines; None = ``args.disable_log_stats``.
            **kwargs: other ``AsyncLLM`` arguments (``log_stats_interval_s``).
        With ``args.otlp_traces_endpoint`` the front end records one span per finished request
        (``request_tracer``).

        Raises:
            ValueError: bad engine arguments (an OTLP endpoint without the ``otel`` extra among them,
                before the model loads).
        """
        from pagedllm.v1.metrics.loggers import attach_stat_loggers

        check_not_external_launcher(args.distributed_executor_backend)
        observability = args.create_observability_config()
        if enable_log_requests is None:
            enable_log_requests = bool(getattr(args, "enable_log_requests", False))
        if args.data_parallel_size > 1:
            from pagedllm.engine.dp_client import DPAsyncLLM
            llm = DPAsyncLLM.from_engine_args(args)
            llm.log_requests = enable_log_requests
            llm.extra_stat_loggers = attach_stat_loggers(stat_loggers or (), llm.client.stat_loggers,
                                                         llm.client.vllm_config)
        else:
            if disable_log_stats if disable_log_stats is not None else args.disable_log_stats:
                kwargs["log_stats_interval_s"] = None
            from pagedllm.engine.llm_engine import LLMEngine

            llm = cls(LLMEngine(args), log_requests=enable_log_requests, **kwargs)
            llm.extra_stat_loggers = attach_stat_loggers(stat_loggers or (), [llm.engine.stat_loggers])
            if start_engine_loop:
                llm.start()
        llm.request_tracer = RequestTracer.from_config(observability, args.traced_model_name())
        return llm

    @property
    def _core(self) -> LLMEngine:
        return self.engine

    # -- read-only information (any thread) -------------------------------------------------

    @property
    def data_parallel_size(self) -> int:
        """Engine replicas behind this front end: 1 (``DPAsyncLLM`` has D)."""
        return 1

    @property
    def errored(self) -> bool:
        """True when the engine loop crashed (outside a step, or a step lost a worker) or was shut down."""
        return self._dead is not None or self._stopping

    @property
    def dead_reason(self) -> str | None:
        """Why the engine can serve nothing more (its loop died; a worker process of a
        multi-rank executor died or failed), or None while it serves or is shutting down normally.
        The server exits non-zero when this is set (``api_server.watch_engine``)."""
        if self._dead is not None:
            return f"the engine loop died: {self._dead}"
        if self._thread is not None and not self._thread.is_alive() and not self._stopping:
            return "the engine thread exited"
        return None

    def check_health(self) -> None:
        """Raises:
            EngineDeadError: if the engine loop is dead or shutting down."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop died: {self._dead!r}")
        if self._stopping:
            raise EngineDeadError("the engine is shutting down")
        if self._thread is not None and not self._thread.is_alive():
            raise EngineDeadError("the engine thread exited")

    # -- requests (event loop thread) -------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread (idempotent; ``add_requests`` calls it)."""
        with self._cv:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="pagedllm-engine", daemon=True)
            self._thread.start()

    def _submit(self, prepared: list[_NewRequest], sinks: dict[str, _Sink]) -> None:
        if self.log_requests:
            for r in prepared:
                logger.info("Added request %s: %d prompt tokens, params: %s", r.request_id,
                            len(r.processed.prompt_token_ids), r.beam_params or r.processed.params)
        with self._cv:
            if self._stopping or self._dead is not None:
                raise EngineDeadError("the engine is shutting down" if self._stopping else "the engine loop died")
            self._claim_request_ids(sinks)
            self._pending.extend(prepared)
            self._cv.notify()
        self.start()

    def _check_request(self, processed: ProcessedInput, beam: BeamSearchParams | None) -> None:
        if beam is not None:
            self.engine.beam_search.check_request(len(processed.prompt_token_ids), beam, processed.prompt_embeds)

    def _stat_loggers(self) -> list:
        return super()._stat_loggers() + ([self._stats_log] if self._stats_log is not None else [])

    def abort(self, request_ids: str | Iterable[str]) -> None:
        """Abort requests: they stop receiving outputs now and leave the engine (blocks freed) at the
        next iteration. Thread-safe, non-blocking; unknown or finished ids are ignored."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        with self._cv:
            removed = [rid for rid in ids if self._sinks.pop(rid, None) is not None]
            if removed:
                self._aborts.extend(removed)
                self._cv.notify()

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        """Forget every cached KV block, in the engine thread between steps.

        Args:
            reset_running_requests: preempt the running requests first (``LLMEngine.reset_prefix_cache``).
        Returns:
            True when cleared; False while requests hold blocks (vLLM's semantics).
        Raises:
            EngineDeadError: if the engine loop has died.
        """
        return await self._call_in_engine_thread(
            functools.partial(self.engine.reset_prefix_cache, reset_running_requests))

    async def start_profile(self) -> None:
        """``LLMEngine.start_profile`` in the engine thread between steps.

        Raises:
            RuntimeError: if no profiler is configured (``profiler_config``).
        """
        await self._call_in_engine_thread(self.engine.start_profile)

    async def stop_profile(self) -> None:
        """``LLMEngine.stop_profile`` in the engine thread between steps (writes the traces)."""
        await self._call_in_engine_thread(self.engine.stop_profile)

    async def _engine_call(self, method: str, **kwargs) -> list:
        def call() -> object:
            value = getattr(self.engine, method)(**kwargs)
            if method in ABORTING_CALLS:   # the aborted requests' final outputs
                self._deliver(value)
                return len(value)
            return value

        return [await self._call_in_engine_thread(call)]

    async def _call_in_engine_thread(self, fn: Callable[[], object]) -> object:
        """``fn()`` in the engine thread between steps (here when there is no engine thread).

        Raises:
            EngineDeadError: if the engine loop has died; whatever ``fn`` raises.
        """
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop died: {self._dead!r}")
        if self._thread is None or not self._thread.is_alive():
            return fn()   # no engine thread: nothing else touches the engine
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            self._calls.append((fn, future))
            self._cv.notify()
        return await asyncio.wrap_future(future)

    def shutdown(self, timeout: float | None = 30.0) -> None:
        """Stop the engine thread: requests still running get ``EngineDeadError`` and are aborted.

        Blocks up to ``timeout`` seconds for the current step to end. Idempotent.
        """
        with self._cv:
            self._stopping = True
            self._cv.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                logger.warning("engine thread did not stop within %.1f s", timeout)
        self.close_tracer()

    # -- the engine thread ------------------------------------------------------------------

    def _idle_wait(self) -> float:
        if self._stats_log is None:
            return _MAX_IDLE_WAIT_S
        return min(_MAX_IDLE_WAIT_S, self._stats_log.seconds_to_next_log() + 0.01)

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cv:
                    if not (self._pending or self._aborts or self._calls or self._stopping
                            or engine.has_work()):
                        self._cv.wait(self._idle_wait())
                    pending, self._pending = self._pending, []
                    aborts, self._aborts = self._aborts, []
                    calls, self._calls = self._calls, []
                    stopping = self._stopping
                    # A request aborted before it reached the engine is simply never added.
                    pending = [r for r in pending if r.request_id in self._sinks]
                for r in pending:
                    try:
                        if r.beam_params is not None:
                            engine.add_beam_search_request(r.request_id, r.processed, r.beam_params,
                                                           arrival_time=r.arrival_time)
                        else:
                            engine.add_request(r.request_id, r.processed, arrival_time=r.arrival_time)
                    except Exception as e:  # validated by the caller; only a race could get here
                        logger.warning("request %s rejected by the engine: %s", r.request_id, e)
                        self._fail([r.request_id], e)
                        continue
                    self._in_engine.add(r.request_id)
                if aborts:
                    known = [rid for rid in aborts if rid in self._in_engine]
                    self._in_engine.difference_update(known)
                    if known:
                        engine.abort_request(known)
                        logger.debug("aborted %d request(s): %s", len(known), known[:8])
                for fn, future in calls:
                    try:
                        future.set_result(fn())
                    except Exception as e:
                        future.set_exception(e)
                if stopping:
                    self._stop_all()
                    return
                if engine.has_work():
                    try:
                        outputs = engine.step()
                    except Exception as e:
                        self._fail_step(e)
                    else:
                        self._deliver(outputs)
                if self._stats_log is not None:
                    self._stats_log.maybe_log()
        except BaseException as e:  # a bug outside step(), or a broken executor: the loop cannot continue
            logger.exception("the engine loop died")
            self._dead = e
            with self._cv:
                ids = list(self._sinks)
            self._fail(ids, EngineDeadError(f"the engine loop died: {e!r}"))

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        with self._cv:
            for out in outputs:
                sink = self._sinks.get(out.request_id)
                if out.finished:
                    self._in_engine.discard(out.request_id)
                    self._sinks.pop(out.request_id, None)
                if sink is not None:
                    batches.setdefault(sink.loop, []).append((sink.queue, out))
        _send_to_loops(batches)

    def _fail(self, request_ids: list[str], error: BaseException) -> None:
        """Deliver ``error`` to these requests' callers and forget their sinks."""
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        with self._cv:
            for rid in request_ids:
                sink = self._sinks.pop(rid, None)
                if sink is not None:
                    batches.setdefault(sink.loop, []).append((sink.queue, _Failure(rid, error)))
        _send_to_loops(batches)

    def _fail_step(self, error: Exception) -> None:
        """A step raised: fail and abort every request in the engine, keep the loop alive."""
        ids = sorted(self._in_engine)
        logger.exception("engine step failed; failing its %d request(s) and continuing", len(ids))
        self._in_engine.clear()
        # A multi-rank executor that lost a worker has stopped every rank: no later step can run,
        # so the loop dies (``_run``) instead of failing every later request. The engine is marked
        # dead before the step's callers hear of the failure, so ``dead_reason`` is set when they do.
        try:
            self.engine.check_health()
            dead = None
        except Exception as e:
            dead = self._dead = e
        step_error = EngineStepError(f"the engine step failed: {type(error).__name__}: {error}")
        step_error.__cause__ = error
        self._fail(ids, step_error)
        try:
            self.engine.abort_request(ids)
        except Exception:
            logger.exception("aborting the failed step's requests raised")
        if self.engine.has_unfinished_requests():
            logger.error("%d request(s) remain in the scheduler after a failed step",
                         self.engine.get_num_unfinished_requests())
        if dead is not None:
            raise dead

    def _stop_all(self) -> None:
        ids = sorted(self._in_engine)
        with self._cv:
            waiting = [rid for rid in list(self._sinks) if rid not in self._in_engine]
        self._in_engine.clear()
        if ids:
            logger.info("shutting down: aborting %d unfinished request(s)", len(ids))
            self.engine.abort_request(ids)
        self._fail(ids + waiting, EngineDeadError("the server is shutting down"))
