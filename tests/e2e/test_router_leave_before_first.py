"""A streamed request whose client leaves before its first token has its prefill
cancelled at once (router/openai/client_gone.py; issue #36, the abort storm): nothing runs
on for a client that is gone, so a storm's prefills do not queue ahead of other users.

Real processes: prefill + decode (fs store) + router. The prefill is paused (SIGSTOP) so
the first token cannot come; the client sends a streamed request and hangs up. The router
must count the request cancelled and never fall back to prefilling it on the decode for
nobody; the prefill, once resumed, holds no request for it.
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.router_support import metric, running_requests, wait_for
from tests.service_fixtures import ProcessStack, ServiceProcess

BODY = {"model": "tiny", "prompt": "Hello there", "max_tokens": 8, "stream": True}


@pytest.fixture(scope="module")
def trio(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[tuple[ServiceProcess, ServiceProcess, ServiceProcess]]:
    root = tmp_path_factory.mktemp("leave")
    kv = root / "kv"
    kv.mkdir()
    procs = ProcessStack(root / "logs", tiny_model_dir)
    conn = ("--connector", "fs", "--kv-path", str(kv))
    try:
        prefill, decode = procs.together(
            lambda: procs.service("prefill", connector_args=conn),
            lambda: procs.service("decode", connector_args=conn),
        )
        router = procs.router(
            prefill=[prefill], decode=[decode], extra_args=["--served-model-name", "tiny"]
        )
        yield prefill, decode, router
    finally:
        procs.close()


def _calls(service: ServiceProcess, rpc: str) -> float:
    return metric(service.metrics_url, "pdserve_service_requests_total", rpc=rpc)


def test_leaving_before_the_first_token_cancels_the_prefill(
    trio: tuple[ServiceProcess, ServiceProcess, ServiceProcess],
) -> None:
    prefill, decode, router = trio
    with httpx.Client(timeout=60) as http:  # the stack serves
        assert http.post(f"{router.url}/v1/completions", json={**BODY, "stream": False}).status_code == 200  # fmt: skip
    cancelled = metric(f"{router.url}/metrics", "pdserve_requests_total", outcome="cancelled")
    decodes = _calls(decode, "Decode")
    prefill.signal(signal.SIGSTOP)
    try:
        with pytest.raises(httpx.ReadTimeout):  # no first token: the client gives up
            httpx.post(
                f"{router.url}/v1/completions", json=BODY, timeout=httpx.Timeout(10, read=1.0)
            )
        wait_for(
            lambda: (
                metric(f"{router.url}/metrics", "pdserve_requests_total", outcome="cancelled")
                > cancelled
            ),
            10,
            "the router to cancel the request of the client that left",
        )
        time.sleep(6)  # longer than the router takes to give up on a paused prefill
        assert _calls(decode, "Decode") == decodes, "the request ran on for a client that left"
    finally:
        prefill.signal(signal.SIGCONT)
    wait_for(
        lambda: running_requests(prefill.address, "prefill") == 0,
        30,
        "the resumed prefill to hold no request of the client that left",
    )
