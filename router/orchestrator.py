"""Run one request across the pools (docs/design.md §1): choose the placement, then stream deltas.

``disaggregated``: Prefill on a prefill instance → the first token goes to the client at
once → Decode (prompt + first token + KvHandle) on a decode instance. With ``n`` > 1 the one
prefill's stored KV serves every choice: choice 0 continues from the prefill's token, the
others load the same KV and sample their own first token with their own seed.
``colocated``: Decode without handle (the decode instance prefills). ``auto``: per request,
whichever the estimator says reaches token 2 sooner.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from pdserve.v1 import pdserve_pb2
from router.decode_leg import decode_deltas
from router.errors import APIError
from router.estimator import Estimate, SideLoad
from router.pool import InstancePool
from router.prefill_leg import PrefillFirst, prefill_events
from router.rpc import LegContext
from router.trace import Delta, Job, Trace

MODES = ("disaggregated", "colocated", "auto")


class Orchestrator:
    """Places and runs requests; one per app."""

    def __init__(self, leg: LegContext, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; choose one of {', '.join(MODES)}")
        self.leg = leg
        self.mode = mode

    @property
    def prefill_pool(self) -> InstancePool:
        return self.leg.prefill_pool

    @property
    def decode_pool(self) -> InstancePool:
        return self.leg.decode_pool

    def check_available(self) -> None:
        """Raise 503 when a pool this mode needs has no healthy instance."""
        if not self.decode_pool.healthy():
            raise APIError(
                503,
                f"no healthy decode instance ({len(self.decode_pool.instances())} known); retry later",
                code="decode_unavailable",
            )
        if self.mode == "disaggregated" and not self.prefill_pool.healthy():
            raise APIError(
                503,
                f"no healthy prefill instance ({len(self.prefill_pool.instances())} known); retry later",
                code="prefill_unavailable",
            )

    def ready(self) -> bool:
        try:
            self.check_available()
        except APIError:
            return False
        return True

    def decide(self, job: Job) -> str:
        """``remote_prefill`` or ``local_prefill`` for this request (counted in metrics)."""
        if self.mode == "disaggregated":
            decision = "remote_prefill"
        elif self.mode == "colocated":
            decision = "local_prefill"
        else:
            decision = self.estimate(job).decision
        self.leg.metrics.disagg_decisions.labels(decision).inc()
        return decision

    def estimate(self, job: Job) -> Estimate:
        """Cost of both placements. Each side is priced on its least loaded healthy instance
        and its best prefix match (what least_load / prefix_aware would pick), without
        calling the policies (round robin would advance)."""
        shape = self.leg.shape
        return self.leg.estimator.estimate(
            prompt_tokens=len(job.prompt_ids),
            block_size=self.leg.block_size,
            kv_bytes_per_token=shape.kv_bytes_per_token(self.leg.kv_dtype),
            prefill=_side(self.prefill_pool, job),
            decode=_side(self.decode_pool, job) or SideLoad(0, 0, 0),
        )

    async def generate(self, job: Job, trace: Trace) -> AsyncIterator[Delta]:
        """Every delta of every choice, in arrival order; raises APIError on failure."""
        trace.decision = self.decide(job)
        if trace.decision == "local_prefill":
            streams = [decode_deltas(self.leg, job, trace, i, [], None) for i in range(job.n)]
            async for delta in merge_streams(streams):
                yield delta
            return
        prefill = prefill_events(self.leg, job, trace)
        handle: pdserve_pb2.KvHandle | None = None
        try:
            first = await anext(prefill)
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
            yield Delta(0, [first.token_id], text, first.logprobs, finish)
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

    def _end_p2p_hold(self, job: Job, trace: Trace) -> None:
        """The request ended early (client gone, decode failed) after a p2p prefill
        committed: ``Abort`` there ends the hold now instead of at the lease's end (a no-op
        when the decode already pulled; docs/design.md §3 "p2p pull protocol")."""
        for inst in self.leg.prefill_pool.instances():
            if inst.url == trace.prefill_instance:
                self.leg.abort_later(inst, job.request_id)


def _side(pool: InstancePool, job: Job) -> SideLoad | None:
    candidates = pool.healthy()
    if not candidates:
        return None
    least = min(candidates, key=lambda inst: (inst.load_score(), inst.url))
    cached = max(
        pool.prefix_index.matched_blocks(inst.url, job.block_hashes) for inst in candidates
    )
    return SideLoad(least.load.waiting, least.load.running, cached)


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
