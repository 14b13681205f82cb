"""The decode leg (docs/design.md §1 steps 5–7): one ``Decode`` stream per choice, with failover.

When the decode instance is lost mid-stream (stream error, or the stream ends without its
final chunk) the choice resumes on another instance with the prompt and every token
received so far as ``generated_token_ids``; so does a stream whose instance hangs
(``router.legs.stream_watch``: health checks get no answer, or no chunk for
``--stream-idle-timeout``); the KvHandle stays valid and the engine's
per-position seeded sampler draws exactly what the lost instance would have, so the client
sees each token exactly once. When the consumer leaves (client disconnect) the call is
cancelled, which aborts the request there; an ``Abort`` RPC follows only for a stream the
watch gave up on (a hung instance may miss the cancellation). One RPC per cancelled stream
made an abort storm twice as many calls for the instance as the streams themselves.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdserve_api.v1 import pdserve_pb2
from router.errors import APIError
from router.legs.resume_text import ResumedText
from router.legs.rpc import (
    LegContext,
    StreamBroken,
    busy,
    deadline_for,
    describe,
    fatal_error,
    logprobs_of,
    sampling_proto,
)
from router.legs.stream_watch import StreamWatch
from router.legs.trace import Delta, Job, Trace
from router.legs.transfer import note_load
from router.routing.policies import RouteContext
from router.routing.pool import Instance

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Choice:
    """What one choice has produced so far; what a resumed stream starts from."""

    leg: LegContext
    job: Job
    trace: Trace
    index: int
    tokens: list[int]  # every token of this choice so far (sent on resume)
    handle: pdserve_pb2.KvHandle | None
    emitted: str  # every character the client has seen of this choice
    resumed: ResumedText | None = None  # router-side text, from the first failover on
    tried: set[str] = field(default_factory=set)
    busy: set[str] = field(default_factory=set)  # instances that answered RESOURCE_EXHAUSTED
    busy_error: str = ""
    failovers: int = 0
    first_chunk: bool = True
    call_started: float = 0.0  # perf_counter when the current Decode call began

    def request(self, rid: str) -> pdserve_pb2.DecodeRequest:
        return pdserve_pb2.DecodeRequest(
            request_id=rid,
            prompt_token_ids=self.job.prompt_ids,
            generated_token_ids=self.tokens,
            params=sampling_proto(self.job, self.index),
            kv_handle=self.handle,
            lora_name=self.job.lora_name or "",
        )

    def start_router_text(self) -> None:
        """From now on, text comes from the token ids (see ``router.legs.resume_text``)."""
        if self.resumed is None:
            params = self.job.params
            self.resumed = ResumedText(
                self.leg.processor,
                params.stop,
                params.skip_special_tokens,
                self.emitted,
                list(self.tokens),
                params.include_stop_str_in_output,
            )

    def on_chunk(self, chunk: Any) -> Delta | None:
        if self.first_chunk:
            self.first_chunk = False
            if self.index == 0:  # phases are per request: choice 0's first stream stands for them
                _record_decode_start(self.leg, self.trace, chunk, self.handle, self.call_started)
                if self.handle is None and not self.tokens:
                    # This instance computes the prompt (no handoff): its cache hit says
                    # how much of it (a local path's ``prompt_tokens_computed``; summed
                    # over a request's prompts, once each: choice 0's first stream).
                    cached = self.trace.prompt_cached or 0
                    self.trace.prompt_cached = cached + chunk.num_cached_tokens
        self.tokens.extend(chunk.token_ids)
        delta = _delta(self.job, self.trace, self.index, chunk, self.resumed)
        if delta is not None:
            self.emitted += delta.text
        return delta

    def on_failure(self, exc: BaseException, inst: Instance, rid: str) -> None:
        """Prepare to resume elsewhere, or raise the client-facing error."""
        leg = self.leg
        if _refused_handle(exc, self.handle):
            # Incompatible handle: compute the prompt locally rather than fail the request.
            leg.metrics.kv_load_fallbacks.labels("handle_refused").inc()
            logger.warning(
                "decode %s refused the KV handle (%s); recomputing", inst.url, describe(exc)
            )
            self.handle = None
            return
        self.failovers += 1
        _check_resumable(leg, self.job, exc, inst, self.failovers)
        if busy(exc):  # healthy but full: another instance may take it, this one stays in
            self.busy.add(inst.url)
            self.busy_error = describe(exc)
        else:
            (leg.decode_pool if inst.pool == "decode" else leg.prefill_pool).mark_failed(
                inst, describe(exc)
            )
        self.tried.add(inst.url)
        self.start_router_text()
        leg.metrics.decode_failovers.inc()
        logger.warning(
            "decode %s lost on %s (%s); resuming with %d tokens",
            rid,
            inst.url,
            describe(exc),
            len(self.tokens),
        )


async def decode_deltas(
    leg: LegContext,
    job: Job,
    trace: Trace,
    index: int,
    generated: list[int],
    handle: pdserve_pb2.KvHandle | None,
    initial_text: str = "",
    router_text: bool = False,
) -> AsyncIterator[Delta]:
    """Stream choice ``index`` from decode, failing over to another instance when one is lost.

    ``generated`` are tokens the client already has (the prefill's first token), whose text
    was ``initial_text``. ``router_text``: derive the text from token ids from the start
    (otherwise only after a failover).
    """
    ctx = RouteContext(job.block_hashes, job.user, job.lora_name, pin=job.decode_pin)
    choice = _Choice(leg, job, trace, index, list(generated), handle, initial_text)
    if router_text:
        choice.start_router_text()
    while True:
        if choice.failovers and len(choice.tokens) >= job.max_tokens:
            # Every token arrived before the instance was lost (only the final chunk did
            # not): the choice is complete, and resuming would ask for more than max_tokens.
            text = choice.resumed.feed([], True)[0] if choice.resumed is not None else ""
            yield Delta(index, [], text, None, "length")
            return
        picked = _pick_instance(choice, ctx)
        if picked is None and choice.busy:
            raise APIError(
                503,
                f"every instance able to serve this request is busy ({choice.busy_error}); "
                "retry later",
                code="instances_busy",
            )
        if picked is None:
            raise APIError(
                503,
                "no healthy decode or prefill instance is available; retry later",
                code="decode_unavailable",
            )
        inst, stub = picked
        trace.decode_instances.append(inst.url)
        route = trace.note_route(inst.pool, inst.url, ctx.note, len(job.block_hashes))
        rid = f"{job.request_id}-{index}" + (f"-r{choice.failovers}" if choice.failovers else "")
        span, metadata = _call_span(choice, rid, route, inst.auth.metadata("Decode"))
        choice.call_started = time.perf_counter()
        call = stub.Decode(choice.request(rid), timeout=deadline_for(job), metadata=metadata)
        done = stalled = False
        error: str | None = "cancelled"  # unless the stream finishes or fails
        inst.inflight += 1
        try:
            async with StreamWatch(call, inst, leg.stream_idle_timeout) as watch:
                try:
                    async for chunk in call:
                        watch.touch()
                        delta = choice.on_chunk(chunk)
                        if delta is not None:
                            watch.held = True  # a slow client is not a hung instance
                            yield delta
                            watch.held = False
                            watch.touch()
                        if chunk.finished or (delta is not None and delta.finish_reason):
                            done = chunk.finished  # else we stop it (router-side stop)
                            error = None
                            return
                except asyncio.CancelledError:
                    reason = watch.broken()
                    if reason is None:
                        raise  # the reader itself is cancelled (client gone)
                    if watch.kind:
                        # Hung instance: resume elsewhere; ``done`` stays False so Abort is
                        # sent (a paused instance that comes back must not keep generating).
                        stalled = True
                        leg.metrics.decode_stalls.labels(watch.kind).inc()
                    else:
                        done = True  # its channel is closed: nothing left to cancel there
                    error = reason
                    choice.on_failure(StreamBroken(reason), inst, rid)
                    continue
            raise StreamBroken("decode stream ended without a final chunk")
        except (grpc.aio.AioRpcError, StreamBroken) as exc:
            done = True
            error = describe(exc)
            choice.on_failure(exc, inst, rid)
        finally:
            inst.inflight -= 1
            if span is not None and trace.spans is not None:
                trace.spans.end_call(span, error, **{"pdserve.tokens": len(choice.tokens)})
            if not done:
                call.cancel()  # the instance sees the cancellation and aborts the request
                if stalled:  # a hung instance may not: tell it again once it answers
                    leg.abort_later(inst, rid)


def _pick_instance(choice: _Choice, ctx: RouteContext) -> tuple[Instance, Any] | None:
    """The instance (and its DecodeService stub) for the choice's next ``Decode`` call: a
    decode instance not tried yet, else a tried one that is healthy again, else — no decode
    instance is healthy — a prefill instance, which serves the whole choice itself (docs/
    design.md §5, "Degrade, never drop"; counted as ``no_decode``)."""
    for pool in (choice.leg.decode_pool, choice.leg.prefill_pool):
        inst = pool.select(ctx, exclude=choice.tried) or (
            pool.select(ctx, exclude=choice.busy) if choice.tried else None
        )
        if inst is None:
            continue
        if inst.pool == "decode":
            return inst, inst.stub
        choice.leg.metrics.pool_fallbacks.labels("no_decode").inc()
        # Its own prefix cache likely holds the prompt; a handle would make it pull from
        # itself (p2p) or the store for nothing.
        choice.handle = None
        return inst, inst.decode_stub
    return None


def _delta(
    job: Job, trace: Trace, index: int, chunk: Any, resumed: ResumedText | None
) -> Delta | None:
    """The client-facing delta of one chunk (None for an empty, unfinished chunk)."""
    if chunk.num_cached_tokens and not trace.cached_tokens:
        trace.cached_tokens = chunk.num_cached_tokens
    text, finished = chunk.text, chunk.finished
    finish = (chunk.finish_reason or "stop") if finished else None
    if resumed is not None:
        text, stopped = resumed.feed(list(chunk.token_ids), finished)
        if stopped:
            finish = "stop"
    if not (chunk.token_ids or text or finish):
        return None
    lps = logprobs_of(chunk.logprobs) if job.params.logprobs is not None else None
    prompt_lps = logprobs_of(chunk.prompt_logprobs) or None  # colocated: this decode's own
    return Delta(index, list(chunk.token_ids), text, lps, finish, prompt_lps)


def _refused_handle(exc: BaseException, handle: pdserve_pb2.KvHandle | None) -> bool:
    return (
        handle is not None
        and isinstance(exc, grpc.aio.AioRpcError)
        and exc.code() == grpc.StatusCode.FAILED_PRECONDITION
    )


def _check_resumable(
    leg: LegContext, job: Job, exc: BaseException, inst: Instance, failovers: int
) -> None:
    """Raise the client-facing error unless the stream may resume elsewhere."""
    if isinstance(exc, grpc.aio.AioRpcError):
        fatal = fatal_error(exc, f"decode instance {inst.url}")
        if fatal is not None:
            raise fatal from exc
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and job.remaining() <= 0:
            raise APIError(504, "request timed out during decode", code="timeout") from exc
    if failovers > leg.decode_failovers:
        raise APIError(
            503,
            f"decode failed on {failovers} instance(s); last error: {describe(exc)}",
            code="decode_failed",
        ) from exc


def _call_span(choice: _Choice, rid: str, route: dict[str, Any], metadata: Any) -> tuple[Any, Any]:
    """The call's CLIENT span (a resumed stream's carries ``pdserve.failover``) and its
    metadata with the trace context; tracing off: no span, the instance's metadata."""
    spans = choice.trace.spans
    if spans is None:
        return None, metadata
    span = spans.call(
        "decode",
        rid,
        route,
        **{
            "pdserve.choice": choice.index,
            "pdserve.failover": choice.failovers,
            "pdserve.resumed_tokens": len(choice.tokens),
            "pdserve.kv_handle": choice.handle is not None,
        },
    )
    return span, spans.call_metadata(span, tuple(metadata or ()))


def _record_decode_start(
    leg: LegContext, trace: Trace, chunk: Any, handle: Any, call_started: float
) -> None:
    if not chunk.HasField("timings"):
        return
    t = chunk.timings
    trace.phase("decode_queue", t.queue_s)
    trace.phase("kv_load", t.kv_load_s)
    if handle is not None:
        note_load(leg, trace, handle, t, call_started)
