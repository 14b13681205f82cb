"""The control-plane token (``--grpc-token`` / PDSERVE_GRPC_TOKEN) between real processes:
a decode service refuses calls without it (UNAUTHENTICATED) but keeps health checks open; a
router holding it serves through the service, one without it sees the instance refuse."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve.procs import free_ports
from pdserve_api.v1 import pdserve_pb2 as pb
from pdserve_api.v1 import pdserve_pb2_grpc as pb_grpc
from tests.e2e.router_support import metric
from tests.service_fixtures import ProcessStack, ServiceProcess, spawn

TOKEN = "s3cret-token"
TIMEOUT = 60.0


@pytest.fixture(scope="module")
def guarded(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[tuple[ProcessStack, ServiceProcess]]:
    procs = ProcessStack(tmp_path_factory.mktemp("auth") / "logs", tiny_model_dir)
    try:
        decode = procs.service("decode", env={"PDSERVE_GRPC_TOKEN": TOKEN})
        yield procs, decode
    finally:
        procs.close()


def _load(address: str, metadata: tuple[tuple[str, str], ...] = ()) -> Any:
    with grpc.insecure_channel(address) as channel:
        return pb_grpc.DecodeServiceStub(channel).GetLoad(
            pb.GetLoadRequest(), timeout=TIMEOUT, metadata=metadata
        )


@pytest.mark.parametrize(
    "metadata",
    [(), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)],
    ids=["none", "wrong", "no-scheme"],
)
def test_calls_without_the_token_are_unauthenticated(
    guarded: tuple[ProcessStack, ServiceProcess], metadata: tuple[tuple[str, str], ...]
) -> None:
    _, decode = guarded
    with pytest.raises(grpc.RpcError) as info:
        _load(decode.address, metadata)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value
    with grpc.insecure_channel(decode.address) as channel, pytest.raises(grpc.RpcError) as info:
        request = pb.DecodeRequest(prompt_token_ids=[5, 6], params=pb.SamplingParams(max_tokens=2))
        list(pb_grpc.DecodeServiceStub(channel).Decode(request, timeout=TIMEOUT, metadata=metadata))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value
    assert metric(decode.metrics_url, "pdserve_service_requests_total", outcome="unauthenticated")


def test_the_token_opens_the_service_and_health_needs_none(
    guarded: tuple[ProcessStack, ServiceProcess],
) -> None:
    _, decode = guarded
    assert _load(decode.address, (("authorization", f"Bearer {TOKEN}"),)).total_kv_blocks > 0
    with grpc.insecure_channel(decode.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT
        )
    assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_a_router_with_the_token_serves(
    guarded: tuple[ProcessStack, ServiceProcess], tiny_model_dir: Path
) -> None:
    procs, decode = guarded
    router = procs.router(
        decode=[decode],
        mode="colocated",
        extra_args=["--served-model-name", "tiny"],
        env={"PDSERVE_GRPC_TOKEN": TOKEN},
    )
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=60)
    reply = client.completions.create(model="tiny", prompt="Hello", max_tokens=3)
    assert reply.usage is not None and reply.usage.completion_tokens >= 1


def test_a_router_without_the_token_is_refused(
    guarded: tuple[ProcessStack, ServiceProcess], tiny_model_dir: Path, tmp_path: Path
) -> None:
    _, decode = guarded
    (port,) = free_ports(1)
    argv = [
        *(sys.executable, "-m", "pdserve", "router", "--host", "127.0.0.1", "--port", str(port)),
        *("--model", str(tiny_model_dir), "--mode", "colocated"),
        *("--decode-urls", decode.address, "--health-interval", "0.5"),
    ]
    name = "router-no-token"
    router = ServiceProcess(name, spawn(name, argv, tmp_path), tmp_path / f"{name}.log", port)
    try:
        deadline = time.monotonic() + TIMEOUT
        while True:
            assert router.proc.poll() is None, router.log_tail()
            try:
                body = httpx.get(f"{router.url}/health", timeout=5).json()
                error = body["decode"]["instances"][decode.address]["error"] or ""
            except (httpx.HTTPError, KeyError, ValueError):
                error = ""
            if "UNAUTHENTICATED" in error:
                break
            assert time.monotonic() < deadline, (
                f"no UNAUTHENTICATED in /health:\n{router.log_tail()}"
            )
            time.sleep(0.3)
        assert body["status"] == "unavailable" and body["decode"]["healthy"] == 0
    finally:
        router.stop()
