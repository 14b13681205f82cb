"""The prefill leg (docs/design.md §1 steps 2–4): ``Prefill`` on a policy-chosen instance with a
deadline; a failed or timed-out call is retried on another instance (bounded).

:func:`prefill_events` yields the first token once, then the committed ``KvHandle`` — or
None when no instance could commit it after the first token was already sent (decode then
computes the prompt itself, counted in ``pdserve_kv_load_fallbacks_total``). A failed KV
save (the store is down; the trailer ``pdserve-error: kv-save-failed``) is not the
instance's fault: it is neither taken out nor retried elsewhere, and decode computes the
prompt (``reason="save_failed"``). A call on an instance that the health checks take out
(a paused or hung prefill) is cancelled at once by a :class:`StreamWatch` and retried like
a failed one, instead of waiting for its deadline. When the
consumer leaves early (client gone, or the first token ended the request) the call is
cancelled, which aborts the request there; ``Abort`` is sent only after a stall (a hung
instance may miss the cancellation; router/legs/decode.py says why).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import grpc

from pdserve_api.v1 import pdserve_pb2
from router.errors import APIError
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
from router.legs.trace import Job, TokenLogprob, Trace
from router.legs.transfer import note_save
from router.routing.policies import RouteContext

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PrefillFirst:
    token_id: int
    text: str
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str
    prompt_logprobs: list[TokenLogprob] | None = None


async def prefill_events(
    leg: LegContext, job: Job, trace: Trace
) -> AsyncGenerator[PrefillFirst | pdserve_pb2.KvHandle | None, None]:
    """Yield the first token (once), then the KvHandle, or None if it could not be committed."""
    ctx = RouteContext(job.block_hashes, job.user, job.lora_name)
    request = pdserve_pb2.PrefillRequest(
        request_id=job.request_id,
        prompt_token_ids=job.prompt_ids,
        params=sampling_proto(job, 0),
        lora_name=job.lora_name or "",
    )
    tried: set[str] = set()
    first_sent = False
    last_error = "no attempt"
    for attempt in range(leg.prefill_retries + 1):
        inst = leg.prefill_pool.select(ctx, exclude=tried)
        if inst is None:
            break
        if attempt:
            leg.metrics.prefill_retries.inc()
        tried.add(inst.url)
        trace.prefill_instance = inst.url
        route = trace.note_route("prefill", inst.url, ctx.note, len(job.block_hashes))
        span, metadata = _call_span(trace, job, route, attempt, inst.auth.metadata("Prefill"))
        call = inst.stub.Prefill(
            request, timeout=deadline_for(job, leg.prefill_timeout), metadata=metadata
        )
        done = False
        error: str | None = "cancelled"  # unless the call commits or fails
        inst.inflight += 1
        try:
            # Health-only watch: its idle clock is the call's own deadline (a long prompt
            # may take that long to its first token); ``held`` while the consumer works.
            async with StreamWatch(call, inst, leg.prefill_timeout) as watch:
                try:
                    async for event in call:
                        _record_prefill_timings(leg, job, trace, event)
                        if event.HasField("first_token") and not first_sent:
                            first_sent = True
                            ft = event.first_token
                            trace.cached_tokens = ft.num_cached_tokens
                            trace.prompt_cached = (trace.prompt_cached or 0) + ft.num_cached_tokens
                            lps = logprobs_of([ft.logprob]) if ft.HasField("logprob") else None
                            watch.held = True
                            yield PrefillFirst(
                                ft.token_id,
                                ft.text,
                                lps,
                                ft.finished,
                                ft.finish_reason,
                                logprobs_of(ft.prompt_logprobs) or None,
                            )
                            watch.held = False
                        elif event.HasField("kv_committed"):
                            done = True
                            error = None
                            yield event.kv_committed
                            return
                except asyncio.CancelledError:
                    reason = watch.broken()
                    if reason is None:
                        raise  # the consumer itself is cancelled (client gone)
                    if watch.kind:
                        # A paused instance that comes back must not keep the request running.
                        leg.abort_later(inst, job.request_id)
                    raise StreamBroken(reason) from None
            raise StreamBroken("prefill stream ended before the KV was committed")
        except (grpc.aio.AioRpcError, StreamBroken) as exc:
            done = True
            error = describe(exc)
            fatal = (
                fatal_error(exc, f"prefill instance {inst.url}")
                if isinstance(exc, grpc.aio.AioRpcError)
                else None
            )
            if fatal is not None:
                raise fatal from exc
            if first_sent and _save_failed(exc):
                # The store is down, not this instance: keep it in, retrying the prompt
                # elsewhere would fail the same save. Decode computes the prompt itself.
                logger.warning("prefill %s: KV save failed (%s)", job.request_id, describe(exc))
                leg.metrics.kv_load_fallbacks.labels("save_failed").inc()
                yield None
                return
            last_error = describe(exc)
            logger.warning(
                "prefill %s on %s failed (%s); attempt %d",
                job.request_id,
                inst.url,
                last_error,
                attempt + 1,
            )
            if not busy(exc):  # a full instance is healthy: it stays in rotation
                leg.prefill_pool.mark_failed(inst, last_error)
        finally:
            inst.inflight -= 1
            if not done:  # consumer left (client gone, or the first token ended the request)
                call.cancel()  # the instance sees the cancellation and aborts the request
            if span is not None and trace.spans is not None:
                # Leaving after the first token (it ended the request) is no error.
                quiet = error == "cancelled" and first_sent
                trace.spans.end_call(span, None if quiet else error)
    if not first_sent:
        raise _exhausted(len(tried), last_error)
    leg.metrics.kv_load_fallbacks.labels("prefill_lost").inc()
    yield None


def _call_span(
    trace: Trace, job: Job, route: dict[str, Any], attempt: int, metadata: Any
) -> tuple[Any, Any]:
    """The attempt's CLIENT span and the call's metadata with its trace context (tracing
    off: no span, the instance's own metadata)."""
    if trace.spans is None:
        return None, metadata
    span = trace.spans.call(
        "prefill",
        job.request_id,
        route,
        **{"pdserve.attempt": attempt, "gen_ai.usage.input_tokens": len(job.prompt_ids)},
    )
    return span, trace.spans.call_metadata(span, tuple(metadata or ()))


def _save_failed(exc: BaseException) -> bool:
    """The prefill stream ended because its KV save failed (the prefill service's
    ``KVSaveFailed``: UNAVAILABLE with the trailer ``pdserve-error: kv-save-failed``)."""
    if not isinstance(exc, grpc.aio.AioRpcError) or exc.code() != grpc.StatusCode.UNAVAILABLE:
        return False
    trailers = exc.trailing_metadata() or ()
    return any(k == "pdserve-error" and v == "kv-save-failed" for k, v in trailers)


def _exhausted(attempts: int, last_error: str) -> APIError:
    if not attempts:
        return APIError(
            503, "no healthy prefill instance is available; retry later", code="prefill_unavailable"
        )
    return APIError(
        503,
        f"prefill failed on {attempts} instance(s); last error: {last_error}",
        code="prefill_failed",
    )


def _record_prefill_timings(leg: LegContext, job: Job, trace: Trace, event: Any) -> None:
    if not event.HasField("timings"):
        return
    t = event.timings
    if event.HasField("first_token"):
        trace.phase("prefill_queue", t.queue_s)
        trace.phase("prefill_compute", t.compute_s)
        computed = len(job.prompt_ids) - event.first_token.num_cached_tokens
        leg.estimator.observe_prefill(computed, t.compute_s)
    if event.HasField("kv_committed"):
        trace.phase("kv_save", t.kv_save_s)
        note_save(leg, trace, event.kv_committed, t.kv_save_s)
