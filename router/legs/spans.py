"""The router's spans of one request (docs/design.md §3 "Tracing").

One trace per HTTP request: ``pdserve.request`` (SERVER; continues the client's W3C
``traceparent`` or starts a trace) holds ``router.queue`` (admission), ``router.route``
(the placement decision), one CLIENT span per gRPC call (``prefill``, ``decode``; a
resumed decode stream after a failover is another ``decode`` span of the same trace, with
``pdserve.failover``), and ``kv.transfer`` (the prompt's KV from the prefill's save to
the decode's load). The services' own spans hang below the CLIENT spans: their context
travels in the calls' metadata (:meth:`RequestSpans.call_metadata`).

Made only when tracing is on (``Trace.spans`` is None otherwise): nothing here runs, and
nothing of OpenTelemetry is imported, for an untraced request. Attribute names follow
OpenTelemetry's GenAI semantic conventions where they have one (``gen_ai.*``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from common.tracing import Tracing, wall_ns


def _scalars(prefix: str, values: Mapping[str, Any]) -> dict[str, Any]:
    """Span attributes from a dict: its scalar values, nested dicts flattened with dots."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        if isinstance(value, Mapping):
            out.update(_scalars(f"{prefix}{key}.", value))
        elif isinstance(value, str | int | float | bool):
            out[f"{prefix}{key}"] = value
    return out


@dataclass(slots=True)
class RequestSpans:
    """The open root span of a request and the tracer its child spans go to."""

    tracing: Tracing
    root: Any

    @classmethod
    def begin(
        cls,
        tracing: Tracing,
        headers: Iterable[tuple[str, str]],
        arrival: float,
        attributes: Mapping[str, Any],
    ) -> RequestSpans:
        """The request's root span, from its arrival (a ``perf_counter`` reading)."""
        parent = tracing.extract(headers)
        root = tracing.start(
            "pdserve.request",
            parent,
            kind="server",
            attributes=attributes,
            start_ns=wall_ns(arrival),
        )
        return cls(tracing, root)

    def queue(self, arrival: float, seconds: float, jobs: int) -> None:
        """``router.queue``: validation, tokenization and admission, before any call."""
        start = wall_ns(arrival)
        self.tracing.record(
            "router.queue", self.root, start, start + int(seconds * 1e9), {"pdserve.prompts": jobs}
        )

    def route(self, started: float, decision: str | None, placement: Mapping[str, Any]) -> None:
        """``router.route``: the placement decision and its inputs."""
        attrs = {"pdserve.decision": decision, **_scalars("pdserve.placement.", placement)}
        self.tracing.record("router.route", self.root, wall_ns(started), time.time_ns(), attrs)

    def call(self, name: str, request_id: str, route: Mapping[str, Any], **attrs: Any) -> Any:
        """A CLIENT span for one gRPC call, with the chosen instance and why (its KV hit)."""
        attributes = {
            "rpc.system": "grpc",
            "pdserve.request_id": request_id,
            **_scalars("pdserve.route.", route),
            **attrs,
        }
        return self.tracing.start(name, self.root, kind="client", attributes=attributes)

    def call_metadata(self, span: Any, metadata: tuple[tuple[str, str], ...]) -> tuple:
        """The call's metadata plus ``span``'s trace context."""
        return (*metadata, *self.tracing.carrier(span))

    def end_call(self, span: Any, error: str | None = None, **attrs: Any) -> None:
        for key, value in attrs.items():
            if value is not None:
                span.set_attribute(key, value)
        self.tracing.end(span, error=error)

    def transfer(self, started: float, ended: float, figures: Mapping[str, Any]) -> None:
        """``kv.transfer``: from the prefill's first token (its save starts) to the end of
        the decode's load, with the request's transfer figures."""
        self.tracing.record(
            "kv.transfer",
            self.root,
            wall_ns(started),
            wall_ns(ended),
            _scalars("pdserve.kv.", figures),
        )

    def first_token(self, ttft: float) -> None:
        self.root.add_event("first_token", {"pdserve.ttft_s": ttft})

    def finish(self, outcome: str, attributes: Mapping[str, Any]) -> None:
        """End the root span with the outcome and the usage figures."""
        for key, value in attributes.items():
            if value is not None:
                self.root.set_attribute(key, value)
        self.root.set_attribute("pdserve.outcome", outcome)
        self.tracing.end(self.root, error=None if outcome == "success" else outcome)
