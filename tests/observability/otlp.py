"""OTLP trace receivers on 127.0.0.1 that keep every span they are sent: one speaking
OTLP/HTTP (protobuf), one OTLP/gRPC (a real grpc server; grpcio comes with the gRPC
exporter of the otel extra)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

trace_service_pb2 = pytest.importorskip(
    "opentelemetry.proto.collector.trace.v1.trace_service_pb2",
    reason="the otel extra is not installed (pip install -e '.[otel]')")


@dataclass
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    start_ns: int = 0
    end_ns: int = 0


def _value(v: Any) -> Any:
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


def _keep(request: Any, into: list[Span]) -> None:
    for rs in request.resource_spans:
        res = {a.key: a.value.string_value for a in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                attrs = {a.key: _value(a.value) for a in s.attributes}
                into.append(Span(res["service.name"], s.name, s.trace_id.hex(),
                                 s.span_id.hex(), s.parent_span_id.hex(), attrs,
                                 s.start_time_unix_nano, s.end_time_unix_nano))


class Receiver:
    """Spans received so far, and a wait for those of one trace."""

    spans: list[Span]

    def of_trace(self, trace_id: str, done: Callable[[list[Span]], bool],
                 timeout: float = 15.0) -> list[Span]:
        """The trace's spans once `done` holds for them (or at the timeout, for the test's
        assertions to say what is missing). A count of spans is no such test: three
        processes export in batches of their own, so one process's spans can make up the
        count while another's are still on their way."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [s for s in self.spans if s.trace_id == trace_id]
            if done(found):
                return found
            time.sleep(0.1)
        return [s for s in self.spans if s.trace_id == trace_id]


class HttpReceiver(Receiver):
    """OTLP/HTTP traces endpoint (protobuf); `url` is the full `/v1/traces` URL, `base`
    what `OTEL_EXPORTER_OTLP_ENDPOINT` takes."""

    def __init__(self) -> None:
        self.spans = []
        received = self.spans

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                request = trace_service_pb2.ExportTraceServiceRequest()
                request.ParseFromString(body)
                if self.path == "/v1/traces":
                    _keep(request, received)
                reply = trace_service_pb2.ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.url = self.base + "/v1/traces"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class GrpcReceiver(Receiver):
    """OTLP/gRPC TraceService on loopback, plaintext; `url` is `http://127.0.0.1:PORT`."""

    def __init__(self) -> None:
        grpc = pytest.importorskip("grpc")
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as rpc

        self.spans = []
        received = self.spans

        class Collector(rpc.TraceServiceServicer):  # type: ignore[misc]
            def Export(self, request: Any, context: Any) -> Any:  # noqa: N802 (gRPC's)
                _keep(request, received)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        rpc.add_TraceServiceServicer_to_server(  # type: ignore[no-untyped-call]
            Collector(), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()
        self.url = f"http://127.0.0.1:{port}"

    def close(self) -> None:
        self.server.stop(grace=None)
