"""Prometheus families of a p2p connector's ``P2PStats`` (read at scrape time).

| metric | type | labels |
|---|---|---|
| pdserve_kv_p2p_leases | gauge | connector, role, state (held, pinned: being pulled) |
| pdserve_kv_p2p_blocks_held | gauge | connector, role — engine blocks kept for a pull; 0 when idle |
| pdserve_kv_p2p_lease_ends_total | counter | connector, role, reason (pulled, expired, aborted, closed) |
| pdserve_kv_p2p_bytes_total | counter | connector, role, direction (send, recv) |
| pdserve_kv_p2p_transfer_seconds | histogram | connector, role, direction |
| pdserve_kv_p2p_pairs_total | counter | connector, role, event (made, torn_down) |

Bytes per connector as the router sees them stay ``pdserve_kv_bytes_total{connector}`` on
the router; the generic ``pdserve_kv_{blocks,bytes}_{saved,loaded}_total`` count blocks sent
(prefill) and received (decode) here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

if TYPE_CHECKING:
    from kv_store.p2p.stats import P2PStats


def transport_families(connector: str, role: str, transport: object) -> Iterator[Metric]:
    """The families of a connector's transport figures (``EngineStats.transport``): p2p's
    below; a kind this module does not know exports nothing."""
    from kv_store.p2p.stats import P2PStats

    if isinstance(transport, P2PStats):
        yield from p2p_families(connector, role, transport)


def p2p_families(connector: str, role: str, stats: P2PStats) -> Iterator[Metric]:
    """Every family of the table above for one snapshot."""
    from kv_store.p2p.stats import LEASE_END_REASONS, TRANSFER_BUCKETS

    labels = ["connector", "role"]
    base = [connector, role]
    leases = GaugeMetricFamily(
        "pdserve_kv_p2p_leases", "p2p leases by state", labels=[*labels, "state"]
    )
    leases.add_metric([*base, "held"], float(stats.leases_held))
    leases.add_metric([*base, "pinned"], float(stats.leases_pinned))
    yield leases
    held = GaugeMetricFamily(
        "pdserve_kv_p2p_blocks_held", "KV blocks kept allocated for a peer's pull", labels=labels
    )
    held.add_metric(base, float(stats.blocks_held))
    yield held
    ends = CounterMetricFamily(
        "pdserve_kv_p2p_lease_ends", "p2p leases ended, by reason", labels=[*labels, "reason"]
    )
    for reason in sorted(set(LEASE_END_REASONS) | set(stats.lease_ends)):
        ends.add_metric([*base, reason], float(stats.lease_ends.get(reason, 0)))
    yield ends
    moved = CounterMetricFamily(
        "pdserve_kv_p2p_bytes", "KV bytes moved peer to peer", labels=[*labels, "direction"]
    )
    moved.add_metric([*base, "send"], float(stats.bytes_sent))
    moved.add_metric([*base, "recv"], float(stats.bytes_received))
    yield moved
    seconds = HistogramMetricFamily(
        "pdserve_kv_p2p_transfer_seconds",
        "seconds per p2p pull (data and confirmation), per side",
        labels=[*labels, "direction"],
    )
    for direction, hist in sorted(stats.seconds.items()):
        running, buckets = 0, []
        for bound, count in zip((*TRANSFER_BUCKETS, float("inf")), hist.counts, strict=True):
            running += count
            buckets.append((_bound(bound), float(running)))
        seconds.add_metric([*base, direction], buckets, hist.total)
    yield seconds
    pairs = CounterMetricFamily(
        "pdserve_kv_p2p_pairs", "p2p process groups made and torn down", labels=[*labels, "event"]
    )
    pairs.add_metric([*base, "made"], float(stats.pairs_made))
    pairs.add_metric([*base, "torn_down"], float(stats.pairs_torn_down))
    yield pairs


def _bound(value: float) -> str:
    return "+Inf" if value == float("inf") else repr(float(value))
