"""Every panel of the Grafana dashboard returns data from a real Prometheus
(helm/pdserve/dashboards/pdserve.json; docs/kubernetes.md "Dashboards").

`pdserve up` (disaggregated) and the real autoscaler (against kmock's Kubernetes API, in
dry-run) serve their /metrics; Prometheus 2.42 (the apt package) scrapes them every
second with the labels the chart's ServiceMonitors give (``namespace``, ``job`` per
component); traffic runs; then each panel expression, with the dashboard's variables
filled in, goes through Prometheus's HTTP query API and must return a series with a
finite value. The chart's alert rules are loaded too and must evaluate without error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from pdserve.procs import free_ports
from tests.integration.test_autoscaler import cluster
from tests.integration.up_support import (
    READY_TIMEOUT_S,
    SMALL,
    UpProcess,
    read_status,
    workdir_of,
)
from tests.service_fixtures import REPO, child_env
from tests.unit.helm_support import find, render

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

DASHBOARD = REPO / "helm" / "pdserve" / "dashboards" / "pdserve.json"
NS = "serving"  # the namespace tests/integration/test_autoscaler.cluster uses
RATE_WINDOW = "20s"  # $__rate_interval: several 1 s scrapes
DEADLINE_S = 90.0
PROMETHEUS_READY_S = 60.0


def panel_queries() -> list[tuple[str, str]]:
    board = json.loads(DASHBOARD.read_text())
    out = []
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$namespace", NS).replace("$__rate_interval", RATE_WINDOW)
            out.append((panel["title"], expr))
    return out


def metrics_port(pid: int) -> int:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return int(argv[argv.index("--metrics-port") + 1])


@contextlib.contextmanager
def kube_api() -> Iterator[str]:
    """kmock (with the two Deployments) on its own event loop thread; yields its URL."""
    loop = asyncio.new_event_loop()
    ready: asyncio.Future[str] = loop.create_future()
    stop = asyncio.Event()

    async def serve() -> None:
        async with cluster() as (url, _apps):
            ready.set_result(url)
            await stop.wait()

    thread = threading.Thread(target=lambda: loop.run_until_complete(serve()), daemon=True)
    thread.start()
    try:
        yield asyncio.run_coroutine_threadsafe(
            asyncio.wait_for(asyncio.shield(ready), 30), loop
        ).result(40)
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(10)


def prometheus_config(tmp_path: Path, jobs: dict[str, list[str]], rules: Path) -> Path:
    """Static targets as the ServiceMonitors discover them: one job per component, the
    release's namespace on every series."""
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules)],
        "scrape_configs": [
            {
                "job_name": job,
                "metrics_path": "/metrics",
                "static_configs": [{"targets": targets, "labels": {"namespace": NS}}],
            }
            for job, targets in jobs.items()
        ],
    }
    path = tmp_path / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


def chart_rules(tmp_path: Path) -> Path:
    objs = render(sets=("metrics.prometheusRule.enabled=true",))
    rule = find(objs, "PrometheusRule", "rel-pdserve-alerts")
    path = tmp_path / "rules.yaml"
    # The chart's rules filter on its release namespace ("serving" in helm_support too).
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
    return path


@contextlib.contextmanager
def prometheus(tmp_path: Path, config: Path) -> Iterator[str]:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.fail("prometheus is missing: run `make tools` (apt package prometheus)")
    (port,) = free_ports(1)
    log = open(tmp_path / "prometheus.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [
            binary,
            f"--config.file={config}",
            f"--storage.tsdb.path={tmp_path / 'tsdb'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(url, proc, tmp_path / "prometheus.log")
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        log.close()


def wait_ready(url: str, proc: subprocess.Popen[bytes], log: Path) -> None:
    """Until Prometheus answers /-/ready (its start takes seconds on a loaded machine);
    fails with its log if it exits or the deadline passes."""
    deadline = time.monotonic() + PROMETHEUS_READY_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"prometheus exited: {log.read_text()[-2000:]}"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/-/ready", timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    pytest.fail(f"prometheus not ready after {PROMETHEUS_READY_S} s: {log.read_text()[-2000:]}")


def query(url: str, expr: str) -> list[dict[str, Any]]:
    r = httpx.get(f"{url}/api/v1/query", params={"query": expr}, timeout=10)
    body = r.json()
    assert r.status_code == 200 and body["status"] == "success", (expr, body)
    return body["data"]["result"]


def finite(result: list[dict[str, Any]]) -> bool:
    return any(math.isfinite(float(s["value"][1])) for s in result)


def traffic(port: int, stop: threading.Event) -> None:
    """Streamed and whole completions until ``stop`` (ITL needs streams)."""
    import openai

    c = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x", max_retries=0)
    i = 0
    while not stop.is_set():
        i += 1
        args: dict[str, Any] = {"model": "smollm2", "max_tokens": 6, "temperature": 0}
        prompt = f"Request {i}: the quick brown fox"
        if i % 2:
            for _ in c.completions.create(prompt=prompt, stream=True, **args):
                pass
        else:
            c.completions.create(prompt=prompt, **args)


def start_autoscaler(
    tmp_path: Path, api_url: str, router_port: int
) -> tuple[subprocess.Popen[bytes], int]:
    (port,) = free_ports(1)
    argv = [
        sys.executable, "-m", "autoscaler",
        "--namespace", NS, "--prefill-deployment", "pd-prefill", "--decode-deployment", "pd-decode",
        "--metrics-urls", f"http://127.0.0.1:{router_port}/metrics",
        "--kube-api-url", api_url, "--interval", "1", "--dry-run", "true",
        "--listen-host", "127.0.0.1", "--listen-port", str(port), "--min-samples", "1",
    ]  # fmt: skip
    out = open(tmp_path / "autoscaler.log", "wb")  # noqa: SIM115 - the child holds it
    proc = subprocess.Popen(argv, cwd=REPO, env=child_env(), stdout=out, stderr=subprocess.STDOUT)
    return proc, port


def test_every_panel_returns_data_from_prometheus(tmp_path: Path, smollm2_dir: Path) -> None:
    (port,) = free_ports(1)
    up = UpProcess(tmp_path, "--model", "smollm2", "--port", str(port), *SMALL)
    scaler = None
    stop = threading.Event()
    try:
        up.wait_for("pdserve is ready", READY_TIMEOUT_S)
        status = read_status(workdir_of(up))
        with kube_api() as api_url:
            scaler, scaler_port = start_autoscaler(tmp_path, api_url, port)
            jobs = {
                "rel-pdserve-router": [f"127.0.0.1:{port}"],
                "rel-pdserve-prefill": [f"127.0.0.1:{metrics_port(status['prefill-0']['pid'])}"],
                "rel-pdserve-decode": [f"127.0.0.1:{metrics_port(status['decode-0']['pid'])}"],
                "rel-pdserve-autoscaler": [f"127.0.0.1:{scaler_port}"],
            }
            config = prometheus_config(tmp_path, jobs, chart_rules(tmp_path))
            with prometheus(tmp_path, config) as prom:
                load = threading.Thread(target=traffic, args=(port, stop), daemon=True)
                load.start()
                check_panels(prom, jobs)
                stop.set()
                load.join(60)
    finally:
        stop.set()
        if scaler is not None:
            scaler.terminate()
            scaler.wait(timeout=20)
        up.kill_tree()


def check_panels(prom: str, jobs: dict[str, list[str]]) -> None:
    """Every target up, then every panel expression with a finite value (retried while
    the traffic fills the windows), and every alert rule healthy."""
    deadline = time.monotonic() + DEADLINE_S
    pending = panel_queries()
    assert len(pending) >= 19
    while True:
        up = {s["metric"]["job"]: s["value"][1] for s in query(prom, "up")}
        pending = [(title, expr) for title, expr in pending if not finite(query(prom, expr))]
        if not pending and up == dict.fromkeys(jobs, "1"):
            break
        assert time.monotonic() < deadline, f"targets {up}; panels without data: {pending}"
        time.sleep(1.0)
    rules = httpx.get(f"{prom}/api/v1/rules", timeout=10).json()["data"]["groups"]
    health = {r["name"]: (r["health"], r.get("lastError", "")) for g in rules for r in g["rules"]}
    assert len(health) == 4 and all(h == "ok" for h, _ in health.values()), health
