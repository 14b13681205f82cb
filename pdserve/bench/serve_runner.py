"""Drive a load against a target: warm-ups, arrivals, concurrency cap, count and time bounds.

A run dispatches requests at the arrival process's send times until it has sent
`max_requests` or `duration_s` has passed (whichever first), then waits for the requests
in flight (each bounded by the target's request timeout). Warm-up requests go first, one
batch under the same concurrency cap, and are not recorded.
"""

from __future__ import annotations

import asyncio
import logging
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from pdserve.bench.arrivals import iter_offsets, validate
from pdserve.bench.metrics import RequestRecord
from pdserve.bench.serve_client import Target, send_request
from pdserve.bench.workloads import Prompt, TextCodec

log = logging.getLogger(__name__)


@dataclass(slots=True)
class LoadSpec:
    """How requests arrive: rate (req/s, inf = all at once), burstiness, and bounds."""

    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: int | None = None
    max_requests: int | None = 100
    duration_s: float | None = None
    num_warmups: int = 0
    seed: int = 0

    def validate(self) -> None:
        """Raise ValueError on impossible settings (including an unbounded run)."""
        validate(self.request_rate, self.burstiness)
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max concurrency must be >= 1, got {self.max_concurrency}")
        if self.max_requests is not None and self.max_requests < 1:
            raise ValueError(f"number of prompts must be >= 1, got {self.max_requests}")
        if self.duration_s is not None and not self.duration_s > 0:
            raise ValueError(f"duration must be > 0 seconds, got {self.duration_s}")
        if self.max_requests is None and self.duration_s is None:
            raise ValueError("a run needs a bound: a number of prompts or a duration")
        if self.max_requests is None and math.isinf(self.request_rate) and not self.max_concurrency:
            # every send time would be 0: an endless burst within the duration
            raise ValueError(
                "a run bounded only by --duration needs a finite --request-rate "
                "or a --max-concurrency"
            )
        if self.num_warmups < 0:
            raise ValueError(f"number of warm-ups must be >= 0, got {self.num_warmups}")


@dataclass(slots=True)
class RunResult:
    """The recorded requests of one run and its wall time (first send to last finish)."""

    records: list[RequestRecord]
    duration_s: float
    request_rate: float


def _client(target: Target, max_concurrency: int | None) -> httpx.AsyncClient:
    # trust_env=False: a proxy from the environment must never sit between us and the server.
    limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=64)
    timeout = httpx.Timeout(target.timeout_s, connect=min(10.0, target.timeout_s))
    return httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False)


async def _warm_up(
    client: httpx.AsyncClient,
    target: Target,
    warm: Sequence[Prompt],
    load: LoadSpec,
    codec: TextCodec | None,
) -> None:
    sem = asyncio.Semaphore(load.max_concurrency or len(warm) or 1)

    async def one(prompt: Prompt) -> RequestRecord:
        async with sem:
            return await send_request(client, target, prompt, codec)

    results = await asyncio.gather(*(one(p) for p in warm))
    failed = [r.error for r in results if not r.ok]
    if failed:
        log.warning("%d of %d warm-up requests failed: %s", len(failed), len(warm), failed[:3])


async def run_load(
    target: Target,
    prompts: Sequence[Prompt],
    load: LoadSpec,
    codec: TextCodec | None = None,
    progress: bool = True,
    warmups: Sequence[Prompt] | None = None,
) -> RunResult:
    """Run one load and return its records (prompts are cycled when the bound allows more).

    `load.num_warmups` requests go first, taken from `warmups` when given (prompts of
    their own, so they do not warm the server's prefix cache for measured prompts), else
    from `prompts`."""
    target.validate()
    load.validate()
    if not prompts:
        raise ValueError("no prompts to send")
    async with _client(target, load.max_concurrency) as client:
        if load.num_warmups:
            pool = warmups or prompts
            warm = [pool[i % len(pool)] for i in range(load.num_warmups)]
            await _warm_up(client, target, warm, load, codec)
        bar = tqdm(
            total=load.max_requests,
            desc=f"rate={load.request_rate:g}",
            unit="req",
            file=sys.stderr,
            disable=not progress,
            leave=False,
        )
        try:
            records, duration = await _dispatch(client, target, prompts, load, codec, bar)
        finally:
            bar.close()
    return RunResult(records, duration, load.request_rate)


async def _dispatch(
    client: httpx.AsyncClient,
    target: Target,
    prompts: Sequence[Prompt],
    load: LoadSpec,
    codec: TextCodec | None,
    bar: tqdm,
) -> tuple[list[RequestRecord], float]:
    sem = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    start = time.perf_counter()
    deadline = math.inf if load.duration_s is None else start + load.duration_s
    tasks: list[asyncio.Task[RequestRecord]] = []

    async def one(prompt: Prompt) -> RequestRecord:
        try:
            return await send_request(client, target, prompt, codec)
        finally:
            if sem is not None:
                sem.release()
            bar.update(1)

    for i, offset in enumerate(iter_offsets(load.request_rate, load.burstiness, load.seed)):
        if load.max_requests is not None and i >= load.max_requests:
            break
        send_at = start + offset
        if send_at >= deadline:
            break
        delay = send_at - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        if sem is not None and not await _acquire_before(sem, deadline):
            break
        tasks.append(asyncio.create_task(one(prompts[i % len(prompts)])))
    records = list(await asyncio.gather(*tasks))
    return records, max(time.perf_counter() - start, 1e-9)


async def _acquire_before(sem: asyncio.Semaphore, deadline: float) -> bool:
    """Acquire `sem`, giving up (False) when the run's deadline passes first."""
    if math.isinf(deadline):
        await sem.acquire()
        return True
    remaining = deadline - time.perf_counter()
    if remaining <= 0:
        return False
    try:
        await asyncio.wait_for(sem.acquire(), remaining)
    except asyncio.TimeoutError:
        return False
    return True
