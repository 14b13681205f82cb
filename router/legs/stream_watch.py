"""Bound a decode stream that stops producing (docs/design.md §1 "failure rules").

A decode instance that hangs (SIGSTOP, a stuck engine, a half-open connection) keeps its
streams open until the gRPC keepalive or the request deadline. :class:`StreamWatch` runs
beside one stream and cancels its call when either

* the router's health checks found the instance unreachable (``Instance.lost`` is set:
  a Check/GetLoad with no answer — never for draining, whose streams must finish), or
* no chunk arrived for ``idle_s`` seconds (the wait for the first chunk included; time
  the reader spends handing a delta to a slow consumer, ``held``, does not count).

The reader then sees ``asyncio.CancelledError`` from the call (as it does when the pool
closes the channel of an instance discovery dropped); :meth:`StreamWatch.broken` tells
that apart from a cancellation of the reading task itself (client gone), and the decode
leg resumes the choice elsewhere with the tokens it already has.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType
from typing import Any

from router.routing.pool import Instance


class StreamWatch:
    """Async context manager around one ``Decode`` call on ``inst``; ``touch()`` per chunk."""

    __slots__ = ("_call", "_idle_s", "_inst", "_last", "_loop", "_task", "held", "kind", "reason")

    def __init__(self, call: Any, inst: Instance, idle_s: float) -> None:
        if idle_s <= 0:
            raise ValueError(f"idle_s must be > 0, got {idle_s}")
        self._call = call
        self._inst = inst
        self._idle_s = idle_s
        self._loop = asyncio.get_running_loop()
        self._last = self._loop.time()
        self._task: asyncio.Task[None] | None = None
        self.reason: str | None = None  # why the watch cancelled the call; None = it did not
        self.kind = ""  # "health" or "idle" once it did (the metric label)
        # True while the reader waits on its own consumer (a slow client): not our stall.
        self.held = False

    def touch(self) -> None:
        """A chunk arrived: restart the idle clock (a float store; no task per chunk)."""
        self._last = self._loop.time()

    def broken(self) -> str | None:
        """Why the call ended in ``CancelledError`` when the reading task itself was not
        cancelled (the client did not leave): this watch cancelled it (``reason``), or the
        pool closed the call's channel because discovery dropped the instance (it moved to
        new ports) — a lost stream to resume elsewhere, not a client disconnect (a 499).
        None when the reader is being cancelled."""
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            return None
        return self.reason or "the call was cancelled: the instance left the pool"

    async def __aenter__(self) -> StreamWatch:
        self._task = asyncio.create_task(self._watch(), name=f"watch-{self._inst.url}")
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _watch(self) -> None:
        lost = self._inst.lost  # the event of this stream's time on the instance
        while True:
            if self.held:
                self._last = self._loop.time()
            left = self._last + self._idle_s - self._loop.time()
            if left <= 0:
                self.reason, self.kind = f"no chunk for {self._idle_s:g} s", "idle"
                break
            try:
                await asyncio.wait_for(lost.wait(), left)
            except TimeoutError:
                continue  # re-check: a chunk may have moved the clock on
            self.kind = "health"
            self.reason = f"instance taken out by health checks ({self._inst.last_error})"
            break
        self._call.cancel()
