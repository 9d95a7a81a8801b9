"""A minimal OTLP/HTTP trace receiver for tests and the tracing example: an HTTP server on a
loopback port that takes ``POST /v1/traces`` (``http/protobuf``, gzip or not), decodes each body as
an ``ExportTraceServiceRequest`` and keeps the spans as plain dicts.

As a script (``python tests/entrypoints/otlp_receiver.py --port 4318 --out spans.jsonl``) it writes one
JSON line per span until interrupted.
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
    in a thread; ``r.spans`` holds every span received; ``wait_for(pred, timeout_s)`` polls."""

    def __init__(self, port: int = 0, on_span=None) -> None:
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
                spans = decode_spans(body)
                with receiver._lock:
                    receiver.spans.extend(spans)
                for span in spans:
                    if receiver._on_span is not None:
                        receiver._on_span(span)
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

    def __enter__(self) -> "OTLPReceiver":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()

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
    parser.add_argument("--port", type=int, default=4318)
    parser.add_argument("--out", required=True, help="JSON lines file, one span a line")
    ns = parser.parse_args()
    out = open(ns.out, "a", buffering=1)
    with OTLPReceiver(ns.port, on_span=lambda s: out.write(json.dumps(s) + "\n")) as receiver:
        print(f"receiving OTLP traces on {receiver.endpoint}", flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
