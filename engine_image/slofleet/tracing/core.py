"""One trace per request across router and engines: the W3C trace context in and out, OpenTelemetry spans, OTLP
export when an endpoint is given, and the last requests' spans kept in memory for GET /debug/traces (no collector
needed).

Each process keeps and exports its own spans (never through the global TracerProvider) and samples every request:
an LLM request costs far more than its dozen spans, and the store must hold the one slow request someone asks about.
A caller's traceparent is continued (its trace id kept) whatever its sampled flag says. Spans carry timings, counts,
ids and replica addresses, never prompt or output text."""
from __future__ import annotations

import collections
import random
import re
import time
import urllib.parse
from collections.abc import Awaitable

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from slofleet.api.contract import REQUEST_ID_HEADER

REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")  # a client's own x-request-id must match, else it gets a new one
REQUEST_ID_ATTR = "slofleet.request_id"
ROLE_ATTR = "slofleet.role"
PEER_ATTRS = ("slofleet.replica", "slofleet.prefill_replica")  # the engines a router span sent the request to
KEEP = 512  # requests whose spans are kept in memory per process (a few KiB each)
SPANS_PER_REQUEST = 1024
PROPAGATOR = TraceContextTextMapPropagator()
CLIENT, INTERNAL = SpanKind.CLIENT, SpanKind.INTERNAL


def request_id(given: str | None) -> str:
    """A caller's own request id when well-formed (it lands in headers, logs and spans: bounded length and
    charset), else a new one (random, not secret: no system call for it)."""
    return given if given and REQUEST_ID.fullmatch(given) else f"{random.getrandbits(96):024x}"


def request_id_of(scope) -> str:
    raw = next((v for k, v in scope["headers"] if k == REQUEST_ID_HEADER.encode()), None)  # ASGI: lower-case names
    return request_id(raw.decode("latin-1") if raw else None)


def with_request_id(send, rid: str):
    """An ASGI send that puts x-request-id on the response head. A plain function returning send's own awaitable:
    no coroutine of its own on every streamed chunk."""
    header = (REQUEST_ID_HEADER.encode(), rid.encode())

    def sender(message) -> Awaitable[None]:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", ()), header]}
        return send(message)

    return sender


def attributes(kw: dict) -> dict:
    return {f"slofleet.{k}": v for k, v in kw.items() if v is not None}


def traces_url(endpoint: str) -> str:
    """OTLP/HTTP's traces path when the URL names only a collector (http://collector:4318)."""
    return endpoint.rstrip("/") + "/v1/traces" if urllib.parse.urlsplit(endpoint).path in ("", "/") else endpoint


SCOPE = InstrumentationScope("slofleet")
UNSET, ERROR = Status(StatusCode.UNSET), Status(StatusCode.ERROR)
SAMPLED = TraceFlags(TraceFlags.SAMPLED)  # every request is sampled (see above)


class LeanSpan:
    """A span at the cost of a few stores; a ReadableSpan is made of it only for an OTLP exporter. The SDK's own Span
    (a sampler call, a lock, bounded attribute, event and link lists, processors on start and end) costs ~15 us, and
    the router makes half a dozen per request on its hot path. Ids are kept as ints and SpanContexts made only when
    asked for; the keyword attributes a span is made with are qualified (`slofleet.` prefixed) only when read.
    Attribute values: str, int, float, bool."""
    __slots__ = ("ctx", "span_id", "up", "name", "kind", "start_time", "end_time", "kw", "extra", "events", "status")

    def __init__(self, ctx: tuple, name: str, span_id: int, up: int | SpanContext | None, kind: SpanKind,
                 start_ns: int | None, kw: dict, extra: dict | None = None):
        # ctx: the trace's (Tracing, tid, trace_id, trace state), shared by its spans; not the RequestTrace, which
        # holds its spans: that would make a cycle for the collector
        self.ctx, self.span_id, self.up, self.name, self.kind = ctx, span_id, up, name, kind  # up: parent's id
        self.start_time, self.end_time, self.kw, self.extra = start_ns or time.time_ns(), None, kw, extra
        self.events: list[Event] | tuple = ()  # a list once an event is added (most spans have none)
        self.status = UNSET

    @property
    def tid(self) -> str:
        return self.ctx[1]

    @property
    def context(self) -> SpanContext:
        return SpanContext(self.ctx[2], self.span_id, False, SAMPLED, self.ctx[3])

    @property
    def parent(self) -> SpanContext | None:
        """The parent span's context here, or the caller's for a root that continues one (None: a new trace)."""
        up = self.up
        return SpanContext(self.ctx[2], up, False, SAMPLED, self.ctx[3]) if isinstance(up, int) else up

    @property
    def parent_id(self) -> int | None:
        up = self.up
        return up if up is None or isinstance(up, int) else up.span_id

    @property
    def resource(self) -> Resource:
        return self.ctx[0].resource

    @property
    def attributes(self) -> dict:
        return {**(self.extra or {}), **attributes(self.kw)}

    def set_attribute(self, key: str, value) -> None:
        self.set_attributes({key: value})

    def set_attributes(self, attrs: dict) -> None:
        if self.extra is None:
            self.extra = {}
        self.extra.update(attrs)

    def note(self, **kw) -> None:
        """Keyword attributes, as the span was made with (qualified when read)."""
        self.kw.update(kw)

    def set_status(self, status: Status) -> None:
        self.status = status

    def add_event(self, name: str, attributes: dict | None = None, timestamp: int | None = None) -> None:
        self.events = [*self.events, Event(name, attributes, timestamp or time.time_ns())]

    def end(self, end_time: int | None = None) -> None:
        if self.end_time is None:  # once, as the SDK's
            self.end_time = end_time or time.time_ns()
            export = self.ctx[0].export
            if export is not None:
                export.on_end(ReadableSpan(
                    self.name, self.context, self.parent, self.resource, self.attributes, self.events,
                    kind=self.kind, status=self.status, start_time=self.start_time, end_time=self.end_time,
                    instrumentation_scope=SCOPE))


def new_span_id() -> int:
    return random.getrandbits(64) or 1  # 0 is W3C's invalid id


class RequestTrace:
    """One request's spans in this process: a SERVER root continuing the caller's trace context, and its children.
    Its spans are in the store from the start, each shown once it has ended (by trace id; by request id, once the
    root has)."""
    __slots__ = ("request_id", "tid", "ctx", "root", "spans")

    def __init__(self, tracing: Tracing, method: str, path: str, carrier: dict[str, str], rid: str,
                 start_ns: int | None, attrs: dict):
        self.request_id = rid
        parent = None
        if "traceparent" in carrier:
            parent = trace.get_current_span(PROPAGATOR.extract(carrier)).get_span_context()
        if parent is not None and parent.is_valid:  # its trace goes on, whatever its sampled flag says
            trace_id, state = parent.trace_id, parent.trace_state
        else:
            parent, trace_id, state = None, random.getrandbits(128) or 1, None
        self.tid = f"{trace_id:032x}"
        self.ctx = (tracing, self.tid, trace_id, state)
        self.root = LeanSpan(self.ctx, f"{method} {path}", new_span_id(), parent, SpanKind.SERVER, start_ns, attrs,
                             {"http.request.method": method, "url.path": path, REQUEST_ID_ATTR: rid})
        self.spans = [self.root]
        tracing.recent.add(self.tid, rid, self.spans)

    @property
    def start_ns(self) -> int:
        return self.root.start_time

    def span(self, name: str, start_ns: int | None = None, end_ns: int | None = None,
             parent: LeanSpan | None = None, kind: SpanKind = INTERNAL, **kw) -> LeanSpan:
        """A child of the root (or of `parent`), ended at end_ns when one is given."""
        s = LeanSpan(self.ctx, name, new_span_id(), (parent or self.root).span_id, kind, start_ns, kw)
        if len(self.spans) < SPANS_PER_REQUEST:  # past it, a span works but is not kept
            self.spans.append(s)
        if end_ns is not None:
            s.end(end_ns)
        return s

    def headers(self, span: LeanSpan | None = None) -> dict[str, str]:
        """traceparent (and tracestate) naming `span` (default: the root) as the parent of a request it sends (the
        W3C format, as the propagator writes it; every span here is sampled)."""
        out = {"traceparent": f"00-{self.tid}-{(span or self.root).span_id:016x}-01"}
        state = self.ctx[3]
        if state:
            out["tracestate"] = state.to_header()
        return out

    def end(self, status: int | None, end_ns: int | None = None, **kw) -> None:
        root = self.root
        if status is not None:
            root.set_attribute("http.response.status_code", status)
            if status >= 500:
                root.set_status(ERROR)
        root.note(**kw)
        root.end(end_ns)


class Tracing:
    def __init__(self, component: str, role: str, instance: str = "", otlp_endpoint: str = "", keep: int = KEEP):
        resource = {"service.name": f"slofleet-{component}", ROLE_ATTR: role, "service.instance.id": instance}
        self.resource = Resource.create({k: v for k, v in resource.items() if v})
        self.recent = Recent(keep)
        self.export: SpanProcessor | None = None
        if otlp_endpoint:  # imported only then: protobuf and requests stay out of a process that exports nothing
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            self.export = BatchSpanProcessor(OTLPSpanExporter(traces_url(otlp_endpoint)))

    def begin(self, method: str, path: str, carrier: dict[str, str], rid: str, start_ns: int | None = None,
              **attrs) -> RequestTrace:
        """The trace of one request arriving with `carrier`'s headers (traceparent, tracestate)."""
        return RequestTrace(self, method, path, carrier, rid, start_ns, attrs)

    def shutdown(self) -> None:
        if self.export is not None:
            self.export.shutdown()  # flushes the OTLP batch


def span_dict(span: LeanSpan) -> dict:
    res = span.resource.attributes
    pid = span.parent_id
    return {"trace_id": span.tid, "span_id": f"{span.span_id:016x}",
            "parent_id": f"{pid:016x}" if pid else None, "name": span.name,
            "service": res.get("service.name"), "role": res.get(ROLE_ATTR), "instance": res.get("service.instance.id"),
            "kind": span.kind.name.lower(), "start_ns": span.start_time, "end_ns": span.end_time,
            "status": span.status.status_code.name.lower(), "attributes": dict(span.attributes or {}),
            "events": [{"name": e.name, "time_ns": e.timestamp, "attributes": dict(e.attributes or {})}
                       for e in span.events]}


class Recent:
    """The spans of the last `keep` requests (a ring: one append per request, no lookup structure to keep up), found
    by trace id or by request id when asked for, and turned into plain dicts only then. A trace may span several
    requests (retries, a client reusing a trace id): a look-up gathers it from every request kept."""

    def __init__(self, keep: int):
        # no lock: a deque's append and its copy into a list are each one step under the GIL, whatever thread reads
        self.requests: collections.deque[tuple[str, str, list[LeanSpan]]] = collections.deque(maxlen=keep)

    def add(self, tid: str, rid: str, spans: list[LeanSpan]) -> None:
        """A request's (trace id, request id, spans): the list is its RequestTrace's own, so spans made later are
        in it too."""
        self.requests.append((tid, rid, spans))

    def kept(self) -> list[tuple[str, str, list[LeanSpan]]]:
        """(trace id, request id, its ended spans) of each request kept, newest first."""
        requests = list(self.requests)
        return [(tid, rid, [s for s in list(spans) if s.end_time is not None])
                for tid, rid, spans in reversed(requests)]

    def get(self, key: str) -> dict | None:
        """{"trace_id", "spans"}: a trace's spans here, or a request's (the spans under those naming its request id;
        a reused request id: its latest trace)."""
        kept = self.kept()
        tid = key if any(t == key for t, _, _ in kept) else next((t for t, r, _ in kept if r == key), None)
        found = sorted((span_dict(s) for t, _, spans in kept if t == tid for s in spans), key=lambda s: s["start_ns"])
        if not found:
            return None
        return {"trace_id": tid, "spans": found if key == tid else subtree(found, key)}

    def summaries(self) -> list[dict]:
        traces: dict[str, list[LeanSpan]] = {}  # newest first, as kept() gives them
        for tid, _, spans in self.kept():
            traces.setdefault(tid, []).extend(spans)
        out = []
        for tid, spans in traces.items():
            if not spans:
                continue
            start, end = min(s.start_time for s in spans), max(s.end_time for s in spans)
            ids = {s.span_id for s in spans}
            root = min((s for s in spans if s.parent_id not in ids), key=lambda s: s.start_time)
            rids = sorted({a[REQUEST_ID_ATTR] for a in (s.attributes for s in spans) if REQUEST_ID_ATTR in a})
            out.append({"trace_id": tid, "request_ids": rids[:20], "name": root.name, "start_ns": start,
                        "duration_ms": round((end - start) / 1e6, 3), "spans": len(spans)})
        return out


def subtree(spans: list[dict], rid: str) -> list[dict]:
    """The spans that name request `rid` and every span below them (a trace may hold several requests)."""
    children: dict[str | None, list[dict]] = {}
    for s in spans:
        children.setdefault(s["parent_id"], []).append(s)
    out, todo = [], [s for s in spans if s["attributes"].get(REQUEST_ID_ATTR) == rid]
    seen = {s["span_id"] for s in todo}
    while todo:
        s = todo.pop()
        out.append(s)
        for c in children.get(s["span_id"], ()):
            if c["span_id"] not in seen:
                seen.add(c["span_id"])
                todo.append(c)
    return sorted(out, key=lambda s: s["start_ns"])


def peers(spans: list[dict]) -> set[str]:
    """The engine URLs these (router) spans sent the request to: where the rest of its trace is kept."""
    return {s["attributes"][a] for s in spans for a in PEER_ATTRS if a in s["attributes"]}


def merge(trace_id: str, rid: str | None, parts: list[list[dict]]) -> dict:
    """A trace's spans from several processes, or only request `rid`'s."""
    spans = list({s["span_id"]: s for part in parts for s in part}.values())
    return {"trace_id": trace_id, "spans": sorted(spans, key=lambda s: s["start_ns"]) if rid is None
            else subtree(spans, rid)}
