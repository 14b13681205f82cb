"""mTLS on the control plane (``--grpc-tls-cert/-key/-ca``, ``--grpc-allowed-clients``)
between real processes over real gRPC: a decode service takes only callers whose
certificate its CA signed (no certificate, plaintext or another CA's certificate fail the
handshake), refuses a CA-signed caller outside its allow-list with PERMISSION_DENIED, keeps
a plaintext health-only port for probes, and lets only the identity that started a request
abort it. The control-plane token is required on top (both modes combine). A router
holding the right certificate (and the token) serves through it to the ``openai`` client.
"""

from __future__ import annotations

import signal
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.grpc_token import call_metadata
from pdserve.procs import free_ports, grpc_probe
from pdserve_api.v1 import pdserve_pb2 as pb
from pdserve_api.v1 import pdserve_pb2_grpc as pb_grpc
from tests.e2e.router_support import metric
from tests.integration.up_support import READY_TIMEOUT_S, SMALL, UpProcess, descendants
from tests.service_fixtures import (
    SMALL_ENGINE_ARGS,
    ProcessStack,
    ServiceProcess,
    spawn,
    wait_healthy,
)
from tests.tls_certs import Pair, Pki, make_pki

TIMEOUT = 60.0
TOKEN = "tls-and-token"
AUTH = call_metadata(TOKEN)
LONG = pb.SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)


@dataclass(slots=True)
class Guarded:
    pki: Pki
    decode: ServiceProcess
    health_port: int
    stack: ProcessStack


@pytest.fixture(scope="module")
def guarded(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Guarded]:
    root = tmp_path_factory.mktemp("tls")
    pki = make_pki(root / "pki")
    stack = ProcessStack(root / "logs", tiny_model_dir)
    port, metrics_port, health_port = free_ports(3)
    argv = [
        *(sys.executable, "-m", "service", "decode", "--host", "127.0.0.1"),
        *("--port", str(port), "--metrics-port", str(metrics_port)),
        *("--model", str(tiny_model_dir), *SMALL_ENGINE_ARGS),
        *("--grpc-health-port", str(health_port)),
    ]
    env = {
        **pki.service.env(),
        "PDSERVE_GRPC_ALLOWED_CLIENTS": "router.pdserve.test,operator.pdserve.test",
        "PDSERVE_GRPC_TOKEN": TOKEN,  # both modes at once
    }
    name = "decode-tls"
    decode = ServiceProcess(
        name,
        spawn(name, argv, stack.log_dir, env),
        stack.log_dir / f"{name}.log",
        port,
        metrics_port,
    )
    stack.children.append(decode)
    try:
        wait_healthy(decode, grpc_probe(decode.address, pki.router.files()))
        yield Guarded(pki, decode, health_port, stack)
    finally:
        stack.close()


def _channel(address: str, pair: Pair | None, *, ca: Path | None = None) -> grpc.Channel:
    """A TLS channel presenting ``pair`` (None: no client certificate) that trusts ``ca``."""
    trust = (ca or pair.ca if pair else ca).read_bytes()  # type: ignore[union-attr]
    creds = grpc.ssl_channel_credentials(
        root_certificates=trust,
        private_key=pair.key.read_bytes() if pair else None,
        certificate_chain=pair.cert.read_bytes() if pair else None,
    )
    return grpc.secure_channel(address, creds)


def _load(channel: grpc.Channel, metadata: Any = AUTH) -> Any:
    return pb_grpc.DecodeServiceStub(channel).GetLoad(
        pb.GetLoadRequest(), timeout=TIMEOUT, metadata=metadata
    )


def _refused(channel: grpc.Channel) -> grpc.StatusCode:
    with channel, pytest.raises(grpc.RpcError) as info:
        _load(channel)
    return info.value.code()  # type: ignore[no-any-return]


def test_callers_without_a_certificate_from_the_ca_fail_the_handshake(guarded: Guarded) -> None:
    pki, address = guarded.pki, guarded.decode.address
    assert _refused(grpc.insecure_channel(address)) == grpc.StatusCode.UNAVAILABLE
    assert _refused(_channel(address, None, ca=pki.ca)) == grpc.StatusCode.UNAVAILABLE
    assert _refused(_channel(address, pki.rogue)) == grpc.StatusCode.UNAVAILABLE
    # The service still answers the right certificate afterwards, with the token too.
    with _channel(address, pki.router) as channel:
        assert _load(channel).total_kv_blocks > 0
        with pytest.raises(grpc.RpcError) as info:
            _load(channel, metadata=())
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_a_ca_signed_caller_outside_the_allow_list_is_denied(guarded: Guarded) -> None:
    pki, decode = guarded.pki, guarded.decode
    assert _refused(_channel(decode.address, pki.stranger)) == grpc.StatusCode.PERMISSION_DENIED
    with _channel(decode.address, pki.stranger) as channel, pytest.raises(grpc.RpcError) as info:
        request = pb.DecodeRequest(prompt_token_ids=[5, 6], params=pb.SamplingParams(max_tokens=2))
        list(pb_grpc.DecodeServiceStub(channel).Decode(request, timeout=TIMEOUT, metadata=AUTH))
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert metric(decode.metrics_url, "pdserve_service_requests_total", outcome="permission_denied")
    with _channel(decode.address, pki.operator) as channel:
        assert _load(channel).total_kv_blocks > 0


def test_the_health_port_answers_in_plaintext(guarded: Guarded) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{guarded.health_port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=TIMEOUT
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as info:  # the health service, nothing else
            _load(channel)
    assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def _start(
    channel: grpc.Channel, request_id: str, seed: int
) -> tuple[pb.DecodeChunk, Iterator[pb.DecodeChunk]]:
    """A long greedy stream, started: (its first chunk, the rest to come)."""
    prompt = [1000 + (seed * 97 + i * 13) % 30000 for i in range(40)]
    request = pb.DecodeRequest(request_id=request_id, prompt_token_ids=prompt, params=LONG)
    call = pb_grpc.DecodeServiceStub(channel).Decode(request, timeout=TIMEOUT * 4, metadata=AUTH)
    stream = iter(call)
    return next(stream), stream


def test_only_the_identity_that_started_a_request_can_abort_it(guarded: Guarded) -> None:
    pki, decode = guarded.pki, guarded.decode
    with (
        _channel(decode.address, pki.router) as owner,
        _channel(decode.address, pki.operator) as other,
    ):
        first, stream = _start(owner, "owned-1", seed=1)
        other_stub = pb_grpc.DecodeServiceStub(other)
        reply = other_stub.Abort(
            pb.AbortRequest(request_id="owned-1"), timeout=TIMEOUT, metadata=AUTH
        )
        assert not reply.found
        assert _load(owner).running >= 1  # the refused Abort changed nothing: still running
        rest = list(stream)
        assert rest[-1].finished and rest[-1].finish_reason == "length"
        assert len(first.token_ids) + sum(len(c.token_ids) for c in rest) == LONG.max_tokens
        refused = "pdserve_service_requests_total"
        assert metric(decode.metrics_url, refused, outcome="not_owner") == 1
        # Finished, its owner is still known (a p2p hold outlives the stream): refused again.
        reply = other_stub.Abort(
            pb.AbortRequest(request_id="owned-1"), timeout=TIMEOUT, metadata=AUTH
        )
        assert not reply.found
        assert metric(decode.metrics_url, refused, outcome="not_owner") == 2

        _, stream = _start(owner, "owned-2", seed=2)
        owner_stub = pb_grpc.DecodeServiceStub(owner)
        reply = owner_stub.Abort(
            pb.AbortRequest(request_id="owned-2"), timeout=TIMEOUT, metadata=AUTH
        )
        assert reply.found
        rest = list(stream)
        assert rest[-1].finished and rest[-1].finish_reason == "abort"


def test_a_router_with_its_certificate_serves_over_mtls(guarded: Guarded) -> None:
    router = guarded.stack.router(
        decode=[guarded.decode],
        mode="colocated",
        extra_args=["--served-model-name", "tiny"],
        env={**guarded.pki.router.env(), "PDSERVE_GRPC_TOKEN": TOKEN},
    )
    client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="x", max_retries=0, timeout=60)
    reply = client.completions.create(model="tiny", prompt="Hello", max_tokens=3)
    assert reply.usage is not None and reply.usage.completion_tokens >= 1
    chunks = list(client.completions.create(model="tiny", prompt="Hi", max_tokens=4, stream=True))
    assert chunks and chunks[-1].choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (("cert", "ca"), "--grpc-tls-key missing"),
        (("key",), "--grpc-tls-cert, --grpc-tls-ca missing"),
    ],
    ids=["no-key", "key-without-cert"],
)
def test_a_service_with_incomplete_tls_files_exits_with_a_clear_error(
    guarded: Guarded, tiny_model_dir: Path, tmp_path: Path, names: tuple[str, ...], message: str
) -> None:
    pair = guarded.pki.service
    paths = {"cert": pair.cert, "key": pair.key, "ca": pair.ca}
    env = {f"PDSERVE_GRPC_TLS_{n.upper()}": str(paths[n]) for n in names}
    (port,) = free_ports(1)
    argv = [
        *(sys.executable, "-m", "service", "decode", "--host", "127.0.0.1"),
        *("--port", str(port), "--metrics-port", "0", "--model", str(tiny_model_dir)),
    ]
    proc = spawn("bad-tls", argv, tmp_path, env)
    assert proc.wait(timeout=120) == 2
    log = (tmp_path / "bad-tls.log").read_text()
    assert message in log and "cannot start" in log, log


def test_up_runs_its_services_and_router_over_mtls(
    guarded: Guarded, tiny_model_dir: Path, tmp_path: Path
) -> None:
    pair = guarded.pki.service  # names 127.0.0.1, for TLS server and client use
    (port,) = free_ports(1)
    tls = ("--grpc-tls-cert", str(pair.cert), "--grpc-tls-key", str(pair.key))
    up = UpProcess(
        tmp_path,
        *("--model", str(tiny_model_dir), "--port", str(port), *SMALL),
        *(*tls, "--grpc-tls-ca", str(pair.ca)),
    )
    try:
        up.wait_for("pdserve is ready", READY_TIMEOUT_S)
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="x", timeout=60, max_retries=0
        )
        reply = client.completions.create(
            model=str(tiny_model_dir), prompt="Hello", max_tokens=4, extra_body={"ignore_eos": True}
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 4
        decode_port = next(
            argv[argv.index(b"--port") + 1].decode()
            for argv in (
                Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                for pid in descendants(up.proc.pid)
            )
            if b"decode" in argv
        )
        address = f"127.0.0.1:{decode_port}"
        assert _refused(grpc.insecure_channel(address)) == grpc.StatusCode.UNAVAILABLE
        assert _refused(_channel(address, guarded.pki.rogue)) == grpc.StatusCode.UNAVAILABLE
        up.proc.send_signal(signal.SIGTERM)  # a clean stop removes the run's directory
        assert up.proc.wait(timeout=90) == 0, up.output()
    finally:
        up.kill_tree()


def _router_argv(model_dir: Path, port: int, decode: ServiceProcess, name: str) -> list[str]:
    return [
        *(sys.executable, "-m", "pdserve", "router", "--host", "127.0.0.1", "--port", str(port)),
        *("--model", str(model_dir), "--mode", "colocated", "--served-model-name", "tiny"),
        *("--decode-urls", decode.address, "--health-interval", "0.5"),
        *("--grpc-tls-server-name", name),
    ]


def _instance_error(router: ServiceProcess, address: str) -> str:
    """The router's /health error for ``address`` once it has one (deadline: TIMEOUT)."""
    deadline = time.monotonic() + TIMEOUT
    while True:
        assert router.proc.poll() is None, router.log_tail()
        try:
            body = httpx.get(f"{router.url}/health", timeout=5).json()
            error = body["decode"]["instances"][address]["error"] or ""
        except (httpx.HTTPError, KeyError, ValueError):
            error = ""
        if error:
            return str(error)
        assert time.monotonic() < deadline, f"no instance error in /health:\n{router.log_tail()}"
        time.sleep(0.3)


def test_the_router_checks_the_server_name_it_is_given(
    guarded: Guarded, tiny_model_dir: Path, tmp_path: Path
) -> None:
    decode, env = guarded.decode, {**guarded.pki.router.env(), "PDSERVE_GRPC_TOKEN": TOKEN}
    (port,) = free_ports(1)
    argv = _router_argv(tiny_model_dir, port, decode, "elsewhere.pdserve.test")
    wrong = ServiceProcess(
        "router-wrong-name",
        spawn("router-wrong-name", argv, tmp_path, env),
        tmp_path / "router-wrong-name.log",
        port,
    )
    try:
        assert "UNAVAILABLE" in _instance_error(wrong, decode.address)
    finally:
        wrong.stop()
    right = guarded.stack.router(
        decode=[decode],
        mode="colocated",
        extra_args=["--served-model-name", "tiny", "--grpc-tls-server-name", "localhost"],
        env=env,
    )
    client = openai.OpenAI(base_url=f"{right.url}/v1", api_key="x", max_retries=0, timeout=60)
    reply = client.completions.create(model="tiny", prompt="Hello", max_tokens=2)
    assert reply.usage is not None and reply.usage.completion_tokens >= 1
