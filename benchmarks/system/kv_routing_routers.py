"""The two-router run of ``benchmarks.system.kv_routing``: a second ``pdserve router`` over
the instances of a running ``pdserve up`` (its ``instances.json``), and a chat workload
whose turns alternate between the two routers (turn t of every conversation goes to router
t mod 2), as behind a load balancer without session affinity. A guessing router knows only
what it sent itself; with KV events both routers see every instance's cache."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import httpx

from pdserve.bench.metrics import RequestRecord
from pdserve.bench.serve_client import Target, send_request
from pdserve.bench.workloads import Prompt, TextCodec
from pdserve.procs import free_ports


def instances_file(up_lines: Sequence[str]) -> Path:
    """``instances.json`` of the run, from the ``logs in DIR`` line ``pdserve up`` prints."""
    for line in up_lines:
        if "logs in " in line:
            return Path(line.split("logs in ", 1)[1].strip()).parent / "instances.json"
    raise RuntimeError("pdserve up did not say where its logs are")


@contextmanager
def second_router(
    model: str, instances: Path, router_flags: Sequence[str], timeout_s: float
) -> Iterator[str]:
    """``pdserve router`` on a free port over ``instances``; yields its base URL."""
    (port,) = free_ports(1)
    argv = [
        *[sys.executable, "-m", "pdserve", "router", "--port", str(port), "--model", model],
        *["--served-model-name", model, "--discovery", "file"],
        *["--instances-file", str(instances), *router_flags],
    ]
    # The run's control-plane token: kv_routing starts `pdserve up` with it set.
    proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while not _healthy(url):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the second router did not become healthy")
            time.sleep(0.5)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as reply:  # noqa: S310 - loopback
            return bool(reply.status == 200)
    except OSError:
        return False


async def alternate(
    targets: Sequence[Target],
    prompts: Sequence[Prompt],
    conversations: int,
    max_concurrency: int,
    codec: TextCodec,
) -> tuple[list[RequestRecord], float]:
    """Send ``prompts`` in order, at most ``max_concurrency`` at once; prompt i (turn
    i // conversations) goes to ``targets[turn % len(targets)]``."""
    sem = asyncio.Semaphore(max_concurrency)
    limits = httpx.Limits(max_connections=max_concurrency)
    async with httpx.AsyncClient(
        timeout=targets[0].timeout_s, limits=limits, trust_env=False
    ) as client:

        async def one(i: int, prompt: Prompt) -> RequestRecord:
            try:
                target = targets[(i // conversations) % len(targets)]
                return await send_request(client, target, prompt, codec)
            finally:
                sem.release()

        start = time.perf_counter()
        tasks = []
        for i, prompt in enumerate(prompts):
            await sem.acquire()
            tasks.append(asyncio.create_task(one(i, prompt)))
        records = list(await asyncio.gather(*tasks))
    return records, time.perf_counter() - start


def with_base(target: Target, url: str) -> Target:
    return replace(target, base_url=url)
