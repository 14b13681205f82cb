"""KV events of an engine that runs in another process (docs/design.md §3 "KV events",
"Engine thread or engine process").

The engine process drains its ``KvEventLog`` after every command pass and sends the events
with that pass's message; on request it sends a snapshot of what it holds, in the same
ordered stream. Here, in the service process, a ``KvEventPublisher`` numbers and fans them
out as it does beside an engine thread: each message's events are one batch, and a snapshot
is handed to the subscribers joining when it arrives, so it is exactly the state after the
batches received before it and the next batch is its ``seq + 1``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from engine.core.kv_events import KvEvent, KvEventLog
from engine.kv.events import Held, KvEventPublisher

logger = logging.getLogger(__name__)


def pump_kv_events(publisher: KvEventPublisher) -> None:
    """``publisher.pump()``; a bug there must not stop serving: end the streams instead."""
    try:
        publisher.pump()
    except Exception:
        logger.exception("publishing KV events failed; no more KV event streams here")
        publisher.close("KV events failed on this instance (see its log)")


class KvEventRelay:
    """The service side; ``ask_snapshot`` asks the engine process for a snapshot (any
    thread). ``received``/``snapshot_received`` run on the thread that reads the engine
    process's messages, in their order."""

    def __init__(self, max_queue: int, ask_snapshot: Callable[[], None]) -> None:
        self._log = KvEventLog()
        self._held: Held | None = None
        self.publisher = KvEventPublisher(self._log, self._take_held, max_queue, ask_snapshot)

    def _take_held(self) -> Held | None:
        return self._held

    def received(self, events: list[KvEvent]) -> None:
        if events:
            self._log.extend(events)
            pump_kv_events(self.publisher)

    def snapshot_received(self, held: Held) -> None:
        """A snapshot taken after every batch received so far: the joining subscribers'.
        Dropped after this pump: a later subscriber asks for a newer one."""
        self._held = held
        try:
            pump_kv_events(self.publisher)
        finally:
            self._held = None
