"""OpenTelemetry tracing, off unless configured (docs/design.md §3 "Tracing").

A process traces when it is given ``--otlp-traces-endpoint`` (vLLM's flag) or the
standard ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``; the SDK's other ``OTEL_*`` variables
(``OTEL_SERVICE_NAME``, ``OTEL_EXPORTER_OTLP_TRACES_PROTOCOL``/``_HEADERS``/``_INSECURE``,
``OTEL_BSP_SCHEDULE_DELAY``, ``OTEL_TRACES_SAMPLER``...) apply as documented by OpenTelemetry.
With tracing off the caller holds ``None`` instead of a :class:`Tracing`: the SDK is never
imported and no span object is made (the ``opentelemetry`` packages are the optional extra
``pdserve[tracing]``).

The W3C trace context (``traceparent``/``tracestate``) travels in HTTP headers and gRPC
metadata alike; :meth:`Tracing.extract` and :meth:`Tracing.carrier` convert. Spans may be
recorded after the fact with explicit wall-clock times (:meth:`Tracing.record`): the
engine services emit their phase spans from the timings the engine already reports, so
the engine's step loop does no tracing work at all.

Torch-free; imports nothing of ours.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from typing import Any

logger = logging.getLogger(__name__)

TRACE_HEADERS = ("traceparent", "tracestate")
ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
ENDPOINT_HELP = (
    "send OpenTelemetry traces (OTLP) to this endpoint, e.g. http://collector:4317; "
    f"empty = {ENDPOINT_ENV} if set, else no tracing"
)


def traces_endpoint(flag: str, environ: Mapping[str, str] | None = None) -> str:
    """The endpoint to export to: the flag, else ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``;
    "" (tracing off) also when ``OTEL_SDK_DISABLED=true``."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return ""
    return flag or env.get(ENDPOINT_ENV, "")


def make_tracing(flag: str, service_name: str) -> Tracing | None:
    """A :class:`Tracing` when an endpoint is configured, else None (nothing imported)."""
    endpoint = traces_endpoint(flag)
    if not endpoint:
        return None
    tracing = Tracing(endpoint, service_name)
    logger.info("tracing: exporting spans of %s to %s", service_name, endpoint)
    return tracing


def wall_ns(monotonic_at: float, now_mono: float | None = None, now_ns: int | None = None) -> int:
    """Epoch nanoseconds of a ``time.monotonic()``/``perf_counter()`` reading (spans need
    wall-clock times; the timings are measured on a monotonic clock)."""
    mono = time.perf_counter() if now_mono is None else now_mono
    ns = time.time_ns() if now_ns is None else now_ns
    return ns - int((mono - monotonic_at) * 1e9)


def _exporter(endpoint: str) -> Any:
    protocol = os.environ.get(
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    )
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=endpoint)
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
            OTLPSpanExporter as HttpExporter,
        )

        return HttpExporter(endpoint=endpoint)
    raise ValueError(f"unsupported OTLP traces protocol {protocol!r} (grpc or http/protobuf)")


class Tracing:
    """One process's tracer provider (owned here, never the SDK's global one), its
    exporter, and the W3C propagator."""

    def __init__(self, endpoint: str, service_name: str, exporter: Any = None) -> None:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        # OTEL_SERVICE_NAME, when set, names the service (Resource.create reads it).
        attrs = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": service_name}
        self._provider = TracerProvider(resource=Resource.create(attrs))
        self._provider.add_span_processor(BatchSpanProcessor(exporter or _exporter(endpoint)))
        self._tracer = self._provider.get_tracer("pdserve")
        self._propagator = TraceContextTextMapPropagator()
        self._trace = trace
        self._kinds = {
            "internal": trace.SpanKind.INTERNAL,
            "server": trace.SpanKind.SERVER,
            "client": trace.SpanKind.CLIENT,
        }

    def extract(self, pairs: Iterable[tuple[str, Any]]) -> Any:
        """The context a caller sent (HTTP headers or gRPC metadata pairs); an empty
        context (a new trace) when it sent none or a malformed one."""
        carrier = {k.lower(): v for k, v in pairs if k.lower() in TRACE_HEADERS}
        return self._propagator.extract(carrier)

    def carrier(self, span: Any) -> tuple[tuple[str, str], ...]:
        """``span``'s context as headers/metadata pairs, for the next hop."""
        out: dict[str, str] = {}
        self._propagator.inject(out, context=self._trace.set_span_in_context(span))
        return tuple(out.items())

    def start(
        self,
        name: str,
        parent: Any,
        *,
        kind: str = "internal",
        attributes: Mapping[str, Any] | None = None,
        start_ns: int | None = None,
    ) -> Any:
        """A started span; ``parent`` is a span, a context from :meth:`extract`, or None."""
        return self._tracer.start_span(
            name,
            context=self._context(parent),
            kind=self._kinds[kind],
            attributes=_clean(attributes),
            start_time=start_ns,
        )

    def end(self, span: Any, *, end_ns: int | None = None, error: str | None = None) -> None:
        if error is not None:
            from opentelemetry.trace import Status, StatusCode

            span.set_status(Status(StatusCode.ERROR, error))
        span.end(end_time=end_ns)

    def record(
        self,
        name: str,
        parent: Any,
        start_ns: int,
        end_ns: int,
        attributes: Mapping[str, Any] | None = None,
        *,
        kind: str = "internal",
        error: str | None = None,
    ) -> Any:
        """A span that already happened, from its wall-clock start and end."""
        span = self.start(name, parent, kind=kind, attributes=attributes, start_ns=start_ns)
        self.end(span, end_ns=max(start_ns, end_ns), error=error)
        return span

    def shutdown(self) -> None:
        """Export what is still buffered, then stop (at process exit)."""
        try:
            self._provider.shutdown()
        except Exception:  # an unreachable collector must not fail the shutdown
            logger.warning("tracing: flushing spans at shutdown failed", exc_info=True)

    def _context(self, parent: Any) -> Any:
        if parent is None or not hasattr(parent, "get_span_context"):
            return parent
        return self._trace.set_span_in_context(parent)


def _clean(attributes: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Attributes without None values (OpenTelemetry drops them with a warning)."""
    if not attributes:
        return None
    return {k: v for k, v in attributes.items() if v is not None}
