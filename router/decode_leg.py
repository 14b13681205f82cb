"""The decode leg (DESIGN §1 steps 5–7): one ``Decode`` stream per choice, with failover.

When the decode instance is lost mid-stream (stream error, or the stream ends without its
final chunk) the choice resumes on another instance with the prompt and every token
received so far as ``generated_token_ids``; the KvHandle stays valid and the engine's
per-position seeded sampler draws exactly what the lost instance would have, so the client
sees each token exactly once. When the consumer leaves (client disconnect) the call is
cancelled and ``Abort`` sent.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc

from pdserve.v1 import pdserve_pb2
from router.errors import APIError
from router.policies import RouteContext
from router.pool import Instance
from router.resume_text import ResumedText
from router.rpc import (
    LegContext,
    StreamBroken,
    deadline_for,
    describe,
    fatal_error,
    logprobs_of,
    sampling_proto,
)
from router.trace import Delta, Job, Trace

logger = logging.getLogger(__name__)


async def decode_deltas(
    leg: LegContext,
    job: Job,
    trace: Trace,
    index: int,
    generated: list[int],
    handle: pdserve_pb2.KvHandle | None,
    initial_text: str = "",
) -> AsyncIterator[Delta]:
    """Stream choice ``index`` from decode, failing over to another instance when one is lost.

    ``generated`` are tokens the client already has (the prefill's first token), whose text
    was ``initial_text``.
    """
    ctx = RouteContext(job.block_hashes, job.user)
    tokens = list(generated)  # everything this choice produced so far (sent on resume)
    emitted = initial_text  # everything the client has seen of this choice
    resumed: ResumedText | None = None  # router-side text, from the first failover on
    tried: set[str] = set()
    failovers = 0
    first_chunk = True
    while True:
        inst = leg.decode_pool.select(ctx, exclude=tried) or (
            leg.decode_pool.select(ctx) if tried else None
        )
        if inst is None:
            raise APIError(
                503,
                "no healthy decode instance is available; retry later",
                code="decode_unavailable",
            )
        trace.decode_instances.append(inst.url)
        rid = f"{job.request_id}-{index}" + (f"-r{failovers}" if failovers else "")
        request = pdserve_pb2.DecodeRequest(
            request_id=rid,
            prompt_token_ids=job.prompt_ids,
            generated_token_ids=tokens,
            params=sampling_proto(job, index),
            kv_handle=handle,
        )
        call = inst.stub.Decode(request, timeout=deadline_for(job))
        done = False
        inst.inflight += 1
        try:
            async for chunk in call:
                if first_chunk:
                    first_chunk = False
                    # Phases are per request: choice 0's first stream stands for them.
                    if index == 0:
                        _record_decode_start(leg, trace, chunk, handle)
                tokens.extend(chunk.token_ids)
                delta = _delta(job, trace, index, chunk, resumed)
                if delta is not None:
                    emitted += delta.text
                    yield delta
                if chunk.finished or (delta is not None and delta.finish_reason):
                    done = chunk.finished  # else we stop it (router-side stop): cancel + Abort
                    return
            raise StreamBroken("decode stream ended without a final chunk")
        except (grpc.aio.AioRpcError, StreamBroken) as exc:
            done = True
            if _refused_handle(exc, handle):
                # Incompatible handle: compute the prompt locally rather than fail the request.
                leg.metrics.kv_load_fallbacks.labels("handle_refused").inc()
                logger.warning(
                    "decode %s refused the KV handle (%s); recomputing", inst.url, describe(exc)
                )
                handle = None
                continue
            failovers += 1
            _check_resumable(leg, job, exc, inst, failovers)
            leg.decode_pool.mark_failed(inst, describe(exc))
            tried.add(inst.url)
            resumed = ResumedText(
                leg.processor,
                job.params.stop,
                job.params.skip_special_tokens,
                emitted,
                list(tokens),
            )
            leg.metrics.decode_failovers.inc()
            logger.warning(
                "decode %s lost on %s (%s); resuming with %d tokens",
                rid,
                inst.url,
                describe(exc),
                len(tokens),
            )
        finally:
            inst.inflight -= 1
            if not done:
                call.cancel()
                leg.abort_later(inst, rid)


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
    return Delta(index, list(chunk.token_ids), text, lps, finish)


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


def _record_decode_start(leg: LegContext, trace: Trace, chunk: Any, handle: Any) -> None:
    if not chunk.HasField("timings"):
        return
    t = chunk.timings
    trace.phase("decode_queue", t.queue_s)
    trace.phase("kv_load", t.kv_load_s)
    if handle is None:
        return
    if t.kv_blocks_recomputed:
        leg.metrics.kv_load_fallbacks.labels("recompute").inc()
    tokens = min(handle.num_tokens, t.kv_blocks_loaded * max(handle.block_size, 1))
    nbytes = tokens * leg.shape.kv_bytes_per_token(handle.dtype)
    if nbytes:
        leg.metrics.kv_bytes.labels(handle.connector or "unknown", "load").inc(nbytes)
        leg.estimator.observe_transfer(nbytes, t.kv_load_s)
