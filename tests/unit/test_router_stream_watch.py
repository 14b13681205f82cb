"""``router.stream_watch.StreamWatch``: cancels a decode call when its instance is lost or
no chunk came within the idle deadline; tells its own cancellation from the reader's."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from router.pool import Instance
from router.stream_watch import StreamWatch


class FakeCall:
    """Stands in for a grpc.aio call: records ``cancel()`` as an event."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()

    def cancel(self) -> bool:
        self.cancelled.set()
        return True


def _instance() -> Instance:
    none: Any = None
    return Instance("127.0.0.1:1", "decode", none, none, none, healthy=True)


def test_lost_instance_cancels_the_call() -> None:
    async def run() -> StreamWatch:
        call, inst = FakeCall(), _instance()
        async with StreamWatch(call, inst, idle_s=600) as watch:
            inst.last_error = "DEADLINE_EXCEEDED: health check"
            inst.lost.set()
            await asyncio.wait_for(call.cancelled.wait(), 30)
            assert watch.stalled()
        return watch

    watch = asyncio.run(run())
    assert watch.kind == "health" and "health checks" in (watch.reason or "")


def test_idle_deadline_cancels_the_call() -> None:
    async def run() -> StreamWatch:
        call = FakeCall()
        async with StreamWatch(call, _instance(), idle_s=0.05) as watch:
            await asyncio.wait_for(call.cancelled.wait(), 30)
        return watch

    watch = asyncio.run(run())
    assert watch.kind == "idle"


def test_untriggered_watch_leaves_the_call_alone() -> None:
    async def run() -> tuple[FakeCall, StreamWatch]:
        call = FakeCall()
        async with StreamWatch(call, _instance(), idle_s=600) as watch:
            watch.touch()
            await asyncio.sleep(0)
            assert not watch.stalled()
        return call, watch

    call, watch = asyncio.run(run())
    assert not call.cancelled.is_set() and watch.reason is None


def test_rejects_a_non_positive_deadline() -> None:
    async def run() -> None:
        StreamWatch(FakeCall(), _instance(), idle_s=0)

    with pytest.raises(ValueError):
        asyncio.run(run())
