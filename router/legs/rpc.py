"""What the two gRPC legs of a request share (``prefill_leg``, ``decode_leg``): pools and
limits, background aborts, wire conversions, deadlines and the retryable-status rule."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdserve_api.v1 import pdserve_pb2
from router.errors import APIError
from router.legs.trace import Job, TokenLogprob
from router.metrics import RouterMetrics
from router.routing.estimator import AutoEstimator
from router.routing.pool import Instance, InstancePool
from router.tokenizer import ModelShape, PromptProcessor

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
    # A service restarted since the last health round proved its identity: the call's
    # credential names the old instance (router/routing/service_auth.py). The instance is
    # marked failed and the call fails over; the next round proves the new one.
    grpc.StatusCode.UNAUTHENTICATED,
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
    processor: PromptProcessor
    block_size: int = 16
    kv_dtype: str = "bfloat16"  # updated from every KvHandle seen (what the estimator prices)
    estimator: AutoEstimator = field(default_factory=AutoEstimator)
    abort_timeout: float = 2.0
    stream_idle_timeout: float = 30.0  # no decode chunk for this long: fail the stream over

    @property
    def shape(self) -> ModelShape:
        return self.processor.shape

    background: set[asyncio.Task[Any]] = field(default_factory=set)

    def abort_later(self, inst: Instance, request_id: str) -> None:
        """Send Abort in a task of its own: the caller is usually being cancelled, and an
        await inside a cancelled scope would never run."""
        task = asyncio.get_running_loop().create_task(_abort(inst, request_id, self.abort_timeout))
        self.background.add(task)
        task.add_done_callback(self.background.discard)


async def _abort(inst: Instance, request_id: str, timeout: float) -> None:
    try:
        await inst.stub.Abort(
            pdserve_pb2.AbortRequest(request_id=request_id),
            timeout=timeout,
            metadata=inst.auth.metadata("Abort"),
        )
    except grpc.RpcError as exc:
        logger.debug("abort %s on %s failed: %s", request_id, inst.url, exc)


def sampling_proto(job: Job, index: int) -> pdserve_pb2.SamplingParams:
    p = job.params
    return pdserve_pb2.SamplingParams(
        max_tokens=job.max_tokens,
        min_tokens=p.min_tokens,
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
        include_stop_str_in_output=p.include_stop_str_in_output,
        guided_kind=p.guided_kind,
        guided_value=p.guided_value,
        logit_bias=p.logit_bias,
        prompt_logprobs=p.prompt_logprobs,
    )


def logprobs_of(items: Any) -> list[TokenLogprob]:
    return [
        TokenLogprob(
            lp.token_id, lp.logprob, list(zip(lp.top_token_ids, lp.top_logprobs, strict=False))
        )
        for lp in items
    ]


def deadline_for(job: Job, cap: float | None = None) -> float:
    remaining = job.remaining()
    if remaining <= 0:
        raise APIError(504, "request timed out", code="timeout")
    return remaining if cap is None else min(cap, remaining)


def fatal_error(exc: grpc.aio.AioRpcError, what: str) -> APIError | None:
    """The client-facing error for a non-retryable status, or None when it is retryable."""
    code = exc.code()
    if code in _RETRYABLE:
        return None
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return APIError(400, f"{what} rejected the request: {exc.details()}", code="invalid_value")
    return APIError(500, f"{what} failed: {code.name}: {exc.details()}", code="upstream_error")


def busy(exc: BaseException) -> bool:
    """The instance is up but cannot take this request now (its queue is full, or the
    request waited out its deadline for a LoRA slot): try another instance, but do not take
    this one out of rotation (docs/design.md §5, "Degrade, never drop")."""
    return (
        isinstance(exc, grpc.aio.AioRpcError) and exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    )


def describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return str(exc)
