"""The instance pool follows its discovery source and only offers instances that pass the
health check. Instances here are closed loopback ports (real gRPC connection refusals);
live services are covered by tests/e2e/test_router_faults.py."""

from __future__ import annotations

import asyncio
import socket

import pytest

from router.discovery import DnsDiscovery
from router.metrics import RouterMetrics
from router.routing.policies import RouteContext
from router.routing.pool import InstancePool


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_pool_follows_discovery_and_keeps_dead_instances_out() -> None:
    current: set[str] = set()

    async def resolver(host: str, port: int) -> set[str]:
        return set(current)

    discovery = DnsDiscovery("decode.test", 50052, interval=0.05, resolver=resolver)
    metrics = RouterMetrics()
    pool = InstancePool(
        "decode", discovery, metrics=metrics, health_interval=0.05, check_timeout=0.5
    )
    await pool.start()
    try:
        assert pool.instances() == []
        assert pool.select(RouteContext()) is None
        dead = [f"127.0.0.1:{closed_port()}" for _ in range(2)]
        current.update(dead)

        async def until(predicate: object, what: str) -> None:
            deadline = asyncio.get_running_loop().time() + 10
            while not predicate():  # type: ignore[operator]
                assert asyncio.get_running_loop().time() < deadline, f"timed out waiting for {what}"
                await asyncio.sleep(0.05)

        await until(lambda: {i.url for i in pool.instances()} == set(dead), "instances to join")
        # Joined, but refused connections never pass the check.
        await asyncio.sleep(0.3)
        assert pool.healthy() == []
        assert pool.select(RouteContext()) is None
        status = pool.status()
        assert status["healthy"] == 0 and status["total"] == 2
        assert all(entry["error"] for entry in status["instances"].values())
        text = metrics.exposition()[0].decode()
        assert f'pdserve_instance_healthy{{instance="{dead[0]}",pool="decode"}} 0.0' in text
        current.discard(dead[0])
        await until(lambda: {i.url for i in pool.instances()} == {dead[1]}, "instance to leave")
        assert f'instance="{dead[0]}"' not in metrics.exposition()[0].decode()
    finally:
        await pool.stop()
    assert pool.instances() == []


def test_pool_rejects_bad_arguments() -> None:
    discovery = DnsDiscovery("x.test", 1, resolver=None)
    with pytest.raises(ValueError, match="pool name"):
        InstancePool("router", discovery)
    with pytest.raises(ValueError, match="health_interval"):
        InstancePool("decode", discovery, health_interval=0)
    with pytest.raises(ValueError, match="unknown routing policy"):
        InstancePool("decode", discovery, policy="fastest")


def test_one_late_check_is_forgiven_two_in_a_row_or_a_refusal_are_not() -> None:
    """The rule router/routing/pool.py's docstring states (an abort storm delayed one answer and
    the instance was taken out; tests/e2e/test_router_abort_storm.py is the live case)."""
    import grpc
    from grpc.aio import AioRpcError, Metadata

    from router.routing.pool import Instance, _forgiven

    def error(code: grpc.StatusCode) -> AioRpcError:
        return AioRpcError(code, Metadata(), Metadata(), code.name)

    late = error(grpc.StatusCode.DEADLINE_EXCEEDED)
    inst = Instance("127.0.0.1:1", "decode", None, None, None, healthy=True)  # type: ignore[arg-type]
    assert _forgiven(inst, late)
    assert not _forgiven(inst, late), "a second miss in a row must take it out"
    inst.missed = 0
    assert not _forgiven(inst, error(grpc.StatusCode.UNAVAILABLE)), "a refusal is not late"
    inst.healthy = False
    assert not _forgiven(inst, late), "an instance already out stays out"
