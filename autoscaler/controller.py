"""The control loop: scrape routers -> window signals -> decide per pool -> patch scale.

One ``step()`` is one window. The first step (and the first step after a router appears)
only records a baseline: a percentile needs two cumulative scrapes. A failed scrape of
one router drops that router from the window; a failed scale read/patch leaves the pool's
policy state untouched so the next window decides again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable

import httpx

from autoscaler.config import AutoscalerConfig
from autoscaler.kube import DeploymentScaler, ScaleError
from autoscaler.metrics import AutoscalerMetrics
from autoscaler.policy import Decision, PoolLimits, PoolState, decide
from autoscaler.signals import MetricsSnapshot, Signals, parse_metrics, window_signals

logger = logging.getLogger(__name__)


class Autoscaler:
    def __init__(
        self,
        config: AutoscalerConfig,
        scaler: DeploymentScaler,
        http: httpx.AsyncClient,
        metrics: AutoscalerMetrics | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.scaler = scaler
        self.http = http
        self.metrics = metrics or AutoscalerMetrics()
        self.clock = clock
        self.states: dict[str, PoolState] = {"prefill": PoolState(), "decode": PoolState()}
        self._previous: dict[str, MetricsSnapshot] = {}
        self.metrics.dry_run.set(1 if config.dry_run else 0)

    async def targets(self) -> list[str]:
        """The router /metrics URLs to scrape this round."""
        cfg = self.config
        if cfg.metrics_urls:
            return list(cfg.metrics_urls)
        loop = asyncio.get_running_loop()
        try:
            infos = await asyncio.wait_for(
                loop.getaddrinfo(cfg.metrics_dns, cfg.metrics_port, type=socket.SOCK_STREAM),
                cfg.scrape_timeout,
            )
        except (OSError, asyncio.TimeoutError) as exc:
            logger.warning("cannot resolve routers at %s: %r", cfg.metrics_dns, exc)
            return []
        hosts = sorted({str(info[4][0]) for info in infos})
        return [f"http://{f'[{h}]' if ':' in h else h}:{cfg.metrics_port}/metrics" for h in hosts]

    async def _scrape(self, url: str) -> MetricsSnapshot | None:
        try:
            resp = await self.http.get(url, timeout=self.config.scrape_timeout)
            resp.raise_for_status()
            return parse_metrics(resp.text)
        except (httpx.HTTPError, ValueError) as exc:
            self.metrics.scrape_errors.inc()
            logger.warning("scrape of %s failed: %r", url, exc)
            return None

    async def scrape(self) -> dict[str, MetricsSnapshot]:
        urls = await self.targets()
        pages = await asyncio.gather(*(self._scrape(u) for u in urls))
        self.metrics.targets.set(len(urls))
        return {u: p for u, p in zip(urls, pages, strict=True) if p is not None}

    async def step(self) -> list[Decision]:
        """Run one window; returns the decisions taken (empty on a baseline round)."""
        current = await self.scrape()
        previous, self._previous = self._previous, current
        if not current or not set(current) & set(previous):
            logger.info(
                "baseline scrape of %d router(s); deciding from the next window", len(current)
            )
            return []
        signals = window_signals(previous, current)
        self.metrics.observe_signals(signals)
        decisions = []
        for pool, name, limits in (
            ("prefill", self.config.prefill_deployment, self.config.prefill),
            ("decode", self.config.decode_deployment, self.config.decode),
        ):
            decision = await self._step_pool(pool, name, limits, signals)
            if decision is not None:
                decisions.append(decision)
        return decisions

    async def _step_pool(
        self, pool: str, deployment: str, limits: PoolLimits, signals: Signals
    ) -> Decision | None:
        try:
            replicas = await self.scaler.get_replicas(deployment)
        except ScaleError as exc:
            self.metrics.scale_errors.labels(pool).inc()
            logger.error("%s: %s", pool, exc)
            return None
        now = self.clock()
        decision, new_state = decide(
            pool, signals, replicas, self.states[pool], self.config.targets, limits, now
        )
        if decision.desired != decision.current and not self.config.dry_run:
            try:
                await self.scaler.set_replicas(deployment, decision.desired)
            except ScaleError as exc:
                self.metrics.scale_errors.labels(pool).inc()
                logger.error("%s: %s", pool, exc)
                return None
        self.states[pool] = new_state
        self.metrics.observe_decision(decision, time.time())
        log = logger.info if decision.action != "hold" else logger.debug
        prefix = "[dry-run] would scale" if self.config.dry_run else "scale"
        log(
            "%s %s deployment/%s %d -> %d (%s): %s",
            prefix if decision.action != "hold" else "hold",
            pool,
            deployment,
            decision.current,
            decision.desired,
            decision.action,
            decision.reason,
        )
        return decision

    async def run(self, stop: asyncio.Event) -> None:
        """Step every ``interval`` seconds until ``stop`` is set."""
        while not stop.is_set():
            started = self.clock()
            try:
                await asyncio.wait_for(self.step(), self.config.interval * 4)
            except asyncio.TimeoutError:
                logger.error("a decision round overran %.0fs; skipped", self.config.interval * 4)
            wait = max(0.0, self.config.interval - (self.clock() - started))
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stop.wait(), wait)
