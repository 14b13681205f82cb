"""The running ``pdserve up`` as ``benchmarks.system.chaos`` sees it: its children (from
``status.json``), their flags (from ``/proc/<pid>/cmdline``), health, metrics, and the soak
reading (RSS, open fds, KV gauges, temp files) taken before and after a run."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROUTER_COUNTERS = (
    "pdserve_decode_failovers_total",
    "pdserve_decode_stalls_total",
    "pdserve_kv_load_fallbacks_total",
    "pdserve_prefill_retries_total",
    "pdserve_requests_total",
)
SERVICE_COUNTERS = (
    "pdserve_kv_failures_total",
    "pdserve_kv_load_fallbacks_total",
    "pdserve_kv_blocks_recomputed_total",
)
GAUGES = (
    "pdserve_engine_kv_usage",
    "pdserve_engine_running",
    "pdserve_engine_waiting",
    "pdserve_engine_waiting_for_remote_kv",
)


def _samples(text: str, names: tuple[str, ...]) -> dict[str, float]:
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in names:
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "role")
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def _flag(pid: int, flag: str) -> str:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    return argv[argv.index(flag.encode()) + 1].decode()


class Cluster:
    """``pdserve up``'s children, found through the ``status.json`` it names on startup."""

    def __init__(self, base: str, lines: list[str], up_pid: int) -> None:
        self.base, self.up_pid = base, up_pid
        line = next(s for s in lines if "status.json" in s)
        self.status_path = Path(line.split(" in ", 1)[1].strip())
        self.workdir = self.status_path.parent

    def children(self) -> dict[str, dict[str, Any]]:
        return {c["name"]: c for c in json.loads(self.status_path.read_text())["children"]}

    def services(self) -> list[str]:
        return [n for n in self.children() if n.startswith(("prefill-", "decode-"))]

    def pid(self, name: str) -> int:
        return int(self.children()[name]["pid"])

    def signal(self, name: str, signum: int) -> None:
        os.kill(self.pid(name), signum)

    def redis_url(self) -> str:
        """The private redis-server's URL, as the services got it (redis-server rewrites
        its own command line, so it is read from a service's)."""
        return _flag(self.pid(self.services()[0]), "--redis-url")

    def healthy(self) -> bool:
        try:
            body = httpx.get(f"{self.base}/health", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return False
        pools = [body.get(p, {}) for p in ("prefill", "decode")]
        up = all(p.get("healthy") == p.get("total") == 2 for p in pools)
        return up and all(c["state"] == "running" for c in self.children().values())

    def router_counters(self) -> dict[str, float]:
        return _samples(httpx.get(f"{self.base}/metrics", timeout=5).text, ROUTER_COUNTERS)

    def service_metrics(self, name: str, names: tuple[str, ...]) -> dict[str, float]:
        """``names`` from the service's own metrics endpoint ({} if it does not answer)."""
        try:
            port = _flag(self.pid(name), "--metrics-port")
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
        except (httpx.HTTPError, OSError, ValueError, TypeError):
            return {}
        return _samples(text, names)

    def service_counters(self) -> dict[str, dict[str, float]]:
        return {n: self.service_metrics(n, SERVICE_COUNTERS) for n in self.services()}

    def gauges(self) -> dict[str, dict[str, float]]:
        return {n: self.service_metrics(n, GAUGES) for n in self.services()}

    def idle(self) -> bool:
        """Every service reports nothing running, waiting or in use in its KV cache."""
        gauges = self.gauges()
        return all(g and not any(g.values()) for g in gauges.values())

    def soak(self, store_dir: Path | None = None) -> dict[str, Any]:
        """RSS and open fds of ``pdserve up`` and every child, each service's KV gauges,
        and the files in the run directory and the fs store's (temp files apart)."""
        procs: dict[str, dict[str, Any]] = {}
        pids = {"pdserve-up": self.up_pid} | {n: int(c["pid"]) for n, c in self.children().items()}
        for name, pid in pids.items():
            try:
                status = Path(f"/proc/{pid}/status").read_text()
                rss_kb = next(
                    int(s.split()[1]) for s in status.splitlines() if s.startswith("VmRSS")
                )
                procs[name] = {"pid": pid, "rss_mib": round(rss_kb / 1024, 1),
                               "open_fds": len(os.listdir(f"/proc/{pid}/fd"))}  # fmt: skip
            except (OSError, StopIteration):
                procs[name] = {"pid": pid, "rss_mib": None, "open_fds": None}
        files = [p for d in (self.workdir, store_dir) if d for p in d.rglob("*") if not p.is_dir()]
        temp = [p.name for p in files if ".tmp" in p.name]
        return {
            "processes": procs,
            "kv_gauges": self.gauges(),
            "run_dir_files": len(files),
            "run_dir_bytes": sum(p.lstat().st_size for p in files),
            "temp_files": temp,
            "special_files": [p.name for p in files if not p.is_file() or p.is_symlink()],
        }


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What moved; a counter below its start belongs to a restarted process (counts from 0)."""
    out = {}
    for k, v in after.items():
        start = before.get(k, 0.0)
        moved = v - start if v >= start else v
        if moved:
            out[k] = round(moved, 3)
    return out


async def wait_until(check: Any, timeout: float, poll: float = 0.25) -> float | None:
    """Seconds until ``check()`` (run in a thread) is true, None past ``timeout``."""
    start = time.monotonic()
    while not await asyncio.to_thread(check):
        if time.monotonic() - start > timeout:
            return None
        await asyncio.sleep(poll)
    return round(time.monotonic() - start, 2)


async def inject_signal(cluster: Cluster, fault: str, pause_s: float) -> None:
    verb, _, target = fault.partition("_")
    name = {"decode": "decode-0", "prefill": "prefill-0", "redis": "redis"}[target]
    if verb == "kill":
        cluster.signal(name, signal.SIGKILL)
        return
    cluster.signal(name, signal.SIGSTOP)
    try:
        await asyncio.sleep(pause_s)
    finally:
        cluster.signal(name, signal.SIGCONT)


async def restart_decodes(cluster: Cluster, timeout: float) -> None:
    """SIGKILL both decode instances and wait until ``pdserve up`` has them back: their
    prefix caches start empty, so the next requests load from the store."""
    names = [n for n in cluster.services() if n.startswith("decode-")]
    before = {n: cluster.children()[n]["restarts"] for n in names}
    for n in names:
        cluster.signal(n, signal.SIGKILL)

    def back() -> bool:
        now = cluster.children()
        return all(now[n]["restarts"] > before[n] for n in names) and cluster.healthy()

    if await wait_until(back, timeout) is None:
        raise RuntimeError(f"decode instances not back within {timeout} s")
