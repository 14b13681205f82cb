"""``router.legs.stream_watch.StreamWatch``: cancels a decode call when its instance is lost or
no chunk came within the idle deadline; tells its own cancellation, and a channel closed
under the call, from the reader's."""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import grpc
import pytest

from router.legs.stream_watch import StreamWatch
from router.routing.pool import Instance


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
            assert watch.broken() == watch.reason
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
        return call, watch

    call, watch = asyncio.run(run())
    assert not call.cancelled.is_set() and watch.reason is None


def test_rejects_a_non_positive_deadline() -> None:
    async def run() -> None:
        StreamWatch(FakeCall(), _instance(), idle_s=0)

    with pytest.raises(ValueError):
        asyncio.run(run())


def test_reader_cancelled_is_not_a_broken_stream() -> None:
    async def run() -> str | None:
        seen: list[str | None] = []

        async def reader() -> None:
            async with StreamWatch(FakeCall(), _instance(), idle_s=600) as watch:
                try:
                    await asyncio.sleep(600)
                except asyncio.CancelledError:
                    seen.append(watch.broken())
                    raise

        task = asyncio.create_task(reader())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return seen[0]

    assert asyncio.run(run()) is None


def test_channel_closed_under_a_stream_is_a_broken_stream() -> None:
    """The pool closes the channel of an instance discovery dropped (it moved to new
    ports); a call still waiting on that address (here a socket that accepts and never
    answers, as a process that took the old port does) is cancelled by the close, and the
    real grpc.aio stream ends in CancelledError. That must read as a lost stream to resume
    elsewhere, not as the client leaving (the router answered 499)."""

    async def run() -> str | None:
        squatter = socket.socket()
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        channel = grpc.aio.insecure_channel(f"127.0.0.1:{squatter.getsockname()[1]}")
        try:
            call = channel.unary_stream("/t.T/S")(b"", timeout=30)
            closer = asyncio.get_running_loop().call_later(
                0.2, lambda: asyncio.ensure_future(channel.close(grace=0.1))
            )
            async with StreamWatch(call, _instance(), idle_s=600) as watch:
                try:
                    async for _ in call:
                        pass
                except asyncio.CancelledError:
                    return watch.broken()
            closer.cancel()
            raise AssertionError("the stream ended without a cancellation")
        finally:
            squatter.close()

    reason = asyncio.run(run())
    assert reason is not None and "left the pool" in reason
