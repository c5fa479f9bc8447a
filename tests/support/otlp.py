"""A stand-in OTLP/HTTP collector on loopback (not a real collector): records every POST /v1/traces, decoded with the
OTLP protobuf schema, so tests see that spans really arrive in the wire format collectors take."""
from __future__ import annotations

import gzip
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest


class OTLPStandIn:
    def __init__(self):
        self.requests: list[tuple[str, str, ExportTraceServiceRequest]] = []  # (path, content type, request)
        received = self.requests

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                if self.headers.get("content-encoding") == "gzip":
                    body = gzip.decompress(body)
                received.append((self.path, self.headers.get("content-type", ""),
                                 ExportTraceServiceRequest.FromString(body)))
                self.send_response(200)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def spans(self) -> list[tuple[str, str, str]]:
        """(service.name, span name, trace id in hex) of every span received."""
        out = []
        for _, _, req in list(self.requests):
            for rs in req.resource_spans:
                service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
                out += [(service, s.name, s.trace_id.hex()) for ss in rs.scope_spans for s in ss.spans]
        return out

    def wait_for(self, trace_id: str, services: set[str], names: frozenset[str] = frozenset(),
                 timeout: float = 20) -> list[tuple[str, str, str]]:
        """The spans of `trace_id` once every one of `services` has sent some and every one of `names` has come
        (each process exports in batches, so one batch may arrive before the others)."""
        deadline = time.monotonic() + timeout
        while True:
            got = [s for s in self.spans() if s[2] == trace_id]
            if services <= {s[0] for s in got} and names <= {s[1] for s in got}:
                return got
            assert time.monotonic() < deadline, f"no OTLP spans {set(names)} of {trace_id} from {services}: {got}"
            time.sleep(0.1)

    def stop(self) -> None:
        self.server.shutdown()
