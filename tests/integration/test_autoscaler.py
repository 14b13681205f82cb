"""The autoscaler end to end: it scrapes a real Prometheus page served on loopback (made
by prometheus_client, as the router makes it), and scales Deployments in kmock's
Kubernetes API emulator through the real ``kubernetes`` client."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import kmock
import pytest
from kubernetes import client
from prometheus_client import CollectorRegistry, Gauge, Histogram, start_http_server

from autoscaler.config import AutoscalerConfig
from autoscaler.controller import Autoscaler
from autoscaler.kube import DeploymentScaler, make_api_client
from autoscaler.metrics import AutoscalerMetrics
from autoscaler.policy import PoolLimits, SloTargets

NS = "serving"
REPO = Path(__file__).resolve().parents[2]


class RouterPage:
    """The router's SLO metrics, exposed over HTTP on a free loopback port."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        buckets = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
        self.ttft = Histogram(
            "pdserve_ttft_seconds", "TTFT", ["model"], buckets=buckets, registry=self.registry
        )
        self.itl = Histogram(
            "pdserve_itl_seconds", "ITL", ["model"], buckets=buckets, registry=self.registry
        )
        self.waiting = Gauge(
            "pdserve_instance_waiting", "waiting", ["pool", "instance"], registry=self.registry
        )
        self.server, self.thread = start_http_server(0, "127.0.0.1", registry=self.registry)
        self.url = f"http://127.0.0.1:{self.server.server_port}/metrics"

    def traffic(self, n: int, ttft: float, itl: float) -> None:
        for _ in range(n):
            self.ttft.labels("m").observe(ttft)
            self.itl.labels("m").observe(itl)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def router_page() -> Iterator[RouterPage]:
    page = RouterPage()
    yield page
    page.close()


def deployment(name: str, replicas: int) -> dict[str, Any]:
    labels = {"app.kubernetes.io/name": "pdserve", "app.kubernetes.io/component": name}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {"containers": [{"name": "c", "image": "pdserve"}]},
            },
        },
    }


@contextlib.asynccontextmanager
async def cluster(prefill: int = 1, decode: int = 1) -> AsyncIterator[tuple[str, Any]]:
    """kmock on loopback holding the two Deployments; yields (api url, AppsV1Api)."""
    emu = kmock.KubernetesEmulator()
    emu.resources.load_bundled()
    async with emu, kmock.Server(emu) as server:
        url = str(server.url).rstrip("/")
        apps = client.AppsV1Api(make_api_client(url))
        await asyncio.to_thread(
            apps.create_namespaced_deployment, NS, deployment("pd-prefill", prefill)
        )
        await asyncio.to_thread(
            apps.create_namespaced_deployment, NS, deployment("pd-decode", decode)
        )
        yield url, apps


async def replicas(apps: Any, name: str) -> int:
    dep = await asyncio.to_thread(apps.read_namespaced_deployment, name, NS)
    return int(dep.spec.replicas)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def make_config(api_url: str, metrics_url: str, **kw: Any) -> AutoscalerConfig:
    limits = PoolLimits(
        min_replicas=1,
        max_replicas=4,
        max_step_up=2,
        scale_up_cooldown=60,
        scale_down_cooldown=120,
        down_stable_windows=2,
    )
    base = AutoscalerConfig(
        namespace=NS,
        prefill_deployment="pd-prefill",
        decode_deployment="pd-decode",
        metrics_urls=(metrics_url,),
        kube_api_url=api_url,
        scrape_timeout=3,
        api_timeout=5,
        targets=SloTargets(
            ttft_p90=0.5, itl_p90=0.05, prefill_queue=8, decode_queue=4, min_samples=10
        ),
        prefill=limits,
        decode=limits,
    )
    return replace(base, **kw)


@contextlib.asynccontextmanager
async def controller(cfg: AutoscalerConfig, clock: Clock) -> AsyncIterator[Autoscaler]:
    scaler = DeploymentScaler(make_api_client(cfg.kube_api_url), NS, cfg.api_timeout)
    async with httpx.AsyncClient() as http:
        yield Autoscaler(cfg, scaler, http, AutoscalerMetrics(), clock=clock)


async def test_ttft_breach_scales_prefill_then_cooldown_then_bound(router_page: RouterPage) -> None:
    async with cluster() as (api_url, apps):
        clock = Clock()
        async with controller(make_config(api_url, router_page.url), clock) as scaler:
            assert await scaler.step() == []  # baseline
            router_page.traffic(40, ttft=2.0, itl=0.02)  # TTFT p90 ~2.3 s vs 0.5 s target
            decisions = {d.pool: d for d in await scaler.step()}
            assert decisions["prefill"].action == "up" and decisions["prefill"].desired == 3
            assert decisions["decode"].action == "hold"
            assert await replicas(apps, "pd-prefill") == 3
            assert await replicas(apps, "pd-decode") == 1
            # Still breaching 30 s later: the 60 s up-cooldown holds.
            clock.now += 30
            router_page.traffic(40, ttft=2.0, itl=0.02)
            decisions = {d.pool: d for d in await scaler.step()}
            assert (
                decisions["prefill"].action == "hold" and "cooldown" in decisions["prefill"].reason
            )
            assert await replicas(apps, "pd-prefill") == 3
            # After the cooldown: up again, but never above max_replicas=4.
            clock.now += 60
            router_page.traffic(40, ttft=2.0, itl=0.02)
            await scaler.step()
            assert await replicas(apps, "pd-prefill") == 4
            clock.now += 120
            router_page.traffic(40, ttft=2.0, itl=0.02)
            decisions = {d.pool: d for d in await scaler.step()}
            assert "max_replicas=4" in decisions["prefill"].reason
            assert await replicas(apps, "pd-prefill") == 4
            page = scaler.metrics.registry.get_sample_value
            assert (
                page("pdserve_autoscaler_decisions_total", {"pool": "prefill", "action": "up"}) == 2
            )
            assert page("pdserve_autoscaler_desired_replicas", {"pool": "prefill"}) == 4


async def test_itl_breach_and_decode_queue_scale_decode(router_page: RouterPage) -> None:
    async with cluster() as (api_url, apps):
        clock = Clock()
        async with controller(make_config(api_url, router_page.url), clock) as scaler:
            await scaler.step()
            router_page.traffic(50, ttft=0.1, itl=0.2)  # ITL 4x over target
            await scaler.step()
            assert await replicas(apps, "pd-decode") == 3
            assert await replicas(apps, "pd-prefill") == 1
            # ITL fine now, but 24 requests queue at decode (8 per replica vs 4): +1.
            clock.now += 61
            router_page.traffic(50, ttft=0.1, itl=0.02)
            router_page.waiting.labels("decode", "10.0.0.1:50051").set(24)
            decisions = {d.pool: d for d in await scaler.step()}
            assert decisions["decode"].pressures["queue"] == pytest.approx(2.0)
            assert await replicas(apps, "pd-decode") == 4


async def test_idle_scales_down_to_min_one_step_at_a_time(router_page: RouterPage) -> None:
    async with cluster(prefill=3, decode=2) as (api_url, apps):
        clock = Clock()
        async with controller(make_config(api_url, router_page.url), clock) as scaler:
            await scaler.step()
            seen = []
            for _ in range(8):
                clock.now += 130
                await scaler.step()  # no traffic at all: idle windows
                seen.append((await replicas(apps, "pd-prefill"), await replicas(apps, "pd-decode")))
            # Two calm windows per step down, one replica at a time, never below min=1.
            assert seen == [(3, 2), (2, 1), (2, 1), (1, 1), (1, 1), (1, 1), (1, 1), (1, 1)]


async def test_dry_run_and_failures_change_nothing(router_page: RouterPage) -> None:
    async with cluster() as (api_url, apps):
        clock = Clock()
        async with controller(make_config(api_url, router_page.url, dry_run=True), clock) as scaler:
            await scaler.step()
            router_page.traffic(40, ttft=2.0, itl=0.2)
            decisions = {d.pool: d for d in await scaler.step()}
            assert decisions["prefill"].desired == 3 and decisions["decode"].desired == 3
            assert (
                await replicas(apps, "pd-prefill") == 1 and await replicas(apps, "pd-decode") == 1
            )
        # A Deployment that does not exist: a counted error, no decision, no crash.
        cfg = make_config(api_url, router_page.url, prefill_deployment="missing")
        async with controller(cfg, clock) as scaler:
            await scaler.step()
            router_page.traffic(40, ttft=2.0, itl=0.02)
            decisions = await scaler.step()
            assert [d.pool for d in decisions] == ["decode"]
            assert (
                scaler.metrics.registry.get_sample_value(
                    "pdserve_autoscaler_scale_errors_total", {"pool": "prefill"}
                )
                == 1
            )
        # A router that does not answer: counted, no window, no decision.
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            dead = f"http://127.0.0.1:{sock.getsockname()[1]}/metrics"
        async with controller(make_config(api_url, dead), clock) as scaler:
            assert await scaler.step() == [] and await scaler.step() == []
            assert (
                scaler.metrics.registry.get_sample_value("pdserve_autoscaler_scrape_errors_total")
                == 2
            )


async def test_routers_found_by_dns_are_all_scraped(router_page: RouterPage) -> None:
    # "localhost" stands in for the routers' headless Service: every address it resolves
    # to is scraped (an address nothing listens on is a counted scrape error, not a stop).
    port = int(router_page.url.split(":")[2].split("/")[0])
    async with cluster() as (api_url, apps):
        cfg = make_config(
            api_url, router_page.url, metrics_urls=(), metrics_dns="localhost", metrics_port=port
        )
        async with controller(cfg, Clock()) as scaler:
            assert f"http://127.0.0.1:{port}/metrics" in await scaler.targets()
            await scaler.step()
            router_page.traffic(40, ttft=0.1, itl=0.2)
            decisions = {d.pool: d for d in await scaler.step()}
            assert decisions["decode"].action == "up"
            assert await replicas(apps, "pd-decode") == 3


async def test_python_m_autoscaler_scales_from_env_settings(router_page: RouterPage) -> None:
    async with cluster() as (api_url, apps):
        router_page.traffic(40, ttft=2.0, itl=0.02)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            own_port = sock.getsockname()[1]
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "PDSERVE_AUTOSCALER_NAMESPACE": NS,
            "PDSERVE_AUTOSCALER_PREFILL_DEPLOYMENT": "pd-prefill",
            "PDSERVE_AUTOSCALER_DECODE_DEPLOYMENT": "pd-decode",
            "PDSERVE_AUTOSCALER_METRICS_URLS": router_page.url,
            "PDSERVE_AUTOSCALER_KUBE_API_URL": api_url,
            "PDSERVE_AUTOSCALER_INTERVAL": "0.3",
            "PDSERVE_AUTOSCALER_MIN_SAMPLES": "5",
            "PDSERVE_AUTOSCALER_TTFT_P90_TARGET": "0.5",
            "PDSERVE_AUTOSCALER_LISTEN_HOST": "127.0.0.1",
            "PDSERVE_AUTOSCALER_LISTEN_PORT": str(own_port),
        }
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "autoscaler", env=env, stderr=asyncio.subprocess.PIPE
        )
        try:
            deadline = asyncio.get_running_loop().time() + 30
            while await replicas(apps, "pd-prefill") == 1:
                assert asyncio.get_running_loop().time() < deadline, (
                    "autoscaler never scaled prefill"
                )
                assert proc.returncode is None, "autoscaler exited"
                router_page.traffic(10, ttft=2.0, itl=0.02)
                await asyncio.sleep(0.2)
            assert await replicas(apps, "pd-prefill") == 3
            async with httpx.AsyncClient() as http:
                own = (await http.get(f"http://127.0.0.1:{own_port}/metrics", timeout=5)).text
            assert 'pdserve_autoscaler_decisions_total{action="up",pool="prefill"} 1.0' in own
        finally:
            if proc.returncode is None:
                proc.send_signal(signal.SIGTERM)
            _, err = await asyncio.wait_for(proc.communicate(), 20)
        assert proc.returncode == 0
        assert b"scale prefill deployment/pd-prefill 1 -> 3 (up): over target" in err
