"""One trace per request through `pdserve up`, collected by a real OTLP/gRPC receiver
(tests/otlp_receiver.py; docs/design.md §3 "Tracing").

Per mode (disaggregated, colocated, auto) one `pdserve up --otlp-traces-endpoint`, one
request with a client ``traceparent``: the router, prefill and decode processes export
spans of that one trace id, each span's parent is in the trace (the root's is the
client's span), the services' spans hang below the router's call spans, and the phases
come in order. The disaggregated run also loses its decode instance mid-stream: the
resumed stream is a second ``decode`` span of the same trace.
"""

from __future__ import annotations

import os
import secrets
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pdserve.procs import free_ports
from tests.integration.up_support import (
    READY_TIMEOUT_S,
    SMALL,
    UpProcess,
    read_status,
    workdir_of,
)
from tests.otlp_receiver import OtlpReceiver, SpanRow

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# Spans of different processes share this machine's clock; the services' phase spans are
# derived from durations the engine measures, so allow this much skew between processes.
SKEW_NS = 20_000_000
ROUTER = {"pdserve.request", "router.queue", "router.route"}
PREFILL = {"prefill", "prefill.request", "prefill.queue", "prefill.compute", "kv.save"}
DECODE = {"decode", "decode.request", "decode.queue", "decode.first_token", "decode.generate"}
PARENTS = {  # span -> its parent's name
    "router.queue": "pdserve.request",
    "router.route": "pdserve.request",
    "prefill": "pdserve.request",
    "kv.transfer": "pdserve.request",
    "decode": "pdserve.request",
    "prefill.request": "prefill",
    "prefill.queue": "prefill.request",
    "prefill.compute": "prefill.request",
    "kv.save": "prefill.request",
    "decode.request": "decode",
    "decode.queue": "decode.request",
    "kv.load": "decode.request",
    "decode.first_token": "decode.request",
    "decode.generate": "decode.request",
}


@pytest.fixture(scope="module")
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as r:
        yield r


def start_up(tmp_path: Path, receiver: OtlpReceiver, mode: str) -> tuple[UpProcess, int]:
    (port,) = free_ports(1)
    extra = ["--prefill", "0"] if mode == "colocated" else []
    up = UpProcess(
        tmp_path,
        *("--model", "smollm2", "--port", str(port), "--mode", mode, *extra, *SMALL),
        *("--otlp-traces-endpoint", receiver.endpoint),
        env={"OTEL_BSP_SCHEDULE_DELAY": "100"},  # export within 0.1 s, not 5 s
    )
    return up, port


def client(port: int) -> Any:
    import openai

    return openai.OpenAI(
        base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=120, max_retries=0
    )


def traceparent() -> tuple[str, str, str]:
    trace_id, parent = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{parent}-01", trace_id, parent


def by_name(spans: list[SpanRow]) -> dict[str, list[SpanRow]]:
    out: dict[str, list[SpanRow]] = {}
    for s in spans:
        out.setdefault(s.name, []).append(s)
    return out


def check_links(spans: list[SpanRow], client_parent: str) -> dict[str, list[SpanRow]]:
    """One root (the client's span its parent), every other parent in the trace and of
    the expected name; the spans by name."""
    names = by_name(spans)
    ids = {s.span_id: s for s in spans}
    assert len(names["pdserve.request"]) == 1, names["pdserve.request"]
    root = names["pdserve.request"][0]
    assert root.parent_id == client_parent and root.service == "pdserve-router"
    for s in spans:
        if s is root:
            continue
        assert s.parent_id in ids, f"{s.name}: parent {s.parent_id} is not in the trace"
        assert ids[s.parent_id].name == PARENTS[s.name], (s.name, ids[s.parent_id].name)
    return names


def first(names: dict[str, list[SpanRow]], name: str) -> SpanRow:
    return min(names[name], key=lambda s: s.start_ns)


def in_order(names: dict[str, list[SpanRow]], *order: str) -> None:
    """Each span of ``order`` starts no earlier than the one before it ends (or starts,
    for the router's call spans that enclose the services')."""
    for a, b in zip(order, order[1:]):
        sa, sb = first(names, a), first(names, b)
        assert sb.start_ns + SKEW_NS >= sa.start_ns, f"{b} starts before {a}"


def check_request(
    receiver: OtlpReceiver, trace_id: str, parent: str, usage: Any, remote: bool
) -> dict[str, list[SpanRow]]:
    expected = ROUTER | DECODE | (PREFILL | {"kv.transfer", "kv.load"} if remote else set())
    spans = receiver.wait_for(trace_id, expected, parent)
    names = check_links(spans, parent)
    root = names["pdserve.request"][0]
    assert root.attrs["gen_ai.request.model"] == "smollm2"
    assert root.attrs["gen_ai.usage.input_tokens"] == usage.prompt_tokens
    assert root.attrs["gen_ai.usage.output_tokens"] == usage.completion_tokens
    assert root.attrs["pdserve.decision"] == ("remote_prefill" if remote else "local_prefill")
    assert "first_token" in root.events and root.status != 2
    services = {s.service for s in spans}
    assert services == {"pdserve-router", "pdserve-decode"} | (
        {"pdserve-prefill"} if remote else set()
    )
    in_order(names, "router.queue", "router.route", *(["prefill"] if remote else []), "decode")
    in_order(names, "decode.queue", "decode.first_token", "decode.generate")
    if not remote:
        assert not PREFILL & set(names) and "kv.load" not in names
        return names
    in_order(names, "prefill.queue", "prefill.compute", "kv.save")
    in_order(names, "prefill.request", "kv.transfer", "decode.request")
    assert first(names, "kv.save").end_ns <= first(names, "decode.request").start_ns + SKEW_NS
    transfer = first(names, "kv.transfer").attrs
    timings = usage.pdserve_timings
    assert transfer["pdserve.kv.connector"] == "fs"
    assert transfer["pdserve.kv.blocks_loaded"] == timings["kv_blocks_loaded"] >= 1
    assert transfer["pdserve.kv.bytes_loaded"] == timings["kv_bytes_loaded"] > 0
    assert first(names, "kv.load").attrs["pdserve.kv.blocks_loaded"] >= 1
    return names


def one_request(port: int, receiver: OtlpReceiver, remote: bool | None) -> None:
    """A traced request; ``remote`` None (auto mode): whichever the router decided."""
    header, trace_id, parent = traceparent()
    out = client(port).completions.create(
        model="smollm2",
        prompt="The three primary colors are red, blue and",
        max_tokens=6,
        temperature=0,
        extra_headers={"traceparent": header},
        extra_body={"pdserve_timings": True},
    )
    if remote is None:
        spans = receiver.wait_for(trace_id, {"pdserve.request"}, parent)
        remote = by_name(spans)["pdserve.request"][0].attrs["pdserve.decision"] != "local_prefill"
    check_request(receiver, trace_id, parent, out.usage, remote)


def failover(up: UpProcess, port: int, receiver: OtlpReceiver) -> None:
    """Kill the decode instance mid-stream: the stream resumes elsewhere (the prefill
    instance serves it while decode restarts), both streams spans of one trace."""
    header, trace_id, parent = traceparent()
    stream = client(port).completions.create(
        model="smollm2",
        prompt="Once upon a time",
        max_tokens=40,
        temperature=0,
        stream=True,
        extra_headers={"traceparent": header},
        extra_body={"ignore_eos": True},
    )
    chunks = 0
    for _chunk in stream:
        chunks += 1
        if chunks == 4:
            os.kill(read_status(workdir_of(up))["decode-0"]["pid"], signal.SIGKILL)
    assert chunks >= 20  # the stream went on after the kill
    # The killed instance never ends its ``decode.request``: the spans it exported before
    # (at its first chunk) stay without their parent; every other link holds.
    spans = receiver.wait_for(
        trace_id,
        {"pdserve.request", "decode", "decode.request", "decode.generate"},
        parent,
        complete=False,
    )
    ids = {s.span_id for s in spans} | {parent}
    orphans = [s for s in spans if s.parent_id not in ids]
    assert all(s.service == "pdserve-decode" for s in orphans), orphans
    names = check_links([s for s in spans if s not in orphans], parent)
    calls = sorted(names["decode"], key=lambda s: s.start_ns)
    assert len(calls) == 2, [(s.attrs, s.status) for s in calls]
    lost, resumed = calls
    assert lost.status == 2 and lost.attrs["pdserve.failover"] == 0
    assert resumed.attrs["pdserve.failover"] == 1 and resumed.status != 2
    assert resumed.attrs["pdserve.resumed_tokens"] >= 4
    assert resumed.start_ns >= lost.start_ns
    # The killed instance never exported its span; the one that took over did.
    (served,) = names["decode.request"]
    assert served.parent_id == resumed.span_id
    assert served.attrs["pdserve.resumed_tokens"] == resumed.attrs["pdserve.resumed_tokens"]


@pytest.mark.parametrize("mode", ["disaggregated", "colocated", "auto"])
def test_one_trace_through_pdserve_up(
    mode: str, receiver: OtlpReceiver, tmp_path: Path, smollm2_dir: Path
) -> None:
    up, port = start_up(tmp_path, receiver, mode)
    try:
        up.wait_for("pdserve is ready", READY_TIMEOUT_S)
        one_request(port, receiver, {"disaggregated": True, "colocated": False}.get(mode))
        if mode == "disaggregated":
            failover(up, port, receiver)
    finally:
        up.kill_tree()
