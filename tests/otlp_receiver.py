"""A real OTLP/gRPC trace receiver for tests: opentelemetry-proto's ``TraceService`` served
by a grpc server on 127.0.0.1, keeping every span it is sent (docs/testing.md)."""

from __future__ import annotations

import threading
import time
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


@dataclass(slots=True)
class SpanRow:
    """One received span, flattened: ids as hex, attributes as Python values."""

    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    start_ns: int
    end_ns: int
    status: int  # 0 unset, 1 ok, 2 error
    attrs: dict[str, Any] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)


def _value(v: Any) -> Any:
    which = v.WhichOneof("value")
    if which == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, which) if which else None


class _Servicer(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, sink: OtlpReceiver) -> None:
        self._sink = sink

    def Export(self, request: Any, context: Any) -> Any:
        rows = []
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    rows.append(
                        SpanRow(
                            service=str(resource.get("service.name", "")),
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            kind=s.kind,
                            start_ns=s.start_time_unix_nano,
                            end_ns=s.end_time_unix_nano,
                            status=s.status.code,
                            attrs={a.key: _value(a.value) for a in s.attributes},
                            events=[e.name for e in s.events],
                        )
                    )
        self._sink.add(rows)
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """``with OtlpReceiver() as r:`` spans exported to ``r.endpoint`` land in ``r.spans``."""

    def __init__(self) -> None:
        self.spans: list[SpanRow] = []
        self._lock = threading.Lock()
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_Servicer(self), self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        self.endpoint = f"http://127.0.0.1:{port}"

    def __enter__(self) -> OtlpReceiver:
        self._server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.stop(grace=None)

    def add(self, rows: list[SpanRow]) -> None:
        with self._lock:
            self.spans.extend(rows)

    def trace(self, trace_id: str) -> list[SpanRow]:
        with self._lock:
            return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(
        self,
        trace_id: str,
        names: set[str],
        outside: str = "",
        timeout: float = 30.0,
        complete: bool = True,
    ) -> list[SpanRow]:
        """The trace's spans once every name in ``names`` has arrived and every parent but
        ``outside`` (the client's span) with them: a process exports a span when it ends,
        so a parent may come after its children (AssertionError at the deadline).
        ``complete=False``: do not wait for parents (a killed process never sends its
        open spans)."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.trace(trace_id)
            known = {s.span_id for s in spans} | {outside}
            parents = not complete or all(s.parent_id in known for s in spans)
            if names <= {s.name for s in spans} and parents:
                return spans
            if time.monotonic() > deadline:
                got = sorted((s.service, s.name) for s in spans)
                raise AssertionError(
                    f"trace {trace_id}: missing {names - {n for _, n in got}}; got {got}"
                )
            time.sleep(0.1)
