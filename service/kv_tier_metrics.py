"""Service metrics of the KV event publisher and the host KV tier (docs/design.md §3
"KV events", "Host KV tier"), read from ``EngineStats`` at scrape time.

| metric | type |
|---|---|
| pdserve_kv_events_batches_total, pdserve_kv_events_published_total | counter |
| pdserve_kv_events_subscribers | gauge |
| pdserve_kv_events_subscribers_cut_off_total | counter |
| pdserve_kv_host_{offloaded,hits,evicted}_total | counter (blocks) |
| pdserve_kv_host_blocks, pdserve_kv_host_capacity_blocks | gauge |

All carry the label ``role``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from engine.stats import EngineStats

_EVENTS = (
    ("batches", "kv_events_batches", "KV event batches published (the instance's seq)", True),
    ("events", "kv_events_published", "KV events published, in those batches", True),
    ("subscribers", "kv_events_subscribers", "KV event subscriptions open now", False),
    (
        "cut_off",
        "kv_events_subscribers_cut_off",
        "KV event subscribers cut off (fell behind)",
        True,
    ),
)
_HOST = (
    ("offloaded", "kv_host_offloaded", "blocks the device cache evicted into the host tier", True),
    ("hits", "kv_host_hits", "blocks copied back from the host tier for a prefix hit", True),
    ("evicted", "kv_host_evicted", "blocks the host tier dropped for room (LRU)", True),
    ("blocks", "kv_host_blocks", "blocks the host tier holds now", False),
    ("capacity_blocks", "kv_host_capacity_blocks", "blocks the host tier can hold", False),
)


def kv_tier_families(role: str, stats: EngineStats) -> Iterator[Metric]:
    """The families of whichever of the two is on."""
    for source, table in ((stats.kv_events, _EVENTS), (stats.host_tier, _HOST)):
        if source is None:
            continue
        for attr, name, doc, is_counter in table:
            family = (CounterMetricFamily if is_counter else GaugeMetricFamily)(
                f"pdserve_{name}", doc, labels=["role"]
            )
            family.add_metric([role], float(getattr(source, attr)))
            yield family
