"""OpenTelemetry glue for request tracing (vLLM's ``vllm/tracing.py``): whether the optional
packages are installed, a tracer that exports to an OTLP collector, W3C trace-context extraction,
and the span attribute names.

The OpenTelemetry packages are the ``otel`` extra (``pip install -e ".[otel]"``); nothing here
imports them until a tracer or a context is asked for, so a server without
``--otlp-traces-endpoint`` never loads them. The SDK reads its own ``OTEL_*`` variables
(``OTEL_SERVICE_NAME``, ``OTEL_EXPORTER_OTLP_TRACES_INSECURE``, ``..._HEADERS``, ``..._TIMEOUT``);
the protocol, which picks the exporter class, comes in through ``ObservabilityConfig``.
"""

from __future__ import annotations

import traceback
from collections.abc import Mapping
from typing import Any

from pagedllm.config import SUPPORTED_OTLP_PROTOCOLS

# The W3C Trace Context headers a request's trace travels in (vLLM's TRACE_HEADERS).
TRACE_HEADERS = ("traceparent", "tracestate")
# What to install when the packages are missing.
OTEL_INSTALL_HINT = 'pip install -e ".[otel]" (the otel extra: opentelemetry-sdk, opentelemetry-api, ' \
                    'opentelemetry-exporter-otlp)'


class SpanAttributes:
    """Span attribute names. The ``gen_ai.request`` / ``gen_ai.response`` / ``gen_ai.usage`` ones
    are OpenTelemetry's gen_ai semantic conventions (as vLLM copies them); the others are vLLM's
    additions. Latencies are in seconds."""

    GEN_AI_USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    GEN_AI_USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    GEN_AI_REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    GEN_AI_REQUEST_TOP_P = "gen_ai.request.top_p"
    GEN_AI_REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    GEN_AI_RESPONSE_MODEL = "gen_ai.response.model"
    GEN_AI_REQUEST_ID = "gen_ai.request.id"
    GEN_AI_REQUEST_N = "gen_ai.request.n"
    GEN_AI_USAGE_NUM_SEQUENCES = "gen_ai.usage.num_sequences"
    GEN_AI_LATENCY_TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    GEN_AI_LATENCY_E2E = "gen_ai.latency.e2e"
    GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    GEN_AI_LATENCY_TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"


def otel_import_error() -> str | None:
    """None when the OpenTelemetry SDK and OTLP exporters import, else the import traceback."""
    try:
        import opentelemetry.exporter.otlp.proto.grpc.trace_exporter  # noqa: F401
        import opentelemetry.exporter.otlp.proto.http.trace_exporter  # noqa: F401
        import opentelemetry.sdk.trace  # noqa: F401
        import opentelemetry.trace.propagation.tracecontext  # noqa: F401
    except ImportError:
        return traceback.format_exc()
    return None


def is_otel_available() -> bool:
    """Whether the ``otel`` extra is installed (vLLM's ``is_otel_available``)."""
    return otel_import_error() is None


def check_otel_available(field: str) -> None:
    """Raises:
        ValueError: naming ``field`` and the extra to install, when the packages do not import."""
    error = otel_import_error()
    if error is not None:
        raise ValueError(f"{field} needs OpenTelemetry, which is not installed: {OTEL_INSTALL_HINT}.\n"
                         f"Import error:\n{error}")


def init_tracer_provider(otlp_traces_endpoint: str, protocol: str = "grpc", span_exporter: Any = None) -> Any:
    """A ``TracerProvider`` whose spans go, batched in a background thread, to an OTLP collector.

    It is not made the process-wide provider: the caller keeps it (``shutdown()`` flushes it). Its
    resource is the SDK's default, so ``$OTEL_SERVICE_NAME`` names the service.

    Args:
        otlp_traces_endpoint: the collector URL ("grpc://host:4317", "http://host:4318/v1/traces").
        protocol: "grpc" or "http/protobuf" (picks the exporter).
        span_exporter: a ready exporter to use instead (tests: the SDK's ``InMemorySpanExporter``).
    Raises:
        ValueError: OpenTelemetry is not installed, or an unknown protocol.
    """
    check_otel_available("otlp_traces_endpoint")
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider()
    exporter = span_exporter if span_exporter is not None else get_span_exporter(otlp_traces_endpoint, protocol)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def init_tracer(instrumenting_module_name: str, otlp_traces_endpoint: str, protocol: str = "grpc") -> Any:
    """vLLM's ``init_tracer``: an ``opentelemetry.trace.Tracer`` of a new ``init_tracer_provider``.

    Raises:
        ValueError: as ``init_tracer_provider``.
    """
    return init_tracer_provider(otlp_traces_endpoint, protocol).get_tracer(instrumenting_module_name)


def get_span_exporter(endpoint: str, protocol: str) -> Any:
    """The OTLP span exporter for ``protocol`` ("grpc" or "http/protobuf"), sending to ``endpoint``.

    Raises:
        ValueError: an unknown protocol (naming $OTEL_EXPORTER_OTLP_TRACES_PROTOCOL).
    """
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        raise ValueError(f"otlp_traces_protocol ($OTEL_EXPORTER_OTLP_TRACES_PROTOCOL) must be one of "
                         f"{list(SUPPORTED_OTLP_PROTOCOLS)}, got {protocol!r}")
    return OTLPSpanExporter(endpoint=endpoint)


def extract_trace_headers(headers: Mapping[str, str]) -> dict[str, str]:
    """The W3C trace headers (``TRACE_HEADERS``) among ``headers`` (an HTTP request's, whose
    lookup is case-insensitive), and no others."""
    return {h: headers[h] for h in TRACE_HEADERS if h in headers}


def extract_trace_context(headers: Mapping[str, str] | None) -> Any:
    """The OpenTelemetry ``Context`` of the caller's trace in ``headers`` (W3C ``traceparent`` /
    ``tracestate``); an empty context (a new root span) for None, no headers or a malformed
    ``traceparent``. Needs the ``otel`` extra (``ImportError`` otherwise)."""
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator().extract(dict(headers or {}))
