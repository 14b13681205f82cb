"""From router ``/metrics`` pages to the windowed SLO signals the policy reads.

A scrape is a cumulative snapshot; a *window* is the difference between two scrapes of
the same router. Latency percentiles come from histogram bucket deltas (what
``histogram_quantile(0.9, rate(...))`` computes in Prometheus); queue depth comes from the
router's per-instance gauges at the newest scrape. With several router replicas, bucket
deltas add up across routers and each instance's gauge is counted once (every router
reports every instance, so the largest report per instance is kept).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

TTFT = "pdserve_ttft_seconds"
ITL = "pdserve_itl_seconds"
WAITING = "pdserve_instance_waiting"

Buckets = dict[float, float]  # upper bound ("le") -> cumulative count


@dataclass(slots=True)
class MetricsSnapshot:
    """The parts of one router's page the autoscaler needs (label sets merged)."""

    histograms: dict[str, Buckets] = field(default_factory=dict)
    # (pool, instance) -> value, per gauge name
    gauges: dict[str, dict[tuple[str, str], float]] = field(default_factory=dict)


def parse_metrics(text: str, histograms: Iterable[str] = (TTFT, ITL)) -> MetricsSnapshot:
    """Parse a Prometheus text page. Raises ValueError on a malformed page."""
    wanted = set(histograms)
    snap = MetricsSnapshot()
    for family in text_string_to_metric_families(text):
        if family.name in wanted and family.type == "histogram":
            buckets = snap.histograms.setdefault(family.name, {})
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    upper = float(sample.labels["le"])
                    buckets[upper] = buckets.get(upper, 0.0) + float(sample.value)
        elif family.name == WAITING and family.type == "gauge":
            values = snap.gauges.setdefault(family.name, {})
            for sample in family.samples:
                key = (sample.labels.get("pool", ""), sample.labels.get("instance", ""))
                values[key] = float(sample.value)
    return snap


def bucket_delta(before: Buckets | None, after: Buckets) -> Buckets:
    """Per-bucket increase between two scrapes; a decrease means the router restarted
    (counters reset), and then the new totals are the whole window."""
    if not before or any(after.get(le, 0.0) < count for le, count in before.items()):
        return dict(after)
    return {le: count - before.get(le, 0.0) for le, count in after.items()}


def quantile(q: float, buckets: Mapping[float, float]) -> float | None:
    """Prometheus ``histogram_quantile`` over cumulative buckets; None when empty.

    Linear interpolation inside the bucket that holds the rank; a rank in the +Inf
    bucket returns the largest finite bound (the histogram cannot say more).
    """
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"quantile {q} outside [0, 1]")
    bounds = sorted(buckets)
    if not bounds or buckets[bounds[-1]] <= 0:
        return None
    rank = q * buckets[bounds[-1]]
    lower_bound, lower_count = 0.0, 0.0
    for upper in bounds:
        count = buckets[upper]
        if count >= rank and count > lower_count:
            if math.isinf(upper):
                return lower_bound
            return lower_bound + (upper - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = (upper if not math.isinf(upper) else lower_bound), count
    return lower_bound


@dataclass(frozen=True, slots=True)
class Signals:
    """One window's view of the SLOs. A p90 is None when the window saw no samples."""

    ttft_p90: float | None
    ttft_count: float
    itl_p90: float | None
    itl_count: float
    prefill_waiting: float
    decode_waiting: float


def _count(buckets: Buckets) -> float:
    return buckets[max(buckets)] if buckets else 0.0


def window_signals(
    before: Mapping[str, MetricsSnapshot], after: Mapping[str, MetricsSnapshot]
) -> Signals:
    """Signals between two scrape rounds, keyed by router target. Only targets present
    in both rounds contribute latency (a new router has no window yet); gauges come from
    every target of the newest round."""
    merged: dict[str, Buckets] = {TTFT: {}, ITL: {}}
    for target, snap in after.items():
        prev = before.get(target)
        if prev is None:
            continue
        for name, total in merged.items():
            if name not in snap.histograms:
                continue
            delta = bucket_delta(prev.histograms.get(name), snap.histograms[name])
            for le, count in delta.items():
                total[le] = total.get(le, 0.0) + count
    waiting: dict[tuple[str, str], float] = {}
    for snap in after.values():
        for key, value in snap.gauges.get(WAITING, {}).items():
            waiting[key] = max(waiting.get(key, 0.0), value)
    return Signals(
        ttft_p90=quantile(0.9, merged[TTFT]),
        ttft_count=_count(merged[TTFT]),
        itl_p90=quantile(0.9, merged[ITL]),
        itl_count=_count(merged[ITL]),
        prefill_waiting=sum(v for (pool, _), v in waiting.items() if pool == "prefill"),
        decode_waiting=sum(v for (pool, _), v in waiting.items() if pool == "decode"),
    )
