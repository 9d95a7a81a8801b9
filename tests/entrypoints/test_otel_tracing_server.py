"""``pagedllm serve --otlp-traces-endpoint`` for real: the server (its engine in an engine-core
process, ``serve``'s default) exports over OTLP/HTTP (``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL=http/protobuf``)
to a receiver in this test; a request sent with a ``traceparent`` header comes back as one
``llm_request`` span in that trace, under the client's span, named by ``OTEL_SERVICE_NAME`` (read by
the OpenTelemetry SDK), with the request's attributes."""

from __future__ import annotations

import httpx
import pytest

from otlp_receiver import OTLPReceiver

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(600)]
TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT_SPAN_ID = "b7ad6b7169203331"


def test_serve_exports_request_span_to_otlp_collector(launch_server, make_tiny_checkpoint):
    path = make_tiny_checkpoint("llama")
    with OTLPReceiver() as receiver:
        server = launch_server(
            ["serve", path, "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "128",
             "--kv-cache-memory-bytes", "4MiB", "--block-size", "4", "--otlp-traces-endpoint", receiver.endpoint],
            "otel", module="pagedllm.entrypoints.cli",
            env={"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_SERVICE_NAME": "pagedllm-test",
                 "OTEL_BSP_SCHEDULE_DELAY": "200"})
        response = httpx.post(server.base_url + "/completions", timeout=120,
                              headers={"traceparent": f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"},
                              json={"model": "tiny", "prompt": "San Francisco is a", "max_tokens": 6,
                                    "temperature": 0.5, "ignore_eos": True})
        assert response.status_code == 200, response.text
        body = response.json()
        spans = receiver.wait_for(lambda s: s["name"] == "llm_request", timeout_s=30)
        assert len(spans) == 1, server.log_tail()
        (span,) = spans
        assert span["trace_id"] == TRACE_ID and span["parent_span_id"] == PARENT_SPAN_ID
        assert span["service_name"] == "pagedllm-test"
        attrs = span["attributes"]
        assert attrs["gen_ai.request.id"] == body["id"] + "-0"
        assert attrs["gen_ai.response.model"] == "tiny"
        assert attrs["gen_ai.usage.prompt_tokens"] == body["usage"]["prompt_tokens"] > 0
        assert attrs["gen_ai.usage.completion_tokens"] == body["usage"]["completion_tokens"] == 6
        assert attrs["gen_ai.request.max_tokens"] == 6 and attrs["gen_ai.request.n"] == 1
        assert attrs["gen_ai.request.temperature"] == pytest.approx(0.5)
        assert 0 < attrs["gen_ai.latency.time_in_queue"] < attrs["gen_ai.latency.time_to_first_token"] \
            <= attrs["gen_ai.latency.e2e"]
        assert server.terminate() == 0
