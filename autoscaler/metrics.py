"""The autoscaler's own Prometheus metrics, on a registry of its own (no global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from autoscaler.policy import Decision
from autoscaler.signals import Signals


class AutoscalerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.current = Gauge(
            "pdserve_autoscaler_current_replicas",
            "Replicas before the decision",
            ["pool"],
            registry=r,
        )
        self.desired = Gauge(
            "pdserve_autoscaler_desired_replicas", "Replicas the policy wants", ["pool"], registry=r
        )
        self.pressure = Gauge(
            "pdserve_autoscaler_pressure",
            "Observed/target ratio per signal (1 = on target; NaN = too few samples)",
            ["pool", "signal"],
            registry=r,
        )
        self.signal = Gauge(
            "pdserve_autoscaler_signal", "Windowed SLO signal as observed", ["signal"], registry=r
        )
        self.decisions = Counter(
            "pdserve_autoscaler_decisions_total",
            "Decisions by action",
            ["pool", "action"],
            registry=r,
        )
        self.scale_errors = Counter(
            "pdserve_autoscaler_scale_errors_total",
            "Failed scale reads/patches",
            ["pool"],
            registry=r,
        )
        self.scrape_errors = Counter(
            "pdserve_autoscaler_scrape_errors_total", "Failed router scrapes", registry=r
        )
        self.targets = Gauge(
            "pdserve_autoscaler_scrape_targets", "Routers scraped in the last round", registry=r
        )
        self.last_run = Gauge(
            "pdserve_autoscaler_last_decision_timestamp_seconds",
            "Unix time of the last decision",
            registry=r,
        )
        self.dry_run = Gauge(
            "pdserve_autoscaler_dry_run", "1 when decisions are not applied", registry=r
        )

    def observe_signals(self, s: Signals) -> None:
        nan = float("nan")
        self.signal.labels("ttft_p90_seconds").set(nan if s.ttft_p90 is None else s.ttft_p90)
        self.signal.labels("itl_p90_seconds").set(nan if s.itl_p90 is None else s.itl_p90)
        self.signal.labels("prefill_waiting").set(s.prefill_waiting)
        self.signal.labels("decode_waiting").set(s.decode_waiting)

    def observe_decision(self, d: Decision, now_unix: float) -> None:
        self.current.labels(d.pool).set(d.current)
        self.desired.labels(d.pool).set(d.desired)
        for name, value in d.pressures.items():
            self.pressure.labels(d.pool, name).set(float("nan") if value is None else value)
        self.decisions.labels(d.pool, d.action).inc()
        self.last_run.set(now_unix)
