"""Bench serve's request bodies, URLs, flag parsing and text reports."""

from __future__ import annotations

import argparse
import math

import pytest

from pdserve.bench.metrics import RequestRecord, Slo, summarize
from pdserve.bench.serve import rate_list
from pdserve.bench.serve_client import Target, build_body
from pdserve.bench.serve_report import format_summary, format_sweep, record_to_dict
from pdserve.bench.workloads import Prompt


def test_target_url_and_validation() -> None:
    for base in ("http://h:1", "http://h:1/", "http://h:1/v1", "http://h:1/v1/"):
        assert Target(base, "m").url == "http://h:1/v1/completions"
        assert Target(base, "m", endpoint="chat").url == "http://h:1/v1/chat/completions"
    for bad, msg in (
        (Target("h:1", "m"), "http://"),
        (Target("http://h", "m", endpoint="embed"), "unknown endpoint"),
        (Target("http://h", "m", timeout_s=0), "timeout"),
    ):
        with pytest.raises(ValueError, match=msg):
            bad.validate()


def test_bodies() -> None:
    prompt = Prompt("hello there", 2, 7)
    body = build_body(Target("http://h", "m"), prompt)
    assert body == {
        "model": "m",
        "max_tokens": 7,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
        "temperature": 0.0,
        "prompt": "hello there",
    }
    chat = build_body(Target("http://h", "m", endpoint="chat", request_timings=True), prompt)
    assert chat["messages"] == [{"role": "user", "content": "hello there"}]
    assert "prompt" not in chat and chat["pdserve_timings"] is True


def test_rate_list() -> None:
    assert rate_list("1, 2.5,inf") == [1.0, 2.5, math.inf]
    for bad in ("", "0", "1,-2", "x"):
        with pytest.raises((argparse.ArgumentTypeError, ValueError)):
            rate_list(bad)


def records() -> list[RequestRecord]:
    ok = RequestRecord(10, ok=True, output_tokens=3, chunk_times=[0.1, 0.2, 0.3], e2e=0.3)
    bad = RequestRecord(10, error="http_503", error_detail="overloaded")
    return [ok, bad]


def test_summary_table_lists_everything() -> None:
    s = summarize(records(), 2.0, Slo(e2e_ms=1000))
    text = format_summary(s, "T")
    for needle in (
        "Successful requests:",
        "errors[http_503]:",
        "Request goodput (req/s):",
        "P99 TTFT (ms):",
        "Mean TPOT (ms):",
        "P90 ITL (ms):",
        "P50 E2E (ms):",
    ):
        assert needle in text
    assert "Router phase timings" not in text  # none were returned
    no_slo = format_summary(summarize(records(), 2.0, None))
    assert "goodput" not in no_slo


def test_sweep_table_row() -> None:
    s = summarize(records(), 2.0, Slo(e2e_ms=1000))
    table = format_sweep([(4.0, s)]).splitlines()
    assert len(table) == 3 and table[1].startswith("|---|")
    # rate, done, failed, req/s, out tok/s, TTFT p50, TTFT p99, ITL p50, ITL p99, TPOT p50,
    # E2E p99, goodput
    assert (
        table[2]
        == "| 4 | 1 | 1 | 0.50 | 1.5 | 100.0 | 100.0 | 100.0 | 100.0 | 100.0 | 300.0 | 0.50 |"
    )


def test_record_json() -> None:
    d = record_to_dict(records()[0])
    assert d["ttft"] == pytest.approx(0.1) and d["tpot"] == pytest.approx(0.1)
    assert d["chunk_times"] == [0.1, 0.2, 0.3]


def test_load_spec_validation() -> None:
    from pdserve.bench.serve_runner import LoadSpec

    LoadSpec(max_requests=None, duration_s=5, request_rate=2.0).validate()
    LoadSpec(max_requests=None, duration_s=5, max_concurrency=4).validate()
    for spec, msg in (
        (LoadSpec(max_requests=None, duration_s=None), "needs a bound"),
        (LoadSpec(max_requests=None, duration_s=5), "finite --request-rate"),
        (LoadSpec(max_concurrency=0), "concurrency"),
        (LoadSpec(max_requests=0), "number of prompts"),
        (LoadSpec(duration_s=0), "duration"),
        (LoadSpec(num_warmups=-1), "warm-ups"),
        (LoadSpec(request_rate=-1), "rate"),
        (LoadSpec(burstiness=0), "burstiness"),
    ):
        with pytest.raises(ValueError, match=msg):
            spec.validate()
