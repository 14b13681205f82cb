"""Prometheus metrics of one engine service, on its own ``CollectorRegistry`` (no globals).

Engine gauges and connector counters are read at scrape time (a custom collector), so
they are never stale and cost nothing between scrapes; per-request figures (outcomes, phase
timings, KV load fallbacks) are recorded as requests finish.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.v1 import pdserve_pb2 as pb

logger = logging.getLogger(__name__)

_PHASE_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
)


class _EngineCollector(Collector):
    """Engine load gauges and connector transfer counters, read when Prometheus scrapes."""

    def __init__(self, role: str, get_load: Callable[[], Any], connector: Any | None) -> None:
        self._role = role
        self._get_load = get_load
        self._connector = connector

    def collect(self) -> Iterator[Metric]:
        try:
            load = self._get_load()
        except Exception:  # a scrape must not fail because the engine is shutting down
            logger.debug("get_load failed during scrape", exc_info=True)
            load = None
        if load is not None:
            for name, doc, value in (
                ("waiting", "requests waiting to be scheduled", load.waiting),
                ("running", "requests in the running batch", load.running),
                ("kv_usage", "fraction of KV blocks in use", load.kv_usage),
                (
                    "prefix_hit_rate",
                    "prompt tokens served by the prefix cache (fraction)",
                    load.prefix_hit_rate,
                ),
                (
                    "waiting_for_remote_kv",
                    "requests waiting for KV from the store",
                    load.waiting_for_remote_kv,
                ),
            ):
                gauge = GaugeMetricFamily(f"pdserve_engine_{name}", doc, labels=["role"])
                gauge.add_metric([self._role], float(value))
                yield gauge
        yield from self._connector_counters()

    def _connector_counters(self) -> Iterator[Metric]:
        """The connector's ``ConnectorStats`` as counters ``pdserve_kv_<field>_total{connector}``
        (blocks/bytes saved, skipped and loaded, transfer seconds, lookups) plus
        ``pdserve_kv_failures_total{connector,reason}``."""
        stats = getattr(self._connector, "stats", None)
        if stats is None or not dataclasses.is_dataclass(stats):
            return
        if hasattr(stats, "snapshot"):
            stats = stats.snapshot()
        name = getattr(self._connector, "name", type(self._connector).__name__)
        labels = ["connector", "role"]
        for field in dataclasses.fields(stats):
            value = getattr(stats, field.name)
            if field.name.startswith("_") or isinstance(value, bool):
                continue
            if isinstance(value, int | float):
                counter = CounterMetricFamily(
                    f"pdserve_kv_{field.name}", f"KV connector {field.name}", labels=labels
                )
                counter.add_metric([name, self._role], float(value))
                yield counter
            elif isinstance(value, dict):
                counter = CounterMetricFamily(
                    f"pdserve_kv_{field.name}",
                    f"KV connector {field.name} by reason",
                    labels=[*labels, "reason"],
                )
                for reason, count in sorted(value.items()):
                    counter.add_metric([name, self._role, str(reason)], float(count))
                yield counter


@dataclasses.dataclass(slots=True)
class ServiceMetrics:
    """The metric objects of one service; ``registry`` is what ``/metrics`` serves."""

    role: str
    registry: CollectorRegistry
    requests: Counter
    phase_seconds: Histogram
    kv_load_fallbacks: Counter
    kv_blocks_recomputed: Counter

    @classmethod
    def create(cls, role: str) -> ServiceMetrics:
        registry = CollectorRegistry(auto_describe=True)
        return cls(
            role=role,
            registry=registry,
            requests=Counter(
                "pdserve_service_requests",
                "RPCs by method and outcome",
                ["role", "rpc", "outcome"],
                registry=registry,
            ),
            phase_seconds=Histogram(
                "pdserve_phase_seconds",
                "per-request phase durations (queue, compute, kv_save, kv_load)",
                ["role", "phase"],
                buckets=_PHASE_BUCKETS,
                registry=registry,
            ),
            kv_load_fallbacks=Counter(
                "pdserve_kv_load_fallbacks",
                "requests whose remote KV could not be (fully) loaded",
                ["role", "reason"],
                registry=registry,
            ),
            kv_blocks_recomputed=Counter(
                "pdserve_kv_blocks_recomputed",
                "KV blocks recomputed locally instead of loaded",
                ["role"],
                registry=registry,
            ),
        )

    def watch_engine(self, get_load: Callable[[], Any], connector: Any | None) -> None:
        """Export the engine's load and the connector's stats at scrape time."""
        self.registry.register(_EngineCollector(self.role, get_load, connector))

    def record_outcome(self, rpc: str, outcome: str) -> None:
        self.requests.labels(self.role, rpc, outcome).inc()

    def observe_timings(self, timings: pb.PhaseTimings) -> None:
        """Record one request's final phase timings (zero phases are not observed)."""
        for phase in ("queue_s", "compute_s", "kv_save_s", "kv_load_s"):
            value = getattr(timings, phase)
            if value > 0:
                self.phase_seconds.labels(self.role, phase.removesuffix("_s")).observe(value)
        if timings.kv_blocks_recomputed:
            self.kv_blocks_recomputed.labels(self.role).inc(timings.kv_blocks_recomputed)

    def record_fallback(self, reason: str) -> None:
        self.kv_load_fallbacks.labels(self.role, reason).inc()

    def serve(self, host: str, port: int) -> Any:
        """Start the ``/metrics`` HTTP server on a daemon thread; returns it (``shutdown()``)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server
