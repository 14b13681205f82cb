"""Router discovery against a Kubernetes API (kmock's in-memory emulator, spoken to by the
real ``kubernetes`` client over loopback HTTP) and against real name resolution."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import kmock
import pytest
from kubernetes import client

from pdserve.procs import free_ports
from router.discovery import (
    Backoff,
    DnsDiscovery,
    EndpointSliceDiscovery,
    StaticDiscovery,
    make_api_client,
    parse_hostport,
)

NS = "serving"


async def wait_until(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll ``predicate`` until true; fail the test after ``timeout`` seconds."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        if asyncio.get_running_loop().time() > deadline:
            raise AssertionError("condition not met within the deadline")
        await asyncio.sleep(0.05)


def endpoint_slice(
    name: str, service: str, endpoints: list[tuple[str, bool | None]]
) -> dict[str, Any]:
    eps = []
    for addr, ready in endpoints:
        cond = {} if ready is None else {"ready": ready}
        eps.append({"addresses": [addr], "conditions": cond})
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {"kubernetes.io/service-name": service},
        },
        "addressType": "IPv4",
        "endpoints": eps,
        "ports": [{"name": "grpc", "port": 50051, "protocol": "TCP"}],
    }


@contextlib.asynccontextmanager
async def emulator(port: int | None = None) -> AsyncIterator[tuple[Any, str]]:
    emu = kmock.KubernetesEmulator()
    emu.resources.load_bundled()
    async with emu, kmock.Server(emu, port=port) as server:
        yield emu, str(server.url).rstrip("/")


@contextlib.asynccontextmanager
async def running(discovery: Any) -> AsyncIterator[asyncio.Event]:
    stop = asyncio.Event()
    task = asyncio.create_task(discovery.run(stop))
    try:
        yield stop
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)


def free_port() -> int:
    """A loopback TCP port free right now (``pdserve.procs.free_ports``)."""
    return free_ports(1)[0]


async def test_endpointslices_join_and_leave() -> None:
    async with emulator() as (_, url):
        api = client.DiscoveryV1Api(make_api_client(url))
        call = asyncio.to_thread
        await call(
            api.create_namespaced_endpoint_slice,
            NS,
            endpoint_slice("prefill-a", "prefill", [("10.0.0.1", True), ("10.0.0.2", False)]),
        )
        # A slice of another Service must never leak into this pool.
        await call(
            api.create_namespaced_endpoint_slice,
            NS,
            endpoint_slice("decode-a", "decode", [("10.9.9.9", True)]),
        )
        changes: list[set[str]] = []
        disc = EndpointSliceDiscovery(
            NS, "prefill", 50051, api_url=url, watch_timeout=2, on_change=changes.append
        )
        async with running(disc):
            assert await disc.wait_ready(10)
            assert disc.snapshot() == {"10.0.0.1:50051"}
            # A new pod's slice appears (unset "ready" means ready, as Kubernetes says).
            await call(
                api.create_namespaced_endpoint_slice,
                NS,
                endpoint_slice("prefill-b", "prefill", [("10.0.0.3", None)]),
            )
            await wait_until(lambda: disc.snapshot() == {"10.0.0.1:50051", "10.0.0.3:50051"})
            # The not-ready pod becomes ready, the ready one starts terminating.
            body = {
                "endpoints": [
                    {
                        "addresses": ["10.0.0.1"],
                        "conditions": {"ready": False, "terminating": True},
                    },
                    {"addresses": ["10.0.0.2"], "conditions": {"ready": True}},
                ]
            }
            await call(api.patch_namespaced_endpoint_slice, "prefill-a", NS, body)
            await wait_until(lambda: disc.snapshot() == {"10.0.0.2:50051", "10.0.0.3:50051"})
            await call(api.delete_namespaced_endpoint_slice, "prefill-b", NS)
            await wait_until(lambda: disc.snapshot() == {"10.0.0.2:50051"})
        assert changes[-1] == {"10.0.0.2:50051"}
        assert {"10.0.0.1:50051"} in changes


async def test_endpointslice_port_follows_the_named_port() -> None:
    disc = EndpointSliceDiscovery(NS, "decode", 50051)
    item = endpoint_slice("d", "decode", [("10.1.0.1", True), ("fd00::1", True)])
    item["ports"] = [{"name": "metrics", "port": 9090}, {"name": "grpc", "port": 6000}]
    assert disc.instances_of(item) == {"10.1.0.1:6000", "[fd00::1]:6000"}


async def test_endpointslice_recovers_when_the_api_comes_back() -> None:
    port = free_port()
    disc = EndpointSliceDiscovery(
        NS,
        "decode",
        50051,
        api_url=f"http://127.0.0.1:{port}",
        watch_timeout=2,
        request_timeout=2,
        backoff=Backoff(initial=0.05, maximum=0.2),
    )
    async with running(disc):
        # Nothing listens yet: the first lists fail and back off; no instances, not ready.
        assert not await disc.wait_ready(0.5)
        assert disc.snapshot() == set()
        async with emulator(port) as (_, url):
            api = client.DiscoveryV1Api(make_api_client(url))
            await asyncio.to_thread(
                api.create_namespaced_endpoint_slice,
                NS,
                endpoint_slice("decode-x", "decode", [("10.2.0.7", True)]),
            )
            await wait_until(lambda: disc.snapshot() == {"10.2.0.7:50051"}, timeout=15)


async def test_dns_discovery_resolves_and_follows_changes() -> None:
    disc = DnsDiscovery("localhost", 50051, interval=0.05)
    await disc.refresh()
    assert "127.0.0.1:50051" in disc.snapshot()

    answers: list[set[str] | BaseException] = [{"10.3.0.1:50051", "10.3.0.2:50051"}]

    async def resolver(host: str, port: int) -> set[str]:
        answer = answers[-1]
        if isinstance(answer, BaseException):
            raise answer
        return set(answer)

    disc = DnsDiscovery("prefill.serving.svc", 50051, interval=0.05, resolver=resolver)
    async with running(disc):
        await wait_until(lambda: disc.snapshot() == {"10.3.0.1:50051", "10.3.0.2:50051"})
        answers.append(socket.gaierror(socket.EAI_AGAIN, "temporary failure"))
        await asyncio.sleep(0.3)  # a transient failure keeps the last good set
        assert disc.snapshot() == {"10.3.0.1:50051", "10.3.0.2:50051"}
        answers.append({"10.3.0.2:50051"})
        await wait_until(lambda: disc.snapshot() == {"10.3.0.2:50051"})
        answers.append(socket.gaierror(socket.EAI_NONAME, "no such name"))  # zero ready pods
        await wait_until(lambda: disc.snapshot() == set())


async def test_static_discovery_validates_and_serves() -> None:
    disc = StaticDiscovery("10.0.0.1:50051, [::1]:7000,")
    assert disc.snapshot() == {"10.0.0.1:50051", "[::1]:7000"}
    async with running(disc):
        assert await disc.wait_ready(1)
    for bad in ["10.0.0.1", "host:0", "host:99999", "host:abc", ":80"]:
        with pytest.raises(ValueError, match="host:port"):
            parse_hostport(bad)
    with pytest.raises(ValueError):
        EndpointSliceDiscovery("", "svc", 50051)
