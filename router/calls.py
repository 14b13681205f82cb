"""The two gRPC legs of a request, each with its failure rule (DESIGN §1).

* :func:`prefill_events` — ``Prefill`` on a policy-chosen instance with a deadline; a failed
  or timed-out call is retried on another instance (bounded). Yields the first token once,
  then the committed ``KvHandle`` (or None when no instance could commit it after the first
  token was already sent: decode then computes the prompt itself).
* :func:`decode_deltas` — ``Decode`` stream for one choice; when the instance is lost
  mid-stream the request resumes on another instance with prompt + every token received so
  far, so the client sees each token exactly once.

Both cancel their call and send ``Abort`` when the consumer goes away (client disconnect).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdserve.v1 import pdserve_pb2
from router.errors import APIError
from router.estimator import AutoEstimator
from router.metrics import RouterMetrics
from router.policies import RouteContext
from router.pool import Instance, InstancePool
from router.tokenizer import ModelShape
from router.trace import Delta, Job, TokenLogprob, Trace

logger = logging.getLogger(__name__)

# Errors that say "this instance cannot serve now": try another one.
_RETRYABLE = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.CANCELLED,  # only reaches us when the server side cancelled
    grpc.StatusCode.ABORTED,
}


class StreamBroken(Exception):
    """A stream ended without its final message (the server went away cleanly)."""


@dataclass(slots=True)
class LegContext:
    """What both legs share: pools, metrics, limits, and a place for background aborts."""

    prefill_pool: InstancePool
    decode_pool: InstancePool
    metrics: RouterMetrics
    prefill_timeout: float
    prefill_retries: int
    decode_failovers: int
    shape: ModelShape
    estimator: AutoEstimator = field(default_factory=AutoEstimator)
    abort_timeout: float = 2.0
    background: set[asyncio.Task[Any]] = field(default_factory=set)

    def abort_later(self, inst: Instance, request_id: str) -> None:
        """Send Abort in a task of its own: the caller is usually being cancelled, and an
        await inside a cancelled scope would never run."""
        task = asyncio.get_running_loop().create_task(_abort(inst, request_id, self.abort_timeout))
        self.background.add(task)
        task.add_done_callback(self.background.discard)


async def _abort(inst: Instance, request_id: str, timeout: float) -> None:
    try:
        await inst.stub.Abort(pdserve_pb2.AbortRequest(request_id=request_id), timeout=timeout)
    except grpc.RpcError as exc:
        logger.debug("abort %s on %s failed: %s", request_id, inst.url, exc)


def sampling_proto(job: Job, index: int) -> pdserve_pb2.SamplingParams:
    p = job.params
    return pdserve_pb2.SamplingParams(
        max_tokens=job.max_tokens,
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        seed=p.choice_seed(index),
        stop=p.stop,
        stop_token_ids=p.stop_token_ids,
        ignore_eos=p.ignore_eos,
        presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty,
        repetition_penalty=p.repetition_penalty,
        logprobs=p.logprobs or 0,
        return_logprobs=p.logprobs is not None,
        skip_special_tokens=p.skip_special_tokens,
    )


def logprobs_of(items: Any) -> list[TokenLogprob]:
    return [
        TokenLogprob(
            lp.token_id, lp.logprob, list(zip(lp.top_token_ids, lp.top_logprobs, strict=False))
        )
        for lp in items
    ]


def _deadline(job: Job, cap: float | None = None) -> float:
    remaining = job.remaining()
    if remaining <= 0:
        raise APIError(504, "request timed out", code="timeout")
    return remaining if cap is None else min(cap, remaining)


def _fatal(exc: grpc.aio.AioRpcError, what: str) -> APIError | None:
    """The client-facing error for a non-retryable status, or None when it is retryable."""
    code = exc.code()
    if code in _RETRYABLE:
        return None
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return APIError(400, f"{what} rejected the request: {exc.details()}", code="invalid_value")
    return APIError(500, f"{what} failed: {code.name}: {exc.details()}", code="upstream_error")


@dataclass(slots=True)
class PrefillFirst:
    token_id: int
    text: str
    logprobs: list[TokenLogprob] | None
    finished: bool
    finish_reason: str


async def prefill_events(
    leg: LegContext, job: Job, trace: Trace
) -> AsyncIterator[PrefillFirst | pdserve_pb2.KvHandle | None]:
    """Yield the first token (once), then the KvHandle, or None if it could not be committed."""
    ctx = RouteContext(job.block_hashes, job.user)
    request = pdserve_pb2.PrefillRequest(
        request_id=job.request_id, prompt_token_ids=job.prompt_ids, params=sampling_proto(job, 0)
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
        call = inst.stub.Prefill(request, timeout=_deadline(job, leg.prefill_timeout))
        done = False
        inst.inflight += 1
        try:
            async for event in call:
                _record_prefill_timings(leg, job, trace, event)
                if event.HasField("first_token") and not first_sent:
                    first_sent = True
                    ft = event.first_token
                    trace.cached_tokens = ft.num_cached_tokens
                    lps = logprobs_of([ft.logprob]) if ft.HasField("logprob") else None
                    yield PrefillFirst(ft.token_id, ft.text, lps, ft.finished, ft.finish_reason)
                elif event.HasField("kv_committed"):
                    done = True
                    yield event.kv_committed
                    return
            raise StreamBroken("prefill stream ended before the KV was committed")
        except (grpc.aio.AioRpcError, StreamBroken) as exc:
            if isinstance(exc, grpc.aio.AioRpcError):
                fatal = _fatal(exc, f"prefill instance {inst.url}")
                if fatal is not None:
                    done = True
                    raise fatal from exc
                last_error = f"{exc.code().name}: {exc.details()}"
            else:
                last_error = str(exc)
            logger.warning(
                "prefill %s on %s failed (%s); attempt %d",
                job.request_id,
                inst.url,
                last_error,
                attempt + 1,
            )
            leg.prefill_pool.mark_failed(inst, last_error)
            done = True
        finally:
            inst.inflight -= 1
            if not done:  # consumer left (client gone, or the first token ended the request)
                call.cancel()
                leg.abort_later(inst, job.request_id)
    if not first_sent:
        if not tried:
            raise APIError(
                503,
                "no healthy prefill instance is available; retry later",
                code="prefill_unavailable",
            )
        raise APIError(
            503,
            f"prefill failed on {len(tried)} instance(s); last error: {last_error}",
            code="prefill_failed",
        )
    leg.metrics.kv_load_fallbacks.labels("prefill_lost").inc()
    yield None


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
        handle = event.kv_committed
        # Upper bound: the prefill skips blocks the store already held.
        nbytes = handle.num_tokens * leg.shape.kv_bytes_per_token(handle.dtype)
        leg.metrics.kv_bytes.labels(handle.connector or "unknown", "save").inc(nbytes)
        leg.estimator.observe_transfer(nbytes, t.kv_save_s)


async def decode_deltas(
    leg: LegContext,
    job: Job,
    trace: Trace,
    index: int,
    generated: list[int],
    handle: pdserve_pb2.KvHandle | None,
) -> AsyncIterator[Delta]:
    """Stream choice ``index`` from decode, failing over to another instance when one is lost."""
    ctx = RouteContext(job.block_hashes, job.user)
    tokens = list(generated)
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
        call = inst.stub.Decode(request, timeout=_deadline(job))
        done = False
        inst.inflight += 1
        try:
            async for chunk in call:
                if first_chunk:
                    first_chunk = False
                    _record_decode_start(leg, trace, chunk, handle)
                if chunk.num_cached_tokens and not trace.cached_tokens:
                    trace.cached_tokens = chunk.num_cached_tokens
                tokens.extend(chunk.token_ids)
                finish = chunk.finish_reason or ("stop" if chunk.finished else None)
                lps = logprobs_of(chunk.logprobs) if job.params.logprobs is not None else None
                if chunk.token_ids or chunk.text or chunk.finished:
                    yield Delta(
                        index,
                        list(chunk.token_ids),
                        chunk.text,
                        lps,
                        finish if chunk.finished else None,
                    )
                if chunk.finished:
                    done = True
                    return
            raise StreamBroken("decode stream ended without a final chunk")
        except (grpc.aio.AioRpcError, StreamBroken) as exc:
            done = True
            reason = (
                f"{exc.code().name}: {exc.details()}"
                if isinstance(exc, grpc.aio.AioRpcError)
                else str(exc)
            )
            if isinstance(exc, grpc.aio.AioRpcError):
                if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and handle is not None:
                    # The instance refused the handle (incompatible layout/fingerprint):
                    # compute the prompt locally instead of failing the request.
                    leg.metrics.kv_load_fallbacks.labels("handle_refused").inc()
                    logger.warning(
                        "decode %s refused the KV handle (%s); recomputing", inst.url, reason
                    )
                    handle = None
                    continue
                fatal = _fatal(exc, f"decode instance {inst.url}")
                if fatal is not None:
                    raise fatal from exc
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and job.remaining() <= 0:
                    raise APIError(504, "request timed out during decode", code="timeout") from exc
            failovers += 1
            if failovers > leg.decode_failovers:
                raise APIError(
                    503,
                    f"decode failed on {failovers} instance(s); last error: {reason}",
                    code="decode_failed",
                ) from exc
            leg.decode_pool.mark_failed(inst, reason)
            tried.add(inst.url)
            leg.metrics.decode_failovers.inc()
            logger.warning(
                "decode %s lost on %s (%s); resuming with %d tokens",
                rid,
                inst.url,
                reason,
                len(tokens),
            )
        finally:
            inst.inflight -= 1
            if not done:
                call.cancel()
                leg.abort_later(inst, rid)


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
