"""Run one request across the pools (docs/design.md §1): choose the placement, then stream deltas.

``disaggregated``: Prefill on a prefill instance → the first token goes to the client at
once → Decode (prompt + first token + KvHandle) on a decode instance. With ``n`` > 1 the one
prefill's stored KV serves every choice: choice 0 continues from the prefill's token, the
others load the same KV and sample their own first token with their own seed.
``colocated``: Decode without handle (the decode instance prefills). ``auto``: per request,
whichever the estimator says reaches token 2 sooner. In ``disaggregated`` and ``auto`` a
request whose whole prompt a decode instance already holds goes there without a prefill
(decode-first), and so does one it holds all but a short suffix of (``local_suffix``, at
most ``--max-local-prefill-tokens`` to compute; ``router/legs/placement.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from pdserve_api.v1 import pdserve_pb2
from router.errors import APIError
from router.legs.decode import decode_deltas
from router.legs.placement import MODES, Placement
from router.legs.prefill import PrefillFirst, prefill_events
from router.legs.rpc import LegContext
from router.legs.trace import LOCAL_DECISIONS, Delta, Job, Trace
from router.routing.pool import InstancePool

logger = logging.getLogger(__name__)

__all__ = ["MODES", "Orchestrator", "merge_streams"]


class Orchestrator:
    """Places and runs requests; one per app."""

    def __init__(
        self,
        leg: LegContext,
        mode: str,
        *,
        decode_first: bool = True,
        max_local_prefill_tokens: int = 256,
    ) -> None:
        self.placement = Placement(
            leg, mode, decode_first=decode_first, max_local_prefill_tokens=max_local_prefill_tokens
        )
        self.leg = leg
        self.mode = mode

    @property
    def prefill_pool(self) -> InstancePool:
        return self.leg.prefill_pool

    @property
    def decode_pool(self) -> InstancePool:
        return self.leg.decode_pool

    def check_available(self) -> None:
        """Raise 503 only when no instance of either pool is healthy: a decode instance can
        prefill a prompt itself and a prefill instance can serve a whole request, so one
        healthy instance of any pool serves every mode (docs/design.md §5, "Degrade, never
        drop")."""
        if self.decode_pool.healthy() or self.prefill_pool.healthy():
            return
        raise APIError(
            503,
            f"no healthy decode instance ({len(self.decode_pool.instances())} known) and no "
            f"healthy prefill instance ({len(self.prefill_pool.instances())} known); retry later",
            code="decode_unavailable",
        )

    def kv_capacity_blocks(self) -> int:
        """KV blocks of the largest healthy instance that would hold the whole request (a
        decode instance; a prefill one when no decode is healthy); 0 while unknown."""
        instances = self.decode_pool.healthy() or self.prefill_pool.healthy()
        return max((inst.load.total_kv_blocks for inst in instances), default=0)

    def ready(self) -> bool:
        try:
            self.check_available()
        except APIError:
            return False
        return True

    async def generate(self, job: Job, trace: Trace) -> AsyncIterator[Delta]:
        """Every delta of every choice, in arrival order; raises APIError on failure."""
        started = time.perf_counter()
        trace.decision = self.placement.decide(job, trace)
        if trace.spans is not None:
            trace.spans.route(started, trace.decision, trace.placement)
        if trace.decision in LOCAL_DECISIONS:
            async for delta in self._local(job, trace):
                yield delta
            return
        prefill = prefill_events(self.leg, job, trace)
        try:
            first = await anext(prefill)
        except APIError as exc:  # the generator has ended: nothing to close
            if exc.code not in ("prefill_unavailable", "prefill_failed"):
                raise
            # Every prefill instance failed before a token was sent (the only one died, or
            # is restarting): the decode pool computes the prompt itself.
            logger.warning("request %s: %s; prefilling on decode", job.request_id, exc)
            self.leg.metrics.pool_fallbacks.labels("prefill_failed").inc()
            trace.decision = "local_prefill"
            async for delta in self._local(job, trace):
                yield delta
            return
        handle: pdserve_pb2.KvHandle | None = None
        try:
            assert isinstance(first, PrefillFirst)
            finish = (first.finish_reason or "stop") if first.finished else None
            if finish is None and job.max_tokens <= 1:
                finish = "length"
            text = first.text
            # Prefill flushes its text when its one-token request ends, so a first token that
            # is half a UTF-8 character arrives as U+FFFD; the decode instance counts that as
            # shown and would never send the completed character. Hold it back and let the
            # router derive this choice's text from the token ids instead.
            router_text = finish is None and text.endswith("\ufffd")
            if router_text:
                text = text[:-1]
            yield Delta(0, [first.token_id], text, first.logprobs, finish, first.prompt_logprobs)
            if finish is not None and job.n == 1:
                return  # the first token ended it: no decode (closing ``prefill`` cancels it)
            event = await anext(prefill)
            handle = event if isinstance(event, pdserve_pb2.KvHandle) else None
        finally:
            await prefill.aclose()
        streams = []
        if finish is None:
            streams.append(
                decode_deltas(self.leg, job, trace, 0, [first.token_id], handle, text, router_text)
            )
        streams += [decode_deltas(self.leg, job, trace, i, [], handle) for i in range(1, job.n)]
        finished = False
        try:
            async for delta in merge_streams(streams):
                yield delta
            finished = True
        finally:
            if not finished and handle is not None and handle.source_address:
                self._end_p2p_hold(job, trace)

    def _local(self, job: Job, trace: Trace) -> AsyncIterator[Delta]:
        """Every choice in one ``Decode`` call each, the instance computing the prompt."""
        streams = [decode_deltas(self.leg, job, trace, i, [], None) for i in range(job.n)]
        return merge_streams(streams)

    def _end_p2p_hold(self, job: Job, trace: Trace) -> None:
        """The request ended early (client gone, decode failed) after a p2p prefill
        committed: ``Abort`` there ends the hold now instead of at the lease's end (a no-op
        when the decode already pulled; docs/design.md §3 "p2p pull protocol")."""
        for inst in self.leg.prefill_pool.instances():
            if inst.url == trace.prefill_instance:
                self.leg.abort_later(inst, job.request_id)


async def merge_streams(streams: list[AsyncIterator[Delta]]) -> AsyncIterator[Delta]:
    """Interleave several choice streams; the first error cancels the rest and propagates."""
    if len(streams) == 1:
        async for delta in streams[0]:
            yield delta
        return
    queue: asyncio.Queue[Delta | BaseException | None] = asyncio.Queue()

    async def pump(stream: AsyncIterator[Delta]) -> None:
        try:
            async for delta in stream:
                await queue.put(delta)
            await queue.put(None)
        except Exception as exc:
            await queue.put(exc)

    tasks = [asyncio.create_task(pump(s)) for s in streams]
    try:
        open_streams = len(tasks)
        while open_streams:
            item = await queue.get()
            if item is None:
                open_streams -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
