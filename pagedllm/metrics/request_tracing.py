"""One OpenTelemetry span per finished request (vLLM's ``OutputProcessor.do_tracing``).

The span is vLLM's: name ``llm_request``, kind SERVER, from the request's arrival to its end,
parented on the caller's trace when its HTTP request carried W3C ``traceparent`` / ``tracestate``
headers (a root span otherwise), with the request's parameters, token counts and latencies
(``tracing.SpanAttributes``). It is recorded where the front end hands a finished ``RequestOutput``
to its caller (``OutputStream`` for the server, ``LLM._run_engine`` offline), so the trace headers
never travel to the engine, and a request that is aborted or fails records no span (as in vLLM).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pagedllm.config import ObservabilityConfig
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams
from pagedllm.tracing import SpanAttributes, extract_trace_context, init_tracer_provider

logger = logging.getLogger(__name__)

SPAN_NAME = "llm_request"   # vLLM's
INSTRUMENTING_MODULE_NAME = "pagedllm.request"


@dataclass(frozen=True)
class TracedRequest:
    """What a request's span reports besides its final ``RequestOutput``.

    Attributes:
        max_tokens: the request's ``max_tokens`` (tokens; the effective limit when it gave none).
        temperature, top_p: its sampling parameters (beam search: temperature 0, top_p 1).
        n: samples asked for (beam search: the beam width).
        model: the model that answers it (a LoRA adapter's name), or None for the tracer's model.
        trace_headers: the caller's ``traceparent`` / ``tracestate`` headers, or None (a root span).
    """

    max_tokens: int | None
    temperature: float
    top_p: float
    n: int
    model: str | None = None
    trace_headers: Mapping[str, str] | None = None

    @classmethod
    def of(cls, params: SamplingParams | BeamSearchParams, max_tokens: int | None = None, lora_request: Any = None,
           trace_headers: Mapping[str, str] | None = None) -> "TracedRequest":
        """From the request's params; ``max_tokens``: the effective limit, used when
        ``params.max_tokens`` is None; ``lora_request``: the adapter it runs with (its name is the
        response model), or None."""
        model = getattr(lora_request, "lora_name", None)
        if isinstance(params, BeamSearchParams):
            return cls(params.max_tokens, params.temperature, 1.0, params.beam_width, model, trace_headers)
        return cls(params.max_tokens if params.max_tokens is not None else max_tokens, params.temperature,
                   params.top_p, params.n, model, trace_headers)


class RequestTracer:
    """Records one span per finished request on a tracer it owns (nothing process-wide).

    Args:
        provider: an OpenTelemetry SDK ``TracerProvider`` (``tracing.init_tracer_provider``).
        model_name: ``gen_ai.response.model`` of requests that name no adapter (the first served
            model name).
    """

    def __init__(self, provider: Any, model_name: str) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer(INSTRUMENTING_MODULE_NAME)
        self.model_name = model_name

    @classmethod
    def from_config(cls, config: ObservabilityConfig, model_name: str,
                    span_exporter: Any = None) -> "RequestTracer | None":
        """A tracer exporting to ``config.otlp_traces_endpoint``, or None when it is None (then
        nothing of OpenTelemetry is imported and requests cost nothing more).

        Args:
            span_exporter: an exporter to use instead of the OTLP one (tests).
        Raises:
            ValueError: OpenTelemetry is not installed (naming the ``otel`` extra).
        """
        if not config.tracing_enabled:
            return None
        if config.collect_detailed_traces:
            logger.warning("collect_detailed_traces %s: pagedllm records no per-request model forward / execute "
                           "times (nor does vLLM V1); spans carry the latencies of the request only",
                           list(config.collect_detailed_traces))
        provider = init_tracer_provider(config.otlp_traces_endpoint, config.otlp_traces_protocol, span_exporter)
        logger.info("request tracing: one span per request to %s (%s)", config.otlp_traces_endpoint,
                    config.otlp_traces_protocol)
        return cls(provider, model_name)

    def record(self, output: RequestOutput, request: TracedRequest) -> None:
        """Record the span of a finished request (any thread; the export runs in the SDK's
        background thread). A failure is logged, never raised: tracing must not fail a request."""
        try:
            self._record(output, request)
        except Exception:
            logger.exception("request %s: its trace span could not be recorded", output.request_id)

    def _record(self, output: RequestOutput, request: TracedRequest) -> None:
        from opentelemetry.trace import SpanKind

        metrics = output.metrics
        now = time.monotonic()
        arrival = metrics.arrival_time if metrics is not None else now
        finished = metrics.finished_time if metrics is not None and metrics.finished_time is not None else now
        attributes: dict[str, Any] = {
            SpanAttributes.GEN_AI_REQUEST_ID: output.request_id,
            SpanAttributes.GEN_AI_RESPONSE_MODEL: request.model or self.model_name,
            SpanAttributes.GEN_AI_REQUEST_TEMPERATURE: float(request.temperature),
            SpanAttributes.GEN_AI_REQUEST_TOP_P: float(request.top_p),
            SpanAttributes.GEN_AI_REQUEST_N: request.n,
            SpanAttributes.GEN_AI_USAGE_PROMPT_TOKENS: len(output.prompt_token_ids),
            SpanAttributes.GEN_AI_USAGE_COMPLETION_TOKENS: sum(len(o.token_ids) for o in output.outputs),
            SpanAttributes.GEN_AI_USAGE_NUM_SEQUENCES: len(output.outputs),
            SpanAttributes.GEN_AI_LATENCY_E2E: finished - arrival,
        }
        if request.max_tokens is not None:
            attributes[SpanAttributes.GEN_AI_REQUEST_MAX_TOKENS] = request.max_tokens
        attributes.update(_latencies(metrics))
        # Monotonic seconds -> the wall-clock nanoseconds OpenTelemetry timestamps are in.
        offset_ns = time.time_ns() - int(now * 1e9)
        span = self.tracer.start_span(SPAN_NAME, context=extract_trace_context(request.trace_headers),
                                      kind=SpanKind.SERVER, attributes=attributes,
                                      start_time=int(arrival * 1e9) + offset_ns)
        span.end(end_time=int(finished * 1e9) + offset_ns)

    def force_flush(self, timeout_s: float = 30.0) -> bool:
        """Export every recorded span now; False if that took longer than ``timeout_s`` seconds."""
        return self.provider.force_flush(int(timeout_s * 1000))

    def shutdown(self) -> None:
        """Flush and stop the exporter (idempotent)."""
        self.provider.shutdown()


def _latencies(metrics) -> dict[str, float]:
    """vLLM's latency attributes (seconds) that ``metrics`` (a ``RequestMetrics``) has the times
    for: queue = first scheduled - arrival; TTFT = first token - arrival; prefill = first token -
    first scheduled; decode = last token - first token; inference = last token - first scheduled."""
    if metrics is None:
        return {}
    arrival, scheduled = metrics.arrival_time, metrics.first_scheduled_time
    first, last = metrics.first_token_time, metrics.last_token_time
    out = {}
    if scheduled is not None:
        out[SpanAttributes.GEN_AI_LATENCY_TIME_IN_QUEUE] = scheduled - arrival
    if first is not None:
        out[SpanAttributes.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN] = first - arrival
        if scheduled is not None:
            out[SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL] = first - scheduled
        if last is not None:
            out[SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE] = last - first
    if last is not None and scheduled is not None:
        out[SpanAttributes.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE] = last - scheduled
    return out
