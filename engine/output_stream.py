"""A request's output stream on the asyncio side of the engine clients (``AsyncLLMEngine``,
``ProcessEngineClient``; docs/design.md §3, "Output streams").

Each step's outputs reach the event loop in one call (``fan_out``), which puts each into its
request's ``OutputStream``. A
consumer that keeps up gets one output per step; one that fell behind (a busy loop, a slow
gRPC write) gets, in one ``get``, every delta queued since its last one merged into a
single ``RequestOutput``: all tokens, text and logprobs, in order. The per-token work
downstream (one protobuf message, one SSE chunk) then runs once per merged output instead of
once per token, so a loaded server catches up instead of falling further behind.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import deque
from collections.abc import AsyncIterator, Callable

from engine.core.outputs import RequestOutput


def mergeable(a: RequestOutput, b: RequestOutput) -> bool:
    """Whether ``b`` may be folded into ``a``: neither ends an error or a KV save (those keep
    their own output) and ``a`` does not finish the request."""
    return not (
        a.finished or a.error or b.error or a.kv_saved is not None or b.kv_saved is not None
    )


def merge(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """``a`` followed by ``b`` as one delta (``a`` is updated and returned). The request's
    running figures (cached tokens, KV load, queue time) are ``b``'s, the latest; prompt
    logprobs ride on the first output that has them."""
    a.new_token_ids = a.new_token_ids + b.new_token_ids
    a.new_text += b.new_text
    if a.logprobs is not None or b.logprobs is not None:
        a.logprobs = (a.logprobs or []) + (b.logprobs or [])
    if a.prompt_logprobs is None:
        a.prompt_logprobs = b.prompt_logprobs
    a.finished, a.finish_reason = b.finished, b.finish_reason
    a.num_prompt_tokens, a.num_cached_tokens = b.num_prompt_tokens, b.num_cached_tokens
    a.kv_load_seconds, a.kv_bytes_loaded = b.kv_load_seconds, b.kv_bytes_loaded
    a.kv_blocks_loaded, a.kv_blocks_recomputed = b.kv_blocks_loaded, b.kv_blocks_recomputed
    a.kv_blocks_local, a.queue_seconds = b.kv_blocks_local, b.queue_seconds
    return a


class OutputStream:
    """One request's outputs (or the error that ends it), in order; used on the event loop
    only."""

    __slots__ = ("_items", "_ready", "generation")

    def __init__(self, generation: int = 0) -> None:
        self._items: deque[RequestOutput | BaseException] = deque()
        self._ready = asyncio.Event()
        # which use of the request id this stream serves: an output made for an earlier
        # request under the same id (still on its way) carries an older one
        self.generation = generation

    def put(self, item: RequestOutput | BaseException) -> None:
        self._items.append(item)
        self._ready.set()

    async def get(self) -> RequestOutput | BaseException:
        """The next output, merged with every output after it that is already here and may
        be (``mergeable``); an error comes alone, after the outputs before it."""
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        items = self._items
        item = items.popleft()
        if isinstance(item, RequestOutput):
            while items and isinstance(items[0], RequestOutput) and mergeable(item, items[0]):
                nxt = items.popleft()
                assert isinstance(nxt, RequestOutput)
                item = merge(item, nxt)
        return item


StreamBatch = list[tuple[OutputStream, RequestOutput | BaseException]]


def fan_out(batch: StreamBatch) -> None:
    """On the event loop: each output into its request's stream."""
    for stream, item in batch:
        stream.put(item)


class RequestStreams:
    """The open requests' streams by request id (the engine client owns it). ``open`` and
    the end of ``follow`` run on the event loop; ``lookup`` on the thread that receives
    the engine's outputs (a dict read, safe beside them)."""

    def __init__(self) -> None:
        self._streams: dict[str, OutputStream] = {}
        self._generations = itertools.count(1)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._streams

    def all(self) -> list[OutputStream]:
        return list(self._streams.values())

    def open(self, request_id: str) -> OutputStream:
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} is already in use")
        stream = OutputStream(next(self._generations))
        self._streams[request_id] = stream
        return stream

    def lookup(self, request_id: str, generation: int) -> OutputStream | None:
        """The stream of ``request_id`` if it is that use's (``generation``), else None."""
        stream = self._streams.get(request_id)
        if stream is None or stream.generation != generation:
            return None
        return stream

    async def follow(
        self,
        request_id: str,
        start: Callable[[OutputStream], None],
        abort: Callable[[], None],
    ) -> AsyncIterator[RequestOutput]:
        """Open the request's stream, ``start`` it (hand the request to the engine; it may
        raise), then yield its outputs until the request finishes (an error is raised).
        Leaving early (cancel, disconnect) closes the stream and calls ``abort``."""
        stream = self.open(request_id)
        finished = False
        try:
            start(stream)
        except BaseException:
            finished = True  # never reached the engine: nothing to abort
            self._streams.pop(request_id, None)
            raise
        try:
            while True:
                item = await stream.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                abort()
