"""Noticing a client that left while its request waits (docs/router.md "Client
disconnects"; issue #36).

A streamed request answers only once its first token is there: until then no byte is sent,
so a client that hangs up is noticed only by reading the connection. Without that, every
stream of an abort storm (opened and dropped before its first token) kept its prefill, and
with it its place in the prefill queue ahead of everyone else's first token. Here the wait
for the first delta races the connection's ``http.disconnect``; the loser is cancelled,
which cancels the gRPC calls under it (their instances abort the request).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")


class ClientGone(Exception):
    """The client closed the connection before the awaited item came."""


async def wait_disconnect(request: Request) -> None:
    """Return once the client has closed the connection (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def first_or_gone(request: Request, run: AsyncIterator[T]) -> T | None:
    """The first item of ``run`` (None when it ends empty); ClientGone when the client
    leaves first, ``run`` then closed (its calls cancelled)."""
    first: asyncio.Task[T | None] = asyncio.ensure_future(anext(run, None))
    watcher = asyncio.create_task(wait_disconnect(request))
    try:
        await asyncio.wait({first, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone = watcher.done() and not first.done()
        watcher.cancel()
        if not first.done():
            first.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await first
    if gone:
        with contextlib.suppress(Exception):
            await run.aclose()  # type: ignore[attr-defined]
        raise ClientGone
    return first.result()
