"""Figures of the p2p connector beyond the generic ``ConnectorStats`` counters: leases (a
gauge of held leases and of the blocks they pin, and why leases ended) and transfer time as
a histogram per direction. The service metrics export them as ``pdserve_kv_p2p_*``."""

from __future__ import annotations

import bisect
import threading
from dataclasses import dataclass, field

from kv_store.stats import ConnectorStats

# Seconds: an NVLink handoff of a few hundred MiB takes ~1 ms, a CPU one over gloo ~0.1 s.
TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LEASE_END_REASONS = ("pulled", "expired", "aborted", "closed")


@dataclass(slots=True)
class Histogram:
    """Counts per bucket of ``TRANSFER_BUCKETS`` (not cumulative; the last is +Inf)."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(TRANSFER_BUCKETS) + 1))
    total: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> None:
        self.counts[bisect.bisect_left(TRANSFER_BUCKETS, seconds)] += 1
        self.total += seconds
        self.count += 1

    def copy(self) -> Histogram:
        return Histogram(list(self.counts), self.total, self.count)


@dataclass(slots=True)
class P2PStats:
    """A snapshot. Gauges: ``leases_held`` (offered, not yet ended), ``leases_pinned`` (being
    pulled now), ``blocks_held`` (engine blocks the held leases keep allocated; back to 0
    once every lease has ended). Counters: the rest."""

    leases_held: int = 0
    leases_pinned: int = 0
    blocks_held: int = 0
    leases_offered: int = 0
    lease_ends: dict[str, int] = field(default_factory=dict)  # reason -> leases
    pulls_served: int = 0  # prefill side: pulls answered with data
    pulls_done: int = 0  # decode side: pulls that loaded their blocks
    pull_failures: dict[str, int] = field(default_factory=dict)  # either side, by reason
    bytes_sent: int = 0
    bytes_received: int = 0
    pairs_made: int = 0  # process groups formed (a re-made pair counts again)
    pairs_torn_down: int = 0
    seconds: dict[str, Histogram] = field(default_factory=dict)  # "send" | "recv" -> histogram


class P2PCounters:
    """The live figures, updated from the connector's threads under one lock. Pulls also
    count in ``generic`` (the ``ConnectorStats`` every connector keeps): a block sent counts
    as saved, a block received as loaded."""

    def __init__(self, generic: ConnectorStats | None = None) -> None:
        self._lock = threading.Lock()
        self._s = P2PStats(seconds={"send": Histogram(), "recv": Histogram()})
        self.generic = generic if generic is not None else ConnectorStats()

    def lease_offered(self, blocks: int) -> None:
        with self._lock:
            self._s.leases_offered += 1
            self._s.leases_held += 1
            self._s.blocks_held += blocks

    def lease_ended(self, blocks: int, reason: str) -> None:
        with self._lock:
            self._s.leases_held -= 1
            self._s.blocks_held -= blocks
            self._s.lease_ends[reason] = self._s.lease_ends.get(reason, 0) + 1

    def pinned(self, delta: int) -> None:
        with self._lock:
            self._s.leases_pinned += delta

    def transferred(self, direction: str, blocks: int, nbytes: int, seconds: float) -> None:
        """One successful pull: ``"send"`` (prefill side) or ``"recv"`` (decode side)."""
        if direction == "send":
            self.generic.record_save(blocks, nbytes, 0)
            self.generic.record_seconds("save", seconds)
        else:
            self.generic.record_load(blocks, nbytes)
            self.generic.record_seconds("load", seconds)
        with self._lock:
            if direction == "send":
                self._s.pulls_served += 1
                self._s.bytes_sent += nbytes
            else:
                self._s.pulls_done += 1
                self._s.bytes_received += nbytes
            self._s.seconds[direction].observe(seconds)

    def failed(self, reason: str) -> None:
        self.generic.record_failure(reason)
        with self._lock:
            self._s.pull_failures[reason] = self._s.pull_failures.get(reason, 0) + 1

    def pair(self, made: bool) -> None:
        with self._lock:
            if made:
                self._s.pairs_made += 1
            else:
                self._s.pairs_torn_down += 1

    def snapshot(self) -> P2PStats:
        with self._lock:
            s = self._s
            return P2PStats(
                s.leases_held,
                s.leases_pinned,
                s.blocks_held,
                s.leases_offered,
                dict(s.lease_ends),
                s.pulls_served,
                s.pulls_done,
                dict(s.pull_failures),
                s.bytes_sent,
                s.bytes_received,
                s.pairs_made,
                s.pairs_torn_down,
                {k: h.copy() for k, h in s.seconds.items()},
            )
