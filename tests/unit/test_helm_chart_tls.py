"""The chart's control-plane mTLS (``grpcTls``): the engines' and the router's certificates
come from Secrets (cert-manager's ``tls.crt``/``tls.key``/``ca.crt``), mounted read-only and
named by ``PDSERVE_GRPC_TLS_*``; the router checks one service name; the kubelet's gRPC
probes move to the plaintext health port; everything is off by default. Rendered by the
real ``helm`` binary and checked against the Kubernetes 1.35 schemas."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.unit.helm_support import (
    CHART,
    container,
    env_of,
    find,
    helm,
    kubernetes_validate,
    render,
    render_text,
)

P = "rel-pdserve"
MOUNT = "/etc/pdserve/grpc-tls"
ON = (
    "grpcTls.enabled=true",
    "grpcTls.engineSecret=engine-cert",
    "grpcTls.routerSecret=router-cert",
)


def _volume(workload: dict[str, Any]) -> dict[str, Any]:
    return next(
        v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == "grpc-tls"
    )


def _mount(c: dict[str, Any]) -> dict[str, Any]:
    return next(m for m in c["volumeMounts"] if m["name"] == "grpc-tls")


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_engines_mount_their_certificate_and_probe_the_health_port(role: str) -> None:
    objs = render(sets=(*ON, "grpcTls.allowedClients={router.example,10.1.2.3}"))
    engine = find(objs, "Deployment", f"{P}-{role}")
    c = container(engine)
    env = env_of(c)
    assert env["PDSERVE_GRPC_TLS_CERT"] == f"{MOUNT}/tls.crt"
    assert env["PDSERVE_GRPC_TLS_KEY"] == f"{MOUNT}/tls.key"
    assert env["PDSERVE_GRPC_TLS_CA"] == f"{MOUNT}/ca.crt"
    assert env["PDSERVE_GRPC_ALLOWED_CLIENTS"] == "router.example,10.1.2.3"
    assert env["PDSERVE_GRPC_HEALTH_PORT"] == "50053"
    assert "PDSERVE_GRPC_TLS_SERVER_NAME" not in env  # a router setting
    assert _mount(c) == {"name": "grpc-tls", "mountPath": MOUNT, "readOnly": True}
    secret = _volume(engine)["secret"]
    assert secret["secretName"] == "engine-cert"
    assert {i["key"] for i in secret["items"]} == {"tls.crt", "tls.key", "ca.crt"}
    assert secret["defaultMode"] == 0o440
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["grpc-health"] == 50053 and ports["grpc"] == 50051
    assert c["readinessProbe"]["grpc"]["port"] == 50053
    assert c["startupProbe"]["grpc"]["port"] == 50053
    assert c["livenessProbe"]["tcpSocket"]["port"] == "grpc"


def test_the_router_presents_its_certificate_and_checks_the_service_name() -> None:
    objs = render(sets=ON)
    router = find(objs, "Deployment", f"{P}-router")
    env = env_of(container(router))
    assert env["PDSERVE_GRPC_TLS_CERT"] == f"{MOUNT}/tls.crt"
    assert env["PDSERVE_GRPC_TLS_CA"] == f"{MOUNT}/ca.crt"
    assert env["PDSERVE_GRPC_TLS_SERVER_NAME"] == f"{P}-engine"
    assert "PDSERVE_GRPC_HEALTH_PORT" not in env and "PDSERVE_GRPC_ALLOWED_CLIENTS" not in env
    assert _volume(router)["secret"]["secretName"] == "router-cert"
    assert _mount(container(router))["readOnly"] is True
    named = render(sets=(*ON, "grpcTls.serverName=engines.internal"))
    env = env_of(container(find(named, "Deployment", f"{P}-router")))
    assert env["PDSERVE_GRPC_TLS_SERVER_NAME"] == "engines.internal"


def test_off_by_default() -> None:
    objs = render()
    for name in ("prefill", "decode", "router"):
        workload = find(objs, "Deployment", f"{P}-{name}")
        c = container(workload)
        assert not [k for k in env_of(c) if k.startswith("PDSERVE_GRPC_TLS")], name
        assert all(v["name"] != "grpc-tls" for v in workload["spec"]["template"]["spec"]["volumes"])
    decode = container(find(objs, "Deployment", f"{P}-decode"))
    assert decode["readinessProbe"]["grpc"]["port"] == 50051


def test_the_rendered_objects_pass_strict_schema_validation(tmp_path: Path) -> None:
    proc = kubernetes_validate(render_text(sets=ON), tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        (("grpcTls.enabled=true", "grpcTls.routerSecret=r"), "grpcTls.engineSecret"),
        (("grpcTls.enabled=true", "grpcTls.engineSecret=e"), "grpcTls.routerSecret"),
        ((*ON, "grpcTls.allowedClients={a,b c}"), "allowedClients"),
        ((*ON, "grpcTls.healthPort=0"), "healthPort"),
    ],
    ids=["no-engine-secret", "no-router-secret", "space-in-name", "port-0"],
)
def test_bad_tls_values_are_refused(sets: tuple[str, ...], message: str) -> None:
    args = ["template", "rel", str(CHART)]
    for s in sets:
        args += ["--set", s]
    proc = helm(*args, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr
