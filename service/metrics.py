"""Prometheus metrics of one engine service, on its own ``CollectorRegistry`` (no globals).

Engine gauges, connector counters and KV-load fallbacks are read at scrape time (a custom
collector), so they are never stale and cost nothing between scrapes; per-request figures
(outcomes, phase timings) are recorded as requests finish.

| metric | type | labels |
|---|---|---|
| pdserve_engine_{waiting,running,kv_usage,prefix_hit_rate,waiting_for_remote_kv} | gauge | role |
| pdserve_service_requests_total | counter | role, rpc, outcome |
| pdserve_phase_seconds | histogram | role, phase (queue, compute, kv_save, kv_load) |
| pdserve_kv_{blocks,bytes}_{saved,loaded}_total, _blocks_skipped, _lookups, ... | counter | connector, role |
| pdserve_kv_failures_total | counter | connector, role, reason |
| pdserve_kv_load_fallbacks_total | counter | role, reason |
| pdserve_kv_blocks_recomputed_total | counter | role |
| pdserve_kv_blocks_local_total | counter | role |
| pdserve_kv_p2p_* (leases, blocks held, lease ends, bytes, transfer seconds) | see p2p_metrics |
| pdserve_lora_{loads,evictions,slot_timeouts}_total | counter | role |
| pdserve_lora_{resident_adapters,registered_adapters,waiting_for_slot} | gauge | role |
| pdserve_kv_events_*, pdserve_kv_host_* (KV events, host KV tier) | see kv_tier_metrics |
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve_api.v1 import pdserve_pb2 as pb
from service.kv_tier_metrics import kv_tier_families
from service.p2p_metrics import transport_families

if TYPE_CHECKING:
    from engine.spec_decode.decoder import SpecDecodeStats
    from engine.stats import EngineStats
    from kv_store.stats import ConnectorStats

logger = logging.getLogger(__name__)

_PHASE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
_GAUGES = (
    ("waiting", "requests waiting to be scheduled (including those waiting for remote KV)"),
    ("running", "requests in the running batch"),
    ("kv_usage", "fraction of KV blocks in use"),
    ("prefix_hit_rate", "fraction of prompt tokens served by the local prefix cache"),
    ("waiting_for_remote_kv", "requests waiting for their KV from the store"),
)


_LORA_COUNTERS = ("loads", "evictions", "slot_timeouts")
_LORA_DOCS = {
    "loads": "LoRA adapters copied into a device slot",
    "evictions": "LoRA adapters evicted from a slot for another (LRU)",
    "slot_timeouts": "requests refused after waiting past their deadline for a LoRA slot",
    "resident_adapters": "LoRA adapters in a device slot now",
    "registered_adapters": "LoRA adapters this instance serves",
    "waiting_for_slot": "requests waiting for a LoRA slot",
}


class _EngineCollector(Collector):
    """Reads the engine (an ``EngineClient``: its ``stats()``) when Prometheus scrapes.
    A scrape never fails because of them: whatever cannot be read is left out."""

    def __init__(self, role: str, engine: Any) -> None:
        self._role = role
        self._engine = engine

    def collect(self) -> Iterator[Metric]:
        try:
            stats: EngineStats = self._engine.stats()
        except Exception:
            logger.debug("engine stats failed during scrape", exc_info=True)
            return
        for name, doc in _GAUGES:
            gauge = GaugeMetricFamily(f"pdserve_engine_{name}", doc, labels=["role"])
            gauge.add_metric([self._role], float(getattr(stats.load, name)))
            yield gauge
        if stats.connector is not None:
            yield from self._connector_counters(stats.connector_name or "?", stats.connector)
            yield from self._fallbacks(stats)
        if stats.spec is not None:
            yield from self._spec_counters(stats.spec)
        if stats.transport is not None:
            yield from transport_families(stats.connector_name or "?", self._role, stats.transport)
        yield from self._lora(stats)
        yield from self._guided(stats)
        yield from kv_tier_families(self._role, stats)

    def _guided(self, stats: EngineStats) -> Iterator[Metric]:
        """Grammar compiles by source: ``compiled`` here, or ``shared`` (loaded from
        ``--guided-cache-dir``, another instance's compile)."""
        if not stats.guided_compiles:
            return
        counter = CounterMetricFamily(
            "pdserve_guided_compiles",
            "guided-decoding grammars compiled here, or loaded from another instance's compile",
            labels=["role", "source"],
        )
        for source, value in stats.guided_compiles.items():
            counter.add_metric([self._role, source], float(value))
        yield counter

    def _lora(self, stats: EngineStats) -> Iterator[Metric]:
        """LoRA slots (docs/lora.md): counters of loads, evictions and requests refused
        after waiting for a slot; gauges of resident and served adapters and of requests
        waiting for a slot."""
        if stats.lora is None:
            return
        for name, value in stats.lora.items():
            doc = _LORA_DOCS[name]
            family: Any = CounterMetricFamily if name in _LORA_COUNTERS else GaugeMetricFamily
            metric = family(f"pdserve_lora_{name}", doc, labels=["role"])
            metric.add_metric([self._role], float(value))
            yield metric

    def _spec_counters(self, stats: SpecDecodeStats) -> Iterator[Metric]:
        """Speculative-decoding tokens drafted and accepted (acceptance = accepted / draft)."""
        for name, doc, value in (
            ("draft_tokens", "tokens proposed by the speculative drafter", stats.num_draft_tokens),
            (
                "accepted_tokens",
                "drafted tokens the target model accepted",
                stats.num_accepted_tokens,
            ),
        ):
            counter = CounterMetricFamily(f"pdserve_spec_{name}", doc, labels=["role", "method"])
            counter.add_metric([self._role, str(stats.method)], float(value))
            yield counter

    def _connector_counters(self, connector: str, stats: ConnectorStats) -> Iterator[Metric]:
        """Every number in the connector's ``ConnectorStats`` as ``pdserve_kv_<field>_total``;
        its ``failures`` dict as ``pdserve_kv_failures_total{reason}``."""
        labels = [connector, self._role]
        for field in dataclasses.fields(stats):
            value = getattr(stats, field.name)
            name = f"pdserve_kv_{field.name}"
            if field.name.startswith("_") or isinstance(value, bool):
                continue
            if isinstance(value, int | float):
                counter = CounterMetricFamily(
                    name, f"KV connector {field.name}", labels=["connector", "role"]
                )
                counter.add_metric(labels, float(value))
                yield counter
            elif isinstance(value, dict):
                counter = CounterMetricFamily(
                    name,
                    f"KV connector {field.name} by reason",
                    labels=["connector", "role", "reason"],
                )
                for reason, count in sorted(dict(value).items()):
                    counter.add_metric([*labels, str(reason)], float(count))
                yield counter

    def _fallbacks(self, stats: EngineStats) -> Iterator[Metric]:
        """Remote-KV loads that fell short (by reason), and the blocks recomputed instead."""
        fallbacks = CounterMetricFamily(
            "pdserve_kv_load_fallbacks",
            "remote KV loads that fell short (blocks missing, corrupt, store unreachable)",
            labels=["role", "reason"],
        )
        for reason, count in sorted(stats.kv_load_fallbacks.items()):
            fallbacks.add_metric([self._role, str(reason)], float(count))
        yield fallbacks
        recomputed = CounterMetricFamily(
            "pdserve_kv_blocks_recomputed",
            "KV blocks recomputed locally instead of loaded",
            labels=["role"],
        )
        recomputed.add_metric([self._role], float(stats.kv_blocks_recomputed))
        yield recomputed
        local = CounterMetricFamily(
            "pdserve_kv_blocks_local",
            "handoff prompt blocks this instance held already (its prefix cache): not moved",
            labels=["role"],
        )
        local.add_metric([self._role], float(stats.kv_blocks_local))
        yield local


@dataclasses.dataclass(slots=True)
class ServiceMetrics:
    """The metric objects of one service; ``registry`` is what ``/metrics`` serves."""

    role: str
    registry: CollectorRegistry
    requests: Counter
    phase_seconds: Histogram

    @classmethod
    def create(cls, role: str) -> ServiceMetrics:
        registry = CollectorRegistry(auto_describe=True)
        requests = Counter(
            "pdserve_service_requests",
            "RPCs by method and outcome (ok, cancelled, deadline_exceeded, or the status code)",
            ["role", "rpc", "outcome"],
            registry=registry,
        )
        phase_seconds = Histogram(
            "pdserve_phase_seconds",
            "per-request phase durations: queue, compute, kv_save, kv_load",
            ["role", "phase"],
            buckets=_PHASE_BUCKETS,
            registry=registry,
        )
        return cls(role, registry, requests, phase_seconds)

    def watch_engine(self, engine: Any) -> None:
        """Export the engine's load, connector stats and KV fallbacks at scrape time."""
        self.registry.register(_EngineCollector(self.role, engine))

    def record_outcome(self, rpc: str, outcome: str) -> None:
        self.requests.labels(self.role, rpc, outcome).inc()

    def observe_timings(self, timings: pb.PhaseTimings) -> None:
        """Record one request's phase timings (phases that did not happen are left out)."""
        for phase in ("queue_s", "compute_s", "kv_save_s", "kv_load_s"):
            value = getattr(timings, phase)
            if value > 0:
                self.phase_seconds.labels(self.role, phase.removesuffix("_s")).observe(value)

    def serve(self, host: str, port: int) -> Any:
        """Start the ``/metrics`` HTTP server on a daemon thread; returns it (``shutdown()``)."""
        server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return server
