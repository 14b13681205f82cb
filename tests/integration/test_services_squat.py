"""A process that takes a killed service's port learns nothing it can reuse
(docs/design.md §3, "Control-plane security"; issue #36): the router proves each
instance's identity with a challenge before it sends any credential, and a call
credential names one instance, one RPC, a short window and a single-use nonce.

Real processes and sockets: a decode service and a router holding the run's token; the
decode is SIGKILLed and a gRPC server in this test takes its port, serving health checks
and recording every call's metadata while requests keep coming to the router. Then a fresh
decode service of the same run (same token) gets every recorded credential replayed.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdserve_api.v1 import pdserve_pb2 as pb
from pdserve_api.v1 import pdserve_pb2_grpc as pb_grpc
from tests.service_fixtures import ProcessStack, ServiceProcess

TOKEN = "squat-test-token-0123456789"
TIMEOUT = 60.0


class _Recorder(grpc.GenericRpcHandler):
    """Answers every pdserve call UNAVAILABLE after writing down its metadata."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[tuple[str, Any], ...]]] = []
        self.lock = threading.Lock()

    def service(self, details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        if details.method.startswith("/grpc.health.v1."):
            return None
        with self.lock:
            self.calls.append((details.method, tuple(details.invocation_metadata)))

        def refuse(_request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAVAILABLE, "squatter")

        if details.method.endswith(("/Decode", "/SubscribeKvEvents")):
            return grpc.unary_stream_rpc_method_handler(refuse)
        return grpc.unary_unary_rpc_method_handler(refuse)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[ProcessStack]:
    procs = ProcessStack(tmp_path_factory.mktemp("squat") / "logs", tiny_model_dir)
    try:
        yield procs
    finally:
        procs.close()


def _take_port(port: int, recorder: _Recorder) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(4), handlers=[recorder])
    checker = health.HealthServicer()
    checker.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(checker, server)
    deadline = time.monotonic() + 10
    while True:  # the killed server's socket is gone once it exits
        try:
            if server.add_insecure_port(f"127.0.0.1:{port}") == port:
                break
        except RuntimeError:
            pass
        assert time.monotonic() < deadline, f"port {port} never came free"
        time.sleep(0.05)
    server.start()
    return server


def _drive(router: ServiceProcess, seconds: float) -> None:
    """Requests (they fail: the squatter serves nothing) while health rounds run."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        with contextlib.suppress(httpx.HTTPError):
            httpx.post(
                f"{router.url}/v1/completions",
                json={"model": "tiny", "prompt": "Hello", "max_tokens": 2},
                timeout=10,
            )
        time.sleep(0.2)


def test_a_squatter_gets_nothing_reusable(stack: ProcessStack) -> None:
    env = {"PDSERVE_GRPC_TOKEN": TOKEN}
    decode = stack.service("decode", env=env)
    router = stack.router(
        decode=[decode],
        mode="colocated",
        extra_args=["--served-model-name", "tiny", "--health-interval", "0.3"],
        env=env,
    )
    reply = httpx.post(
        f"{router.url}/v1/completions",
        json={"model": "tiny", "prompt": "Hello", "max_tokens": 2},
        timeout=TIMEOUT,
    )
    assert reply.status_code == 200, reply.text
    recorder = _Recorder()
    decode.signal(signal.SIGKILL)
    decode.proc.wait(timeout=10)
    squatter = _take_port(decode.port, recorder)
    try:
        _drive(router, 4.0)
    finally:
        squatter.stop(grace=None)
    assert recorder.calls, "the router never called the squatted port"
    creds = [v for _, meta in recorder.calls for k, v in meta if k == "authorization"]
    seen = " ".join(str(v) for _, meta in recorder.calls for _, v in meta)
    assert TOKEN not in seen, "the run's token reached the squatter"
    # Whatever credential arrived, no live service of the run accepts it.
    fresh = stack.service("decode", env=env)
    with grpc.insecure_channel(fresh.address) as channel:
        stub = pb_grpc.DecodeServiceStub(channel)
        for cred in creds:
            with pytest.raises(grpc.RpcError) as info:
                stub.GetLoad(
                    pb.GetLoadRequest(), timeout=TIMEOUT, metadata=(("authorization", cred),)
                )
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value
        # The service itself still opens for the token (the check is not vacuous).
        ok = stub.GetLoad(
            pb.GetLoadRequest(), timeout=TIMEOUT, metadata=(("authorization", f"Bearer {TOKEN}"),)
        )
        assert ok.total_kv_blocks > 0
