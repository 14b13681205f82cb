"""A hung decode instance is failed over (issue 17, finding 4), with real processes.

A decode instance paused with SIGSTOP mid-stream keeps its TCP connection open, so the
stream would stall until the gRPC keepalive or the request deadline. The router cancels
it and resumes the choice on the other decode instance — when its health checks get no
answer, or (health checks too rare to notice) when no chunk came for
``--stream-idle-timeout`` — and the client's stream is identical to an undisturbed greedy
run. The pytest timeouts are the guard against the old stall; no timing is asserted.
"""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest

from tests.e2e.router_support import (
    FAULT_ATTEMPTS,
    busy_decode,
    metric,
    running_requests,
    wait_for,
)
from tests.service_fixtures import ProcessStack, ServiceProcess

PROMPT = "In a quiet village by the sea, the old lighthouse keeper"
# Long enough that the decode is still generating when the pause lands at chunk 5, even on
# a loaded machine (tests/e2e/test_router_degrade.py lost that race with 60 tokens).
TOKENS = 240


@dataclass
class Hung:
    decode: list[ServiceProcess]
    health_router: ServiceProcess  # health checks every 0.5 s; idle timeout left at 30 s
    idle_router: ServiceProcess  # health checks every 600 s; 3 s idle timeout


@pytest.fixture(scope="module")
def hung(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Hung]:
    root = tmp_path_factory.mktemp("router_hung")
    kv = root / "kv"
    kv.mkdir()
    procs = ProcessStack(root / "logs", tiny_model_dir)
    conn = ("--connector", "fs", "--kv-path", str(kv))
    try:
        prefill, *decode = procs.together(
            lambda: procs.service("prefill", connector_args=conn),
            *[lambda: procs.service("decode", connector_args=conn)] * 2,
        )
        common = ["--served-model-name", "tiny", "--health-timeout", "0.5"]
        health, idle = procs.together(
            lambda: procs.router(
                prefill=[prefill], decode=decode, extra_args=[*common, "--health-interval", "0.5"]
            ),
            lambda: procs.router(
                prefill=[prefill],
                decode=decode,
                extra_args=[*common, "--health-interval", "600", "--stream-idle-timeout", "3"],
            ),
        )
        yield Hung(decode, health, idle)
    finally:
        for child in procs.children:
            child.signal(signal.SIGCONT)  # a paused child must be able to stop
        procs.close()


def _stream(router: ServiceProcess, after_chunk: Callable[[int], None] | None = None) -> str:
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=300)
    stream = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=TOKENS,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text = ""
    for n, chunk in enumerate(stream):
        if chunk.choices:
            text += chunk.choices[0].text
        if after_chunk is not None:
            after_chunk(n)
    return text


def _pause_busy_decode(hung: Hung, paused: list[ServiceProcess]) -> Callable[[int], None]:
    def after_chunk(n: int) -> None:
        if n != 5 or paused:
            return
        busy = busy_decode(hung.decode)
        if busy is not None:  # None: the stream already finished there; streamed again
            busy.signal(signal.SIGSTOP)
            paused.append(busy)

    return after_chunk


def _resume(hung: Hung, paused: list[ServiceProcess], router: ServiceProcess) -> None:
    for child in paused:
        child.signal(signal.SIGCONT)
    for child in paused:  # back in the pool before the next test needs both
        wait_for(
            lambda c=child: running_requests(c.address, "decode") == 0,  # type: ignore[misc]
            60,
            "the resumed instance to answer with nothing running (its stream was aborted)",
        )


def _stall_and_check(hung: Hung, router: ServiceProcess, reason: str) -> None:
    """Pause the busy decode mid-stream: the client's text must equal the undisturbed run,
    and the router must have failed over because of ``reason`` (health | idle)."""
    url = f"{router.url}/metrics"
    expected = _stream(router)
    failovers = metric(url, "pdserve_decode_failovers_total")
    paused: list[ServiceProcess] = []
    try:
        for _attempt in range(FAULT_ATTEMPTS):
            assert _stream(router, _pause_busy_decode(hung, paused)) == expected
            if paused:
                break
    finally:
        _resume(hung, paused, router)
    assert paused, f"the stream ended before the pause in {FAULT_ATTEMPTS} tries"
    assert metric(url, "pdserve_decode_failovers_total") >= failovers + 1
    assert metric(url, "pdserve_decode_stalls_total", reason=reason) >= 1


@pytest.mark.timeout(240)
def test_paused_decode_is_failed_over_by_health_checks(hung: Hung) -> None:
    # Failed over because the checks got no answer, not because the connection broke.
    _stall_and_check(hung, hung.health_router, "health")


@pytest.mark.timeout(240)
def test_stalled_stream_is_failed_over_by_idle_timeout(hung: Hung) -> None:
    # This router's health checks will not notice within the test: the idle deadline does.
    _stall_and_check(hung, hung.idle_router, "idle")
