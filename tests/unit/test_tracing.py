"""common/tracing.py: when tracing is on, W3C context in and out, spans recorded after the
fact; and with it off, nothing of OpenTelemetry is imported by the router or the services."""

from __future__ import annotations

import subprocess
import sys

from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from common.tracing import Tracing, make_tracing, traces_endpoint
from tests.service_fixtures import REPO, child_env

CLIENT_TRACE = "0af7651916cd43dd8448eb211c80319c"
CLIENT_SPAN = "b7ad6b7169203331"


def test_the_flag_then_the_standard_variable_then_off() -> None:
    env = {"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://env:4317"}
    assert traces_endpoint("http://flag:4317", env) == "http://flag:4317"
    assert traces_endpoint("", env) == "http://env:4317"
    assert traces_endpoint("", {}) == ""
    assert traces_endpoint("http://flag:4317", {**env, "OTEL_SDK_DISABLED": "true"}) == ""


def test_off_imports_nothing_of_opentelemetry() -> None:
    code = (
        "import sys\n"
        "import router.app, router.cli, service.runtime, service.prefill_servicer, service.decode_servicer\n"
        "from common.tracing import make_tracing\n"
        "assert make_tracing('', 'x') is None\n"
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))\n"
    )
    env = child_env()
    env.pop("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", None)
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_context_in_spans_after_the_fact_context_out() -> None:
    exporter = InMemorySpanExporter()
    tracing = Tracing("unused", "pdserve-test", exporter=exporter)
    parent = tracing.extract([("Traceparent", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"), ("x", "y")])
    root = tracing.start("root", parent, kind="server", attributes={"a": 1, "none": None})
    child = tracing.record("child", root, 1_000, 2_000, {"b": "c"}, error="boom")
    carrier = dict(tracing.carrier(child))
    tracing.end(root)
    tracing.shutdown()
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert format(spans["root"].context.trace_id, "032x") == CLIENT_TRACE
    assert format(spans["root"].parent.span_id, "016x") == CLIENT_SPAN
    assert spans["child"].parent.span_id == spans["root"].context.span_id
    assert (spans["child"].start_time, spans["child"].end_time) == (1_000, 2_000)
    assert spans["child"].status.description == "boom"
    assert dict(spans["root"].attributes) == {"a": 1}
    assert spans["root"].resource.attributes["service.name"] == "pdserve-test"
    span_id = format(spans["child"].context.span_id, "016x")
    assert carrier["traceparent"] == f"00-{CLIENT_TRACE}-{span_id}-01"


def test_a_malformed_traceparent_starts_a_new_trace() -> None:
    exporter = InMemorySpanExporter()
    tracing = Tracing("unused", "pdserve-test", exporter=exporter)
    tracing.end(tracing.start("root", tracing.extract([("traceparent", "garbage")])))
    tracing.shutdown()
    (span,) = exporter.get_finished_spans()
    assert span.parent is None and span.context.trace_id != 0


def test_make_tracing_on_with_an_endpoint() -> None:
    tracing = make_tracing("http://127.0.0.1:1", "pdserve-test")
    assert isinstance(tracing, Tracing)
    tracing.shutdown()  # nothing buffered: returns at once
