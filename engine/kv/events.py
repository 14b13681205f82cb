"""The KV event publisher (docs/design.md §3 "KV events"): one batch per engine step that
had events, numbered without gaps, handed to every subscriber's bounded queue.

Threads: the engine thread calls ``pump`` between steps (it drains the step's
``KvEventLog``, numbers the batch and appends it to each subscriber's deque: no protobuf,
no gRPC, one ``call_soon_threadsafe`` at most per subscriber). Subscribers live on an
asyncio loop (the gRPC servicer): ``subscribe`` asks the engine thread for a snapshot,
which it takes at its next ``pump`` — between steps, so the snapshot is exactly the
state after the batch whose ``seq`` it carries, and the next live batch is ``seq + 1``.

A subscriber that lets ``max_queue`` batches pile up is cut off: its queue is dropped and
its stream ends (``SubscriberBehind``); it resubscribes and starts from a new snapshot.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.core.kv_cache_manager import KVCacheManager
from engine.core.kv_events import TIER_DEVICE, TIER_HOST, KvEvent, KvEventLog, chains


@dataclass(slots=True)
class KvEventStats:
    """The publisher's figures (the service exports them: pdserve_kv_events_*)."""

    batches: int = 0  # batches published (the instance's seq)
    events: int = 0  # events in them
    subscribers: int = 0  # subscriptions open now
    cut_off: int = 0  # subscribers dropped for falling behind


class SubscriberBehind(Exception):
    """The subscriber fell ``max_queue`` batches behind and was cut off."""


class PublisherClosed(Exception):
    """The engine is shutting down; no more batches come from this epoch."""


# A snapshot as the engine thread takes it: each tier's hash -> parent map, copied.
Held = list[tuple[int, dict[bytes, bytes]]]


@dataclass(slots=True)
class KvEventBatch:
    """Events of one step (``snapshot``: every block held now, as STORED events).

    A snapshot leaves the engine thread as ``held`` (one dict copy per tier) and its
    reader turns that into STORED runs (``expand``: ~100 ms per 100k blocks, which the
    step loop does not wait for)."""

    instance_epoch: str
    seq: int
    snapshot: bool
    events: list[KvEvent] = field(default_factory=list)
    held: Held = field(default_factory=list)

    def expand(self) -> KvEventBatch:
        if self.held:
            self.events = [e for tier, parents in self.held for e in chains(parents, tier)]
            self.held = []
        return self


def snapshot_held(kv: KVCacheManager, host_parents: dict[bytes, bytes] | None) -> Held:
    """What the tiers hold now: the device pool's cached blocks, then the host tier's."""
    held = [(TIER_DEVICE, kv.pool.parents())]
    if host_parents is not None:
        held.append((TIER_HOST, host_parents))
    return held


class Subscription:
    """One subscriber's queue: filled on the engine thread, read on ``loop``."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_queue: int) -> None:
        self._loop = loop
        self._max_queue = max_queue
        self._batches: deque[KvEventBatch] = deque()
        self._ready = asyncio.Event()
        self._signalled = False  # a wake-up is on its way to the loop (engine thread sets)
        self.ended: BaseException | None = None  # why no more batches come (engine thread)
        self.closed = False  # the reader left (loop thread sets; the engine thread drops it)

    def push(self, batch: KvEventBatch) -> bool:
        """Engine thread. False (and the subscription ends) when the reader is too far behind."""
        if len(self._batches) >= self._max_queue:
            self._batches.clear()
            self.end(SubscriberBehind(f"fell {self._max_queue} KV event batches behind"))
            return False
        self._batches.append(batch)
        self._wake()
        return True

    def end(self, why: BaseException) -> None:
        self.ended = why
        self._wake()

    def _wake(self) -> None:
        if not self._signalled:
            self._signalled = True
            try:
                self._loop.call_soon_threadsafe(self._ready.set)
            except RuntimeError:  # the reader's loop is closed: nobody is left to read
                self.closed = True

    async def next(self, timeout: float | None = None) -> KvEventBatch:
        """The next batch (a snapshot still to ``expand``); raises why the subscription
        ended (``SubscriberBehind``, ``PublisherClosed``) once its batches are read,
        ``TimeoutError`` after ``timeout``."""
        while True:
            # Clear before looking, so a batch pushed after the look wakes the wait below.
            self._signalled = False
            self._ready.clear()
            if self.ended is not None and isinstance(self.ended, SubscriberBehind):
                raise self.ended  # its queue was dropped: what is left is not contiguous
            if self._batches:
                return self._batches.popleft()
            if self.ended is not None:
                raise self.ended
            await asyncio.wait_for(self._ready.wait(), timeout)

    def close(self) -> None:
        """The reader is gone (any thread); the engine thread forgets it at its next pump."""
        self.closed = True


class KvEventPublisher:
    """Numbers the engine's event batches and fans them out (see the module docstring).

    ``snapshot`` copies the current state (engine thread only; ``snapshot_held``), or says
    None when it has none to give yet (engine/kv/event_relay.py);
    ``wake`` nudges the engine thread so a new subscriber's snapshot does not wait for its
    idle timeout.
    """

    def __init__(
        self,
        log: KvEventLog,
        snapshot: Callable[[], Held | None],
        max_queue: int,
        wake: Callable[[], None] = lambda: None,
    ) -> None:
        if max_queue < 1:
            raise ValueError(f"the KV event queue bound must be >= 1 batch, got {max_queue}")
        self.instance_epoch = uuid.uuid4().hex  # new on every start: a restart is visible
        self._log = log
        self._snapshot = snapshot
        self._max_queue = max_queue
        self._wake = wake
        self._seq = 0
        self._subs: list[Subscription] = []  # engine thread only
        self._joining: deque[Subscription] = deque()  # any thread -> engine thread
        self._lock = threading.Lock()  # orders subscribe against close
        self._closed = False
        self._why = ""
        self.stats = KvEventStats()

    def subscribe(self, loop: asyncio.AbstractEventLoop) -> Subscription:
        """A new subscription (any thread); its first batch is a snapshot."""
        sub = Subscription(loop, self._max_queue)
        with self._lock:
            if self._closed:
                sub.end(PublisherClosed(self._why))
                return sub
            self._joining.append(sub)
        self._wake()
        return sub

    def pump(self) -> None:
        """Engine thread, between steps: publish the step's events, then snapshots."""
        if self._closed:
            self._log.drain()  # nobody can subscribe any more: keep the log from growing
            return
        if self._log:
            self._seq += 1
            batch = KvEventBatch(self.instance_epoch, self._seq, False, self._log.drain())
            self.stats.batches = self._seq
            self.stats.events += len(batch.events)
            for sub in self._subs:
                if not sub.closed and not sub.push(batch):
                    self.stats.cut_off += 1
        # None: no snapshot can be taken now (the engine is in another process and sends
        # one later); the joining subscribers wait for the pump that has it.
        held = self._snapshot() if self._joining else None
        while held is not None and self._joining:
            sub = self._joining.popleft()
            if not sub.closed:
                sub.push(KvEventBatch(self.instance_epoch, self._seq, True, held=held))
                self._subs.append(sub)
        if any(s.closed or s.ended is not None for s in self._subs):
            self._subs = [s for s in self._subs if not s.closed and s.ended is None]
        self.stats.subscribers = len(self._subs) + len(self._joining)

    def close(self, why: str = "the engine is shutting down") -> None:
        """End every subscription and refuse new ones; any thread, idempotent."""
        with self._lock:
            self._closed = True
            self._why = why
            subs = [*self._subs, *self._joining]
            self._joining.clear()
        self.stats.subscribers = 0
        for sub in subs:
            sub.end(PublisherClosed(why))
