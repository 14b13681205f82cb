"""Coalescing a streamed answer's deltas (docs/design.md §3 "Output streams").

A reader task takes the deltas off the decode streams as they arrive; the SSE writer takes
everything that piled up since its last write and merges the consecutive deltas of a
choice into one, so a router that fell behind under load writes one chunk (one JSON body,
one HTTP write) for several tokens instead of one per token, as vLLM's and OpenAI's
servers do under load. A writer that keeps up sees one delta at a time, unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator

from router.legs.trace import Delta


def mergeable(a: Delta, b: Delta) -> bool:
    """``b`` continues ``a``: the same choice, ``a`` not finished, ``b`` without prompt
    logprobs (those lead a choice's first delta), logprobs on both or neither."""
    return (
        a.index == b.index
        and a.finish_reason is None
        and b.prompt_logprobs is None
        and (a.logprobs is None) == (b.logprobs is None)
    )


def merge(a: Delta, b: Delta) -> Delta:
    return Delta(
        a.index,
        a.token_ids + b.token_ids,
        a.text + b.text,
        None if a.logprobs is None else a.logprobs + (b.logprobs or []),
        b.finish_reason,
        a.prompt_logprobs,
    )


def merge_queued(queued: deque[Delta]) -> list[Delta]:
    """Empty ``queued`` into as few deltas as the rules allow: each choice's deltas in their
    order (choices are separate streams inside one SSE stream, told apart by index, so
    those of several choices n > 1 merge each into its own)."""
    out: list[Delta] = []
    last: dict[int, int] = {}  # choice index -> position of its latest delta in ``out``
    while queued:
        delta = queued.popleft()
        at = last.get(delta.index)
        if at is not None and mergeable(out[at], delta):
            out[at] = merge(out[at], delta)
        else:
            last[delta.index] = len(out)
            out.append(delta)
    return out


async def coalesced(run: AsyncIterator[Delta]) -> AsyncGenerator[list[Delta], None]:
    """``run``'s deltas in batches: each batch is what arrived while the previous one was
    being written, merged (``merge_queued``). An error from ``run`` is raised after the
    deltas before it; closing this generator cancels the reader (and so ``run``)."""
    queued: deque[Delta] = deque()
    ready = asyncio.Event()
    end: list[BaseException | None] = []  # [None]: ran out; [exc]: failed

    async def read() -> None:
        try:
            async for delta in run:
                queued.append(delta)
                ready.set()
            end.append(None)
        except Exception as exc:  # noqa: BLE001 - handed to the writer, raised there
            end.append(exc)
        ready.set()

    reader = asyncio.create_task(read())
    try:
        while True:
            await ready.wait()
            ready.clear()
            if queued:
                yield merge_queued(queued)
            if end and not queued:
                if end[0] is not None:
                    raise end[0]
                return
    finally:
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await reader
