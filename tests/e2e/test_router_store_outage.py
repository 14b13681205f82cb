"""A KV store outage does not become 503s (issue 17, finding 5), with real processes.

Redis killed: the prefill's KV save fails after its first token (UNAVAILABLE with the
trailer ``pdserve-error: kv-save-failed``); the router keeps the prefill instance in and
lets decode compute the prompt itself, so every request succeeds with the greedy output
of the working store, counted in ``pdserve_kv_load_fallbacks_total{reason="save_failed"}``.
Redis paused (SIGSTOP: connections accepted, nothing answered): the same, and after a few
failed operations the store's circuit breaker refuses the rest at once
(``pdserve_kv_failures_total{reason="circuit_open"}``) instead of each waiting its socket
timeout. Counts and outcomes are asserted, never timings.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.e2e.router_support import complete, metric, openai_client, wait_for
from tests.servers import ManagedServer, start_redis
from tests.service_fixtures import ProcessStack, ServiceProcess

PROMPTS = [f"Request {i}: the lighthouse keeper walked down to the harbour" for i in range(4)]


@dataclass
class Outage:
    redis: ManagedServer
    prefill: ServiceProcess
    decode: ServiceProcess
    router: ServiceProcess
    expected: list[str]  # greedy outputs with the store up


def _run(router: ServiceProcess) -> list[str]:
    client = openai_client(router.url)
    outs = [
        complete(client, prompt=p, max_tokens=12, extra_body={"ignore_eos": True}) for p in PROMPTS
    ]
    return [o.choices[0].text for o in outs]


def _prefill_healthy(outage: Outage) -> bool:
    body = httpx.get(f"{outage.router.url}/health", timeout=10).json()
    return bool(body["prefill"]["instances"][outage.prefill.address]["healthy"])


@pytest.fixture(scope="module")
def outage(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Outage]:
    root = tmp_path_factory.mktemp("store_outage")
    redis, url = start_redis()
    procs = ProcessStack(root / "logs", tiny_model_dir)
    conn = ("--connector", "redis", "--redis-url", url)
    try:
        prefill, decode = procs.together(
            lambda: procs.service("prefill", connector_args=conn),
            lambda: procs.service("decode", connector_args=conn),
        )
        router = procs.router(
            prefill=[prefill],
            decode=[decode],
            extra_args=["--served-model-name", "tiny", "--health-interval", "0.5"],
        )
        base = Outage(redis, prefill, decode, router, [])
        base.expected = _run(router)
        assert metric(f"{router.url}/metrics", "pdserve_kv_load_fallbacks_total") == 0
        yield base
    finally:
        redis.stop()  # SIGCONT first: a paused server must be able to stop
        procs.close()


@pytest.mark.timeout(300)
def test_killed_store_falls_back_to_decode(outage: Outage) -> None:
    url = f"{outage.router.url}/metrics"
    assert outage.redis.proc is not None
    outage.redis.proc.kill()
    outage.redis.proc.wait(timeout=10)
    assert _run(outage.router) == outage.expected
    assert metric(url, "pdserve_kv_load_fallbacks_total", reason="save_failed") >= 1
    assert metric(url, "pdserve_requests_total", outcome="unavailable") == 0
    assert _prefill_healthy(outage), "a failed save must not take the prefill instance out"


@pytest.mark.timeout(300)
def test_paused_store_fails_fast_after_a_few_timeouts(outage: Outage) -> None:
    outage.redis.start()  # same port: the services reconnect
    client = openai_client(outage.router.url)
    wait_for(  # a save goes through again (the breaker's probe closed it)
        lambda: _fresh_save(outage, client),
        120,
        "a KV save to succeed after the store came back",
    )
    saved_before = metric(outage.prefill.metrics_url, "pdserve_kv_blocks_saved_total")
    assert saved_before > 0
    outage.redis.proc.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
    try:
        assert _run(outage.router) == outage.expected
        fast = metric(
            outage.prefill.metrics_url, "pdserve_kv_failures_total", reason="circuit_open"
        )
        assert fast >= 1, "later store operations should be refused by the open breaker"
        url = f"{outage.router.url}/metrics"
        assert metric(url, "pdserve_requests_total", outcome="unavailable") == 0
        assert _prefill_healthy(outage)
    finally:
        outage.redis.proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]


def _fresh_save(outage: Outage, client: object) -> bool:
    before = metric(outage.prefill.metrics_url, "pdserve_kv_blocks_saved_total")
    complete(client, prompt=f"probe {before}: a new prompt for the store", max_tokens=2)  # type: ignore[arg-type]
    return metric(outage.prefill.metrics_url, "pdserve_kv_blocks_saved_total") > before
