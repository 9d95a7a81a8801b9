"""A minimal OTLP trace receiver for tests and the tracing example: an HTTP server on a loopback
port that takes ``POST /v1/traces`` (``http/protobuf``, gzip or not) and, if asked, a gRPC
``TraceService`` too; each export is decoded as an ``ExportTraceServiceRequest`` and its spans kept
as plain dicts.

As a script (``python tests/entrypoints/otlp_receiver.py --port 4318 --grpc-port 4317 --out
spans.jsonl``) it writes one JSON line per span until interrupted.
"""

from __future__ import annotations

import argparse
import gzip
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def _value(any_value):
    kind = any_value.WhichOneof("value")
    return None if kind is None else getattr(any_value, kind)


def decode_spans(body: bytes) -> list[dict]:
    """The spans of one ``ExportTraceServiceRequest`` body: name, kind, trace_id / span_id /
    parent_span_id (hex; parent "" for a root span), start_ns / end_ns, attributes, service_name."""
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    request = ExportTraceServiceRequest()
    request.ParseFromString(body)
    return spans_of_request(request)


def spans_of_request(request) -> list[dict]:
    """The spans of an ``ExportTraceServiceRequest`` message (see ``decode_spans``)."""
    spans = []
    for resource_spans in request.resource_spans:
        resource = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append({
                    "name": span.name, "kind": span.kind, "trace_id": span.trace_id.hex(),
                    "span_id": span.span_id.hex(), "parent_span_id": span.parent_span_id.hex(),
                    "start_ns": span.start_time_unix_nano, "end_ns": span.end_time_unix_nano,
                    "attributes": {a.key: _value(a.value) for a in span.attributes},
                    "service_name": resource.get("service.name"), "scope": scope_spans.scope.name})
    return spans


class OTLPReceiver:
    """``with OTLPReceiver() as r``: serves on ``r.endpoint`` (``http://127.0.0.1:<port>/v1/traces``)
    in a thread, and with ``grpc_port`` (0: a free one) on ``r.grpc_endpoint`` too
    (``grpc://127.0.0.1:<port>``); ``r.spans`` holds every span received; ``wait_for(pred,
    timeout_s)`` polls."""

    def __init__(self, port: int = 0, on_span=None, grpc_port: int | None = None) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse

        receiver = self
        self.spans: list[dict] = []
        self._lock = threading.Lock()
        self._on_span = on_span
        reply = ExportTraceServiceResponse().SerializeToString()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):   # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                if self.path != "/v1/traces":
                    self.send_response(404)
                    self.end_headers()
                    return
                receiver._add(decode_spans(body))
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.port = self.server.server_address[1]
        self.endpoint = f"http://127.0.0.1:{self.port}/v1/traces"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.grpc_server = None if grpc_port is None else self._grpc_server(grpc_port)

    def _grpc_server(self, port: int):
        from concurrent import futures

        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        receiver = self

        class Servicer(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):   # noqa: N802 (the service's name)
                receiver._add(spans_of_request(request))
                return trace_service_pb2.ExportTraceServiceResponse()

        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Servicer(), server)
        self.grpc_port = server.add_insecure_port(f"127.0.0.1:{port}")
        self.grpc_endpoint = f"grpc://127.0.0.1:{self.grpc_port}"
        return server

    def _add(self, spans: list[dict]) -> None:
        with self._lock:
            self.spans.extend(spans)
        for span in spans:
            if self._on_span is not None:
                self._on_span(span)

    def __enter__(self) -> "OTLPReceiver":
        self._thread.start()
        if self.grpc_server is not None:
            self.grpc_server.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        if self.grpc_server is not None:
            self.grpc_server.stop(grace=None)

    def wait_for(self, predicate, timeout_s: float = 30.0) -> list[dict]:
        """The received spans that satisfy ``predicate``, once there is one (or [] after ``timeout_s`` s)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                found = [s for s in self.spans if predicate(s)]
            if found or time.monotonic() > deadline:
                return found
            time.sleep(0.1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=4318, help="OTLP/HTTP port")
    parser.add_argument("--grpc-port", type=int, default=None, help="also an OTLP/gRPC receiver on this port")
    parser.add_argument("--out", required=True, help="JSON lines file, one span a line")
    ns = parser.parse_args()
    out = open(ns.out, "a", buffering=1)
    with OTLPReceiver(ns.port, on_span=lambda s: out.write(json.dumps(s) + "\n"), grpc_port=ns.grpc_port) as receiver:
        print(f"receiving OTLP traces on {receiver.endpoint}"
              + (f" and {receiver.grpc_endpoint}" if receiver.grpc_server is not None else ""), flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
