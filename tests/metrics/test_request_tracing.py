"""Request tracing (``--otlp-traces-endpoint``): one ``llm_request`` span per finished request, on a
tiny random Llama.

The server is driven in this process (httpx ASGI transport) and exports with the real OTLP/HTTP
exporter to a real receiver on a loopback port (``tests/entrypoints/otlp_receiver.py``), which
decodes the protobuf bodies: the span's parent is the ``traceparent`` the client sent, its
attributes are the request's (token counts against the tokenizer and the response's usage), its
latencies are positive and ordered. A request without trace headers gets a root span; no endpoint
means no tracer; an endpoint without the OpenTelemetry packages is a ``ValueError`` naming the
extra, before any weight loads. Offline ``LLM`` records root spans (the SDK's in-memory exporter).
"""

from __future__ import annotations

import sys

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.config import ObservabilityConfig
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.entrypoints.chat_utils import load_chat_template
from pagedllm.entrypoints.openai.api_server import build_state
from pagedllm.metrics.request_tracing import SPAN_NAME, RequestTracer
from pagedllm.tracing import SpanAttributes as A
from pagedllm.tracing import extract_trace_headers

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[1] / "entrypoints"))
from asgi_utils import run_with_clients  # noqa: E402
from otlp_receiver import OTLPReceiver  # noqa: E402

ENGINE = dict(dtype="float32", max_model_len=128, block_size=4, kv_cache_memory_bytes=4 << 20, seed=0, max_num_seqs=8)
PROMPT = "The quick brown fox"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"
pytestmark = pytest.mark.timeout(600)
OTEL_PACKAGES = ("opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.grpc.trace_exporter",
                 "opentelemetry.exporter.otlp.proto.http.trace_exporter")


@pytest.fixture(scope="module")
def path(make_tiny_checkpoint):
    return make_tiny_checkpoint("llama")


@pytest.fixture(scope="module")
def receiver():
    with OTLPReceiver() as r:
        yield r


@pytest.fixture(scope="module")
def state(path, receiver):
    args = EngineArgs(model=path, otlp_traces_endpoint=receiver.endpoint, otlp_traces_protocol="http/protobuf",
                      **ENGINE)
    st = build_state(args, ["tiny"], chat_template=load_chat_template("gemma"), log_requests=False,
                     log_stats_interval_s=None)
    yield st
    st.engine.shutdown()


def spans_of(receiver, state, request_id: str) -> list[dict]:
    assert state.engine.request_tracer.force_flush()
    return receiver.wait_for(lambda s: s["attributes"].get(A.GEN_AI_REQUEST_ID) == request_id, timeout_s=10)


def assert_latencies(attrs: dict) -> None:
    queue, ttft, e2e = attrs[A.GEN_AI_LATENCY_TIME_IN_QUEUE], attrs[A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN], \
        attrs[A.GEN_AI_LATENCY_E2E]
    prefill, decode = attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL], attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE]
    inference = attrs[A.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE]
    assert 0 < queue < ttft <= e2e < 60
    assert prefill > 0 and decode >= 0 and inference > 0
    assert queue + prefill == pytest.approx(ttft, abs=1e-6)
    assert prefill + decode == pytest.approx(inference, abs=1e-6)
    assert queue + inference <= e2e + 1e-6


def test_completion_span_continues_the_callers_trace(state, receiver):
    tokenizer = state.engine.tokenizer

    async def call(client, http):
        return await http.post("/v1/completions", headers={"traceparent": TRACEPARENT, "tracestate": "k=v",
                                                           "x-other": "not a trace header"},
                               json={"model": "tiny", "prompt": PROMPT, "max_tokens": 7, "temperature": 0.8,
                                     "top_p": 0.9, "n": 2, "seed": 1, "ignore_eos": True})

    response = run_with_clients(state, call)
    assert response.status_code == 200, response.text
    body = response.json()
    (span,) = spans_of(receiver, state, body["id"] + "-0")
    assert span["name"] == SPAN_NAME == "llm_request"
    assert span["kind"] == 2   # SPAN_KIND_SERVER
    assert span["trace_id"] == TRACE_ID and span["parent_span_id"] == PARENT_SPAN_ID
    assert span["span_id"] not in ("", PARENT_SPAN_ID)
    attrs = span["attributes"]
    num_prompt = len(tokenizer.encode(PROMPT))
    assert attrs[A.GEN_AI_USAGE_PROMPT_TOKENS] == num_prompt == body["usage"]["prompt_tokens"]
    assert attrs[A.GEN_AI_USAGE_COMPLETION_TOKENS] == 14 == body["usage"]["completion_tokens"]
    assert attrs[A.GEN_AI_USAGE_NUM_SEQUENCES] == 2
    assert attrs[A.GEN_AI_REQUEST_MAX_TOKENS] == 7
    assert attrs[A.GEN_AI_REQUEST_TEMPERATURE] == pytest.approx(0.8)
    assert attrs[A.GEN_AI_REQUEST_TOP_P] == pytest.approx(0.9)
    assert attrs[A.GEN_AI_REQUEST_N] == 2
    assert attrs[A.GEN_AI_RESPONSE_MODEL] == "tiny"
    assert_latencies(attrs)
    assert span["end_ns"] - span["start_ns"] == pytest.approx(attrs[A.GEN_AI_LATENCY_E2E] * 1e9, abs=2e6)


def test_request_without_trace_headers_is_a_root_span(state, receiver):
    async def call(client, http):
        return await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                    max_tokens=3, temperature=0.0)

    response = run_with_clients(state, call)
    (span,) = spans_of(receiver, state, response.id)
    assert span["parent_span_id"] == "" and len(span["trace_id"]) == 32 and span["trace_id"] != TRACE_ID
    assert span["attributes"][A.GEN_AI_USAGE_PROMPT_TOKENS] == response.usage.prompt_tokens
    assert span["attributes"][A.GEN_AI_USAGE_COMPLETION_TOKENS] == response.usage.completion_tokens == 3
    assert span["attributes"][A.GEN_AI_REQUEST_TEMPERATURE] == 0.0


def test_vllm_dummy_client_body_beam_search(state, receiver):
    """vLLM's examples/observability/opentelemetry/dummy_client.py body, as it sends it."""
    async def call(client, http):
        return await http.post("/v1/completions", headers={"traceparent": TRACEPARENT},
                               json={"model": "tiny", "prompt": "San Francisco is a", "max_tokens": 10, "n": 3,
                                     "use_beam_search": "true", "temperature": 0.0})

    response = run_with_clients(state, call)
    assert response.status_code == 200, response.text
    body = response.json()
    assert len(body["choices"]) == 3
    (span,) = spans_of(receiver, state, body["id"] + "-0")
    attrs = span["attributes"]
    assert span["trace_id"] == TRACE_ID and span["parent_span_id"] == PARENT_SPAN_ID
    assert attrs[A.GEN_AI_REQUEST_N] == 3 and attrs[A.GEN_AI_REQUEST_MAX_TOKENS] == 10
    assert attrs[A.GEN_AI_USAGE_COMPLETION_TOKENS] == body["usage"]["completion_tokens"] > 0
    assert attrs[A.GEN_AI_USAGE_PROMPT_TOKENS] == body["usage"]["prompt_tokens"]
    assert_latencies(attrs)


def test_extract_trace_headers_keeps_only_trace_ones():
    headers = {"traceparent": TRACEPARENT, "tracestate": "a=b", "authorization": "Bearer x", "baggage": "k=v"}
    assert extract_trace_headers(headers) == {"traceparent": TRACEPARENT, "tracestate": "a=b"}
    assert extract_trace_headers({}) == {}


def test_no_endpoint_no_tracer(path):
    assert RequestTracer.from_config(ObservabilityConfig(), "tiny") is None
    st = build_state(EngineArgs(model=path, **ENGINE), ["tiny"], log_requests=False, log_stats_interval_s=None)
    try:
        assert st.engine.request_tracer is None
        assert st.completion.trace_headers(None) is None
    finally:
        st.engine.shutdown()


def test_no_endpoint_loads_no_sdk_or_exporter():
    """Without an endpoint the OpenTelemetry SDK and exporters are never imported (FastAPI itself
    may import the API package)."""
    import subprocess

    code = ("import sys\n"
            "import pagedllm.entrypoints.openai.api_server, pagedllm.entrypoints.llm, pagedllm.tracing\n"
            "from pagedllm.engine.arg_utils import EngineArgs\n"
            "from pagedllm.metrics.request_tracing import RequestTracer\n"
            "assert RequestTracer.from_config(EngineArgs().create_observability_config(), 'm') is None\n"
            "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("kwargs, fragment", [
    (dict(collect_detailed_traces=["model"]), "collect_detailed_traces requires otlp_traces_endpoint"),
    (dict(otlp_traces_endpoint="http://x", collect_detailed_traces="model,gpu"), "collect_detailed_traces must"),
    (dict(otlp_traces_endpoint=""), "otlp_traces_endpoint must be a non-empty URL"),
    (dict(otlp_traces_endpoint="http://x", otlp_traces_protocol="http/json"), "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"),
])
def test_bad_observability_config(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        EngineArgs(**kwargs).create_observability_config()


def test_detailed_traces_split_like_vllm():
    config = EngineArgs(otlp_traces_endpoint="grpc://localhost:4317",
                        collect_detailed_traces="model,worker").create_observability_config()
    assert config.collect_detailed_traces == ("model", "worker") and config.otlp_traces_protocol == "grpc"


def test_protocol_variable_feeds_the_field_and_is_checked_only_when_tracing(monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    assert EngineArgs(otlp_traces_endpoint="http://x/v1/traces").create_observability_config().otlp_traces_protocol \
        == "http/protobuf"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/json")   # set for some other program
    assert not EngineArgs().create_observability_config().tracing_enabled
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        EngineArgs(otlp_traces_endpoint="http://x/v1/traces").create_observability_config()


def test_missing_extra_is_a_clear_error_before_weights_load(monkeypatch, tmp_path):
    for name in OTEL_PACKAGES:
        monkeypatch.setitem(sys.modules, name, None)   # import raises ImportError, as when not installed
    with pytest.raises(ValueError, match=r'otlp_traces_endpoint.*pip install -e "\.\[otel\]"'):
        EngineArgs(otlp_traces_endpoint="http://127.0.0.1:1/v1/traces").create_observability_config()
    # The model folder does not exist: the error above comes first, before anything loads.
    with pytest.raises(ValueError, match=r'pip install -e "\.\[otel\]"'):
        LLM(str(tmp_path / "no-such-model"), otlp_traces_endpoint="http://127.0.0.1:1/v1/traces")
    with pytest.raises(ValueError, match=r'pip install -e "\.\[otel\]"'):
        build_state(EngineArgs(model=str(tmp_path / "no-such-model"), otlp_traces_endpoint="grpc://127.0.0.1:1"))


def test_offline_llm_records_root_spans(path):
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    llm = LLM(path, **ENGINE)
    assert llm.request_tracer is None
    exporter = InMemorySpanExporter()
    llm.request_tracer = RequestTracer.from_config(ObservabilityConfig("http://unused/v1/traces"), "tiny-offline",
                                                   span_exporter=exporter)
    prompts = [PROMPT, "Hello there"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert llm.request_tracer.force_flush()
    spans = {s.attributes[A.GEN_AI_REQUEST_ID]: s for s in exporter.get_finished_spans()}
    assert sorted(spans) == sorted(o.request_id for o in outs)
    for out in outs:
        span = spans[out.request_id]
        assert span.name == "llm_request" and span.parent is None
        assert span.attributes[A.GEN_AI_USAGE_PROMPT_TOKENS] == len(out.prompt_token_ids) == \
            len(llm.get_tokenizer().encode(out.prompt))
        assert span.attributes[A.GEN_AI_USAGE_COMPLETION_TOKENS] == 5
        assert span.attributes[A.GEN_AI_RESPONSE_MODEL] == "tiny-offline"
        assert_latencies(dict(span.attributes))
    llm.request_tracer.shutdown()


def test_grpc_export_with_hand_computed_latencies(monkeypatch):
    """The default protocol (grpc) to a gRPC collector, as vLLM's README runs it
    (``OTEL_EXPORTER_OTLP_TRACES_INSECURE=true``, read by the SDK); every latency is known."""
    from pagedllm.metrics.request_tracing import TracedRequest
    from pagedllm.outputs import CompletionOutput, RequestMetrics, RequestOutput

    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_INSECURE", "true")
    metrics = RequestMetrics(arrival_time=100.0, first_scheduled_time=100.5, first_token_time=101.0,
                             last_token_time=102.0, finished_time=102.25)
    output = RequestOutput("req-7", "p", [1, 2, 3, 4], None, [CompletionOutput(0, "abc", [5, 6, 7], None, None, "length")],
                           True, metrics)
    with OTLPReceiver(grpc_port=0) as receiver:
        tracer = RequestTracer.from_config(ObservabilityConfig(receiver.grpc_endpoint), "tiny")
        tracer.record(output, TracedRequest(3, 0.7, 0.95, 1, "adapter-a", {"traceparent": TRACEPARENT}))
        assert tracer.force_flush()
        (span,) = receiver.wait_for(lambda s: s["name"] == "llm_request", timeout_s=10)
        tracer.shutdown()
    assert span["trace_id"] == TRACE_ID and span["parent_span_id"] == PARENT_SPAN_ID
    assert span["end_ns"] - span["start_ns"] == pytest.approx(2.25e9, abs=1e3)
    assert span["attributes"] == pytest.approx({
        A.GEN_AI_REQUEST_ID: "req-7", A.GEN_AI_RESPONSE_MODEL: "adapter-a", A.GEN_AI_REQUEST_TEMPERATURE: 0.7,
        A.GEN_AI_REQUEST_TOP_P: 0.95, A.GEN_AI_REQUEST_N: 1, A.GEN_AI_REQUEST_MAX_TOKENS: 3,
        A.GEN_AI_USAGE_PROMPT_TOKENS: 4, A.GEN_AI_USAGE_COMPLETION_TOKENS: 3, A.GEN_AI_USAGE_NUM_SEQUENCES: 1,
        A.GEN_AI_LATENCY_E2E: 2.25, A.GEN_AI_LATENCY_TIME_IN_QUEUE: 0.5, A.GEN_AI_LATENCY_TIME_TO_FIRST_TOKEN: 1.0,
        A.GEN_AI_LATENCY_TIME_IN_MODEL_PREFILL: 0.5, A.GEN_AI_LATENCY_TIME_IN_MODEL_DECODE: 1.0,
        A.GEN_AI_LATENCY_TIME_IN_MODEL_INFERENCE: 1.5})


def test_async_llm_generate_with_trace_headers(path, receiver):
    """vLLM's ``AsyncLLM.generate(..., trace_headers=...)``, the engine built by ``from_engine_args``."""
    import asyncio

    from pagedllm.engine.arg_utils import AsyncEngineArgs
    from pagedllm.engine.async_engine import AsyncLLM

    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=path, otlp_traces_endpoint=receiver.endpoint,
                                                    otlp_traces_protocol="http/protobuf", **ENGINE))
    try:
        async def run():
            async for out in llm.generate(PROMPT, SamplingParams(max_tokens=4, ignore_eos=True), "async-traced",
                                          trace_headers={"traceparent": TRACEPARENT}):
                last = out
            return last

        out = asyncio.run(run())
        assert llm.request_tracer.force_flush()
        (span,) = receiver.wait_for(lambda s: s["attributes"].get(A.GEN_AI_REQUEST_ID) == "async-traced", 10)
    finally:
        llm.shutdown()
    assert span["trace_id"] == TRACE_ID and span["parent_span_id"] == PARENT_SPAN_ID
    assert span["attributes"][A.GEN_AI_USAGE_COMPLETION_TOKENS] == len(out.outputs[0].token_ids) == 4
    assert span["attributes"][A.GEN_AI_RESPONSE_MODEL] == path   # no served name: the model as given
