"""Chaos benchmark: ``pdserve up`` (2 prefill + 2 decode, redis connector, CPU, tiny Llama)
under steady load from the official ``openai`` client while one fault at a time is injected.

Phases, in order, each ``--phase-seconds`` long with the fault at ``--fault-at`` seconds:
``none`` (undisturbed), ``kill -9 decode``, ``SIGSTOP decode`` for ``--pause-seconds``,
``kill -9 prefill``, ``kill -9 redis``, ``SIGSTOP redis`` for ``--pause-seconds``. Every
request is greedy with a known expected output (each prompt run once, undisturbed, before
the phases); per phase the report gives requests sent / succeeded / identical / wrong /
failed by error, p50/p99 latency of the successes, the seconds from the fault until every
instance is healthy again, and the router counters that moved (failovers, stalls, KV
fallbacks). ``pdserve up`` restarts what was killed; a paused process is always resumed.

    .venv/bin/python benchmarks/chaos.py --out benchmarks/chaos.json --md benchmarks/chaos.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import openai
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.chaos_report import Outcome, markdown_table, summarize  # noqa: E402
from benchmarks.system_overhead_paths import PdserveUp  # noqa: E402
from tests.servers import free_port  # noqa: E402

COUNTERS = (
    "pdserve_decode_failovers_total",
    "pdserve_decode_stalls_total",
    "pdserve_kv_load_fallbacks_total",
    "pdserve_prefill_retries_total",
    "pdserve_requests_total",
)
MODEL = ["tiny-llama"]  # what the router serves: pdserve up names the model by its path
FAULTS = ("none", "kill_decode", "stop_decode", "kill_prefill", "kill_redis", "stop_redis")
PROMPTS = [
    f"Story {i}: the keeper of the lighthouse looked out over the {w} sea and"
    for i, w in enumerate(["grey", "calm", "stormy", "silver", "dark", "quiet", "wide", "cold"] * 2)
]


def build_model(out_dir: Path) -> Path:
    """The tests' tiny random Llama, built in a child process."""
    code = (
        "import sys; from tests.model_fixtures import make_tiny_llama; make_tiny_llama(sys.argv[1])"
    )
    env = dict(os.environ, PYTHONPATH=str(REPO))
    subprocess.run([sys.executable, "-c", code, str(out_dir)], cwd=REPO, env=env, check=True,
                   capture_output=True, timeout=300)  # fmt: skip
    return out_dir


class Cluster:
    """The running ``pdserve up``: its children's pids (``status.json``) and health."""

    def __init__(self, up: PdserveUp) -> None:
        self.up = up
        self.base = f"http://127.0.0.1:{up.port}"
        line = next(s for s in up.lines if "status.json" in s)
        self.status_path = Path(line.split(" in ", 1)[1].strip())

    def children(self) -> dict[str, dict[str, Any]]:
        return {c["name"]: c for c in json.loads(self.status_path.read_text())["children"]}

    def signal(self, name: str, signum: int) -> None:
        os.kill(int(self.children()[name]["pid"]), signum)

    def healthy(self) -> bool:
        try:
            body = httpx.get(f"{self.base}/health", timeout=2).json()
        except (httpx.HTTPError, ValueError):
            return False
        pools = [body.get(p, {}) for p in ("prefill", "decode")]
        up = all(p.get("healthy") == p.get("total") == 2 for p in pools)
        return up and all(c["state"] == "running" for c in self.children().values())

    def counters(self) -> dict[str, float]:
        text = httpx.get(f"{self.base}/metrics", timeout=5).text
        out: dict[str, float] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name in COUNTERS:
                    labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                    out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
        return out


def fault_action(cluster: Cluster, fault: str, pause_s: float) -> Callable[[], Awaitable[None]]:
    """The injection of ``fault`` (a no-op for ``none``); a paused child is always resumed."""
    verb, _, target = fault.partition("_")
    name = {"decode": "decode-0", "prefill": "prefill-0", "redis": "redis"}.get(target, "")

    async def inject() -> None:
        if verb == "kill":
            cluster.signal(name, signal.SIGKILL)
        elif verb == "stop":
            cluster.signal(name, signal.SIGSTOP)
            try:
                await asyncio.sleep(pause_s)
            finally:
                cluster.signal(name, signal.SIGCONT)

    return inject


async def one(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> str:
    stream = await client.completions.create(
        model=MODEL[0], prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    return "".join([c.choices[0].text async for c in stream if c.choices])


async def run_phase(
    cluster: Cluster, fault: str, expected: list[str], args: argparse.Namespace
) -> dict[str, Any]:
    client = openai.AsyncOpenAI(
        base_url=f"{cluster.base}/v1", api_key="x", max_retries=0, timeout=args.request_timeout
    )
    outcomes: list[Outcome] = []
    before = cluster.counters()
    end = time.monotonic() + args.phase_seconds

    async def worker(w: int) -> None:
        i = w
        while time.monotonic() < end:
            p, i = i % len(PROMPTS), i + args.concurrency
            t0 = time.perf_counter()
            try:
                text = await one(client, PROMPTS[p], args.max_tokens)
                outcomes.append(Outcome(True, text == expected[p], time.perf_counter() - t0))
            except openai.APIStatusError as e:
                outcomes.append(
                    Outcome(False, False, time.perf_counter() - t0, f"HTTP {e.status_code}")
                )
            except (openai.APIError, httpx.HTTPError) as e:
                outcomes.append(Outcome(False, False, time.perf_counter() - t0, type(e).__name__))

    async def fault_then_recovery() -> float | None:
        await asyncio.sleep(args.fault_at)
        hit = time.monotonic()
        await fault_action(cluster, fault, args.pause_seconds)()
        deadline = time.monotonic() + args.recovery_timeout
        await asyncio.sleep(0.5)
        while not await asyncio.to_thread(cluster.healthy):
            if time.monotonic() > deadline:
                return None
            await asyncio.sleep(0.25)
        return round(time.monotonic() - hit, 2)

    recovery = asyncio.create_task(fault_then_recovery())
    await asyncio.gather(*(worker(w) for w in range(args.concurrency)))
    recovered = await recovery
    await client.close()
    after = cluster.counters()
    moved = {k: round(v - before.get(k, 0.0), 3) for k, v in after.items()}
    return {
        "fault": fault,
        "summary": summarize(outcomes),
        "recovered_s": recovered if fault != "none" else None,
        "router_counters": {k: v for k, v in moved.items() if v},
        "restarts": {n: c["restarts"] for n, c in cluster.children().items()},
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="chaos-") as tmp:
        model = build_model(Path(tmp) / "tiny-llama")
        MODEL[0] = str(model)
        argv = [
            sys.executable, "-m", "pdserve", "up", "--model", str(model), "--prefill", "2",
            "--decode", "2", "--connector", args.connector, "--port", str(free_port()),
            "--torch-threads", "1", "--kv-cache-memory", "64Mi", "--max-restarts", "10",
            "--shutdown-grace", "10",
        ]  # fmt: skip
        with PdserveUp(argv, args.startup_timeout) as up:
            cluster = Cluster(up)
            client = openai.AsyncOpenAI(base_url=f"{cluster.base}/v1", api_key="x", max_retries=0)
            expected = [await one(client, p, args.max_tokens) for p in PROMPTS]
            await client.close()
            phases = [await run_phase(cluster, f, expected, args) for f in args.faults]
    return {
        "benchmark": "chaos",
        "command": shlex.join([".venv/bin/python", "benchmarks/chaos.py", *sys.argv[1:]]),
        "system": f"pdserve up --prefill 2 --decode 2 --connector {args.connector}"
        + (" (private redis-server)" if args.connector == "redis" else "")
        + ", tiny random Llama, CPU, --torch-threads 1",
        "host": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "loadavg": os.getloadavg(),
        },
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "md")},
        "startup_s": round(up.startup_s, 1),
        "total_s": round(time.perf_counter() - started, 1),
        "phases": phases,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--faults", nargs="+", default=list(FAULTS), choices=FAULTS)
    ap.add_argument("--concurrency", type=int, default=8, help="concurrent streams")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--phase-seconds", type=float, default=25.0)
    ap.add_argument("--fault-at", type=float, default=5.0, help="seconds into a phase")
    ap.add_argument("--pause-seconds", type=float, default=8.0, help="SIGSTOP length")
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--recovery-timeout", type=float, default=90.0)
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--out", type=Path, help="write the JSON result here")
    ap.add_argument("--md", type=Path, help="write the markdown table here")
    ap.add_argument("--connector", default="redis", choices=["redis", "fs", "p2p"])
    args = ap.parse_args()
    if args.connector != "redis" and any(f.endswith("_redis") for f in args.faults):
        ap.error("the redis faults need --connector redis")
    result = asyncio.run(run(args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if args.md:
        args.md.write_text(markdown_table(result["phases"]))


if __name__ == "__main__":
    main()
