"""Leases: the prefill side's promise to keep a request's blocks until the decode side pulls.

A lease is offered when the engine finishes a prefill (``start_save``) and ends exactly once,
for one reason: ``pulled`` (the decode side confirmed it has the blocks), ``expired`` (no
pull within the lease time — the decode side died, or never came), ``aborted`` (the
request was aborted on the prefill side) or ``closed`` (the connector shut down). Only when
it ends does the engine free the blocks, so a pull in progress (the lease is *pinned*)
always reads live blocks: an abort or an expiry that falls during a pull takes effect when
the pull finishes, and the puller is then told the data is void.

A lease is pulled by one decode process, or, when a decode of another grid re-cuts the
blocks (docs/design.md §3 "KV between unlike grids"), by several that each need part of
them: the first pull says how many (``pullers``), they may pull at once, and the lease ends
as ``pulled`` when the last of them has.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kv_store.p2p.stats import P2PCounters
from kv_store.p2p.wire import PeerError


@dataclass(slots=True)
class Lease:
    transfer_id: str
    request_id: str
    block_ids: list[int]
    block_hashes: list[bytes]
    expires_at: float
    ready: Any = None  # CUDA event: the KV is written (None on the CPU)
    pinned: int = 0  # pulls in progress (more than one only for a shared lease)
    pulls_left: int = 0  # pulls still to finish before it ends as pulled (0: none yet)
    void: str | None = None  # set while pinned: the end reason to apply when unpinned


class LeaseTable:
    """Thread-safe table of held leases. ``on_end(lease, reason)`` is called once per lease,
    outside the table's lock, when it ends."""

    def __init__(
        self, lease_s: float, counters: P2PCounters, on_end: Callable[[Lease, str], None]
    ) -> None:
        if lease_s <= 0:
            raise ValueError(f"p2p lease seconds must be > 0, got {lease_s}")
        self.lease_s = lease_s
        self._counters = counters
        self._on_end = on_end
        self._lock = threading.Lock()
        self._by_id: dict[str, Lease] = {}
        self._by_request: dict[str, str] = {}

    def offer(
        self, request_id: str, block_ids: list[int], block_hashes: list[bytes], ready: Any
    ) -> Lease:
        """Hold ``block_ids`` under a new transfer id (the request id plus a random suffix:
        readable in logs, unguessable, and distinct when a request id is reused)."""
        lease = Lease(
            f"{request_id}.{secrets.token_hex(8)}",
            request_id,
            list(block_ids),
            list(block_hashes),
            time.monotonic() + self.lease_s,
            ready,
        )
        with self._lock:
            old = self._by_request.get(request_id)
            self._by_id[lease.transfer_id] = lease
            self._by_request[request_id] = lease.transfer_id
        self._counters.lease_offered(len(lease.block_ids))
        if old is not None:  # the engine never re-saves a held request; be safe anyway
            self._end_by_id(old, "aborted")
        return lease

    def pin(self, transfer_id: str, pullers: int = 1) -> Lease:
        """Claim a lease for a pull, one of ``pullers`` that share it; ``PeerError``
        (``missing`` / ``busy``) when it has ended, never existed, or another pull has it
        and the lease is not shared."""
        with self._lock:
            lease = self._by_id.get(transfer_id)
            if lease is None or lease.void is not None or time.monotonic() >= lease.expires_at:
                raise PeerError(f"no held KV under transfer id {transfer_id!r}", "missing")
            if lease.pulls_left == 0:
                lease.pulls_left = pullers
            if lease.pinned and (pullers == 1 or lease.pulls_left <= lease.pinned):
                raise PeerError(f"transfer {transfer_id!r} is being pulled already", "busy")
            lease.pinned += 1
        self._counters.pinned(+1)
        return lease

    def unpin(self, lease: Lease, end: str | None) -> str | None:
        """Finish a pull: end the lease with ``end`` (``"pulled"``), or keep holding it when
        ``end`` is None (the pull failed; another may come until expiry). An abort or expiry
        that arrived during the pull wins. Returns the reason the lease ended, if it did."""
        with self._lock:
            lease.pinned -= 1
            if end == "pulled":
                lease.pulls_left -= 1
                if lease.pulls_left > 0:
                    end = None  # another puller's part is still to come
            reason = lease.void or end
            if reason is None and time.monotonic() >= lease.expires_at:
                reason = "expired"
            if lease.pinned:
                reason = None  # the last pull in progress ends it
            if reason is not None:
                self._drop(lease)
        self._counters.pinned(-1)
        if reason is not None:
            self._finish(lease, reason)
        return reason

    def is_void(self, lease: Lease) -> bool:
        """Whether the lease was aborted (or the connector closed) during its pull."""
        with self._lock:
            return lease.void is not None

    def end_request(self, request_id: str, reason: str = "aborted") -> bool:
        """End the request's lease (abort); False when it holds none."""
        with self._lock:
            transfer_id = self._by_request.get(request_id)
        return transfer_id is not None and self._end_by_id(transfer_id, reason)

    def reap(self) -> int:
        """End every lease past its time that no pull holds; returns how many ended."""
        now = time.monotonic()
        with self._lock:
            due = [x for x in self._by_id.values() if x.expires_at <= now and not x.pinned]
            for lease in due:
                self._drop(lease)
        for lease in due:
            self._finish(lease, "expired")
        return len(due)

    def end_all(self, reason: str = "closed") -> None:
        with self._lock:
            ids = list(self._by_id)
        for transfer_id in ids:
            self._end_by_id(transfer_id, reason)

    def __len__(self) -> int:
        with self._lock:
            return len(self._by_id)

    # -- internals -------------------------------------------------------------------------
    def _end_by_id(self, transfer_id: str, reason: str) -> bool:
        with self._lock:
            lease = self._by_id.get(transfer_id)
            if lease is None or lease.void is not None:
                return False
            if lease.pinned:  # the pull ends it (and tells the puller the data is void)
                lease.void = reason
                return True
            self._drop(lease)
        self._finish(lease, reason)
        return True

    def _drop(self, lease: Lease) -> None:
        """Remove from the table (lock held)."""
        self._by_id.pop(lease.transfer_id, None)
        if self._by_request.get(lease.request_id) == lease.transfer_id:
            del self._by_request[lease.request_id]

    def _finish(self, lease: Lease, reason: str) -> None:
        self._counters.lease_ended(len(lease.block_ids), reason)
        self._on_end(lease, reason)
