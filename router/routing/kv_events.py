"""One subscriber per instance to its KV events (``SubscribeKvEvents``), feeding the pool's
:class:`~router.routing.kv_index.KvBlockIndex` (docs/design.md §5, "KV events and the global block
index").

The stream's rules (proto/pdserve/v1/pdserve.proto): the first batch of a subscription is a
snapshot; within one ``instance_epoch`` ``seq`` grows by exactly 1 per batch. So:

- a first batch that is no snapshot, a skipped or repeated ``seq``, or an epoch that
  changes without a snapshot is a gap: counted, the call cancelled and a new subscription
  opened at once (its snapshot resynchronises the index); so is ``RESOURCE_EXHAUSTED``,
  the engine cutting off a subscriber that fell ``--kv-events-max-queue`` batches behind;
- a stream that ends or fails drops the instance's entries (routing falls back to the
  guessing index for it) and reconnects with backoff;
- ``UNIMPLEMENTED`` (an engine older than the events) also drops them, and the instance is
  asked again only every ``unsupported_retry_s`` (it may be upgraded in place).

The index holds an instance's entries only while its stream is ``live``: one owner (this
subscriber) decides when the index speaks for the instance.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import grpc

from pdserve_api.v1 import pdserve_pb2
from router.metrics import RouterMetrics
from router.routing.kv_index import KvBlockIndex
from router.routing.service_auth import ServiceIdentity

logger = logging.getLogger(__name__)


class _Gap(Exception):
    pass


class KvEventSubscriber:
    """Keeps ``index`` in step with one instance's event stream; ``run`` until cancelled."""

    def __init__(
        self,
        url: str,
        pool: str,
        stub: Any,
        index: KvBlockIndex,
        *,
        auth: ServiceIdentity | None = None,
        metrics: RouterMetrics | None = None,
        backoff_s: tuple[float, float] = (0.2, 2.0),
        unsupported_retry_s: float = 60.0,
    ) -> None:
        self.url = url
        self.pool = pool
        self.stub = stub
        self.index = index
        self.auth = auth or ServiceIdentity()
        self.metrics = metrics
        self.backoff_s = backoff_s
        self.unsupported_retry_s = unsupported_retry_s
        self.live = False  # the index speaks for this instance now
        self.unsupported = False  # the engine answered UNIMPLEMENTED
        self.epoch = ""
        self.seq = 0
        self.last_batch_at: float | None = None  # time.monotonic() of the last batch applied
        self.batches = 0
        self.resyncs = 0
        self.gaps = 0

    def lag_s(self) -> float:
        """Seconds since the last batch arrived (inf before the first). Engines publish
        only on change, so an idle instance's lag grows without anything being missed;
        missed batches show as gaps."""
        if self.last_batch_at is None:
            return float("inf")
        return time.monotonic() - self.last_batch_at

    async def run(self) -> None:
        delay = self.backoff_s[0]
        while True:
            try:
                await self._subscribe_once()
                reason = "stream ended"
            except _Gap as gap:
                self._down()
                logger.info("kv events %s: %s; resubscribing", self.url, gap)
                delay = self.backoff_s[0]
                continue  # at once: the new subscription's snapshot resynchronises
            except grpc.aio.AioRpcError as exc:
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    # The engine cut us off: we fell --kv-events-max-queue batches behind.
                    # Batches were missed, as in a gap: resubscribe at once for a snapshot.
                    self.gaps += 1
                    self._count("gaps")
                    self._down()
                    logger.info(
                        "kv events %s: fell behind (%s); resubscribing", self.url, exc.details()
                    )
                    continue
                if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                    if not self.unsupported:
                        logger.info(
                            "kv events %s: not served by this engine; guessing its cache",
                            self.url,
                        )
                    self.unsupported = True
                    self._down()
                    await asyncio.sleep(self.unsupported_retry_s)
                    continue
                reason = f"{exc.code().name}: {exc.details()}"
            self.unsupported = False
            if self.live:  # it was serving: the next try comes soon again
                logger.info("kv events %s: %s; reconnecting", self.url, reason)
                delay = self.backoff_s[0]
            self._down()
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.backoff_s[1])

    async def _subscribe_once(self) -> None:
        call = self.stub.SubscribeKvEvents(
            pdserve_pb2.KvEventsRequest(), metadata=self.auth.metadata("SubscribeKvEvents")
        )
        first = True
        try:
            async for batch in call:
                self._check_order(batch, first)
                first = False
                self.unsupported = False
                self.index.apply(self.url, batch)
                self.epoch, self.seq = batch.instance_epoch, batch.seq
                self.live = True
                self.last_batch_at = time.monotonic()
                self.batches += 1
                if batch.snapshot:
                    self.resyncs += 1
                    self._count("resyncs")
                self._count("batches")
        finally:
            call.cancel()

    def _check_order(self, batch: pdserve_pb2.KvEventBatch, first: bool) -> None:
        if batch.snapshot:
            return  # a snapshot stands alone: whatever came before is replaced
        problem = ""
        if first:
            problem = "the subscription did not start with a snapshot"
        elif batch.instance_epoch != self.epoch:
            problem = f"epoch changed to {batch.instance_epoch!r} without a snapshot"
        elif batch.seq != self.seq + 1:
            problem = f"seq {batch.seq} after {self.seq}"
        if problem:
            self.gaps += 1
            self._count("gaps")
            raise _Gap(problem)

    def _down(self) -> None:
        self.live = False
        self.index.forget(self.url)

    def _count(self, what: str) -> None:
        if self.metrics is not None:
            self.metrics.kv_index_counter(what, self.pool)


class KvEventFeeds:
    """The subscribers of one pool, started and stopped as instances come and go."""

    def __init__(self, pool: str, index: KvBlockIndex, metrics: RouterMetrics | None) -> None:
        self.pool = pool
        self.index = index
        self.metrics = metrics
        self.subscribers: dict[str, KvEventSubscriber] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._dropped_seen = 0

    def add(self, url: str, stub: Any, auth: ServiceIdentity) -> None:
        sub = KvEventSubscriber(url, self.pool, stub, self.index, auth=auth, metrics=self.metrics)
        self.subscribers[url] = sub
        self._tasks[url] = asyncio.get_running_loop().create_task(
            sub.run(), name=f"kv-events-{self.pool}-{url}"
        )

    async def remove(self, url: str) -> None:
        self.subscribers.pop(url, None)
        task = self._tasks.pop(url, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(task, 2.0)
        self.index.forget(url)

    def live(self, url: str) -> bool:
        sub = self.subscribers.get(url)
        return sub is not None and sub.live

    def publish_gauges(self) -> None:
        """Index size and per-instance lag into the metrics (the pool's health round)."""
        if self.metrics is None:
            return
        self.metrics.set_kv_index(self.pool, self.index.blocks, self.index.entries)
        if self.index.dropped > self._dropped_seen:
            self.metrics.kv_index_counter(
                "dropped", self.pool, self.index.dropped - self._dropped_seen
            )
            self._dropped_seen = self.index.dropped
        for url, sub in self.subscribers.items():
            self.metrics.set_kv_feed(self.pool, url, live=sub.live, lag_s=sub.lag_s())
