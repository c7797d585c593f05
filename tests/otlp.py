"""An OTLP/HTTP receiver for tests: what real processes export, decoded, in this process.

A collector is not available where the tests run, so a test starts this one on a free loopback
port and points the processes at it (``OTEL_EXPORTER_OTLP_ENDPOINT``). It accepts what the
OTLP/HTTP exporters send (``POST /v1/traces`` and ``/v1/metrics``, protobuf or JSON), answers
as a collector does, and keeps every span, decoded with the protocol's own message classes
(``opentelemetry-proto``), with its resource's ``service.name`` and ``process.pid``.
"""

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from google.protobuf import json_format
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue


@dataclass(frozen=True)
class ReceivedSpan:
    """One span as a process exported it, ids in hex."""

    trace_id: str
    span_id: str
    parent_id: str
    name: str
    scope: str
    service: str
    pid: int
    attributes: dict[str, Any]
    links: tuple[tuple[str, str], ...]
    start_ns: int
    end_ns: int

    @property
    def process(self) -> tuple[str, int]:
        return (self.service, self.pid)


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(item) for item in value.array_value.values]
    if kind == "kvlist_value":
        return _attributes(value.kvlist_value.values)
    return None if kind is None else getattr(value, kind)


def _attributes(pairs: Any) -> dict[str, Any]:
    found: dict[str, Any] = {}
    pair: KeyValue
    for pair in pairs:
        found[pair.key] = _value(pair.value)
    return found


class Receiver:
    """The spans received so far, and how many metric exports (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[ReceivedSpan] = []
        self.metric_exports = 0
        self.endpoint = ""

    def spans(self) -> list[ReceivedSpan]:
        with self._lock:
            return list(self._spans)

    def _traces(self, request: ExportTraceServiceRequest) -> None:
        received: list[ReceivedSpan] = []
        for resource_spans in request.resource_spans:
            resource = _attributes(resource_spans.resource.attributes)
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(),
                            name=span.name,
                            scope=scope_spans.scope.name,
                            service=str(resource.get("service.name", "")),
                            pid=int(resource.get("process.pid", 0)),
                            attributes=_attributes(span.attributes),
                            links=tuple(
                                (link.trace_id.hex(), link.span_id.hex()) for link in span.links
                            ),
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                        )
                    )
        with self._lock:
            self._spans += received


class _Handler(BaseHTTPRequestHandler):
    receiver: Receiver

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
        as_json = self.headers.get("Content-Type", "").startswith("application/json")
        if self.path == "/v1/traces":
            request = ExportTraceServiceRequest()
            response: Any = ExportTraceServiceResponse()
        elif self.path == "/v1/metrics":
            request = ExportMetricsServiceRequest()
            response = ExportMetricsServiceResponse()
        else:
            self.send_error(404)
            return
        if as_json:
            json_format.Parse(body, request)
        else:
            request.ParseFromString(body)
        if isinstance(request, ExportTraceServiceRequest):
            self.receiver._traces(request)
        else:
            self.receiver.metric_exports += 1
        payload = (
            json_format.MessageToJson(response).encode()
            if as_json
            else response.SerializeToString()
        )
        self.send_response(200)
        kind = "application/json" if as_json else "application/x-protobuf"
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, format: str, *args: Any) -> None:
        pass  # the test's output is its own


@contextmanager
def receiving() -> Iterator[Receiver]:
    """An OTLP/HTTP receiver on a free loopback port for the block; ``endpoint`` is its URL."""
    receiver = Receiver()
    handler = type("Handler", (_Handler,), {"receiver": receiver})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    receiver.endpoint = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="otlp-receiver", daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
