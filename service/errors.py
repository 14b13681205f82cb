"""Domain errors → gRPC status codes, in one server interceptor (both services use it).

Servicers raise plain Python errors; this layer turns them into status codes so that every
RPC answers the same way:

- ``IncompatibleKvHandle`` (handle from another model / dtype / layout) → FAILED_PRECONDITION,
  which the router answers by recomputing the prompt on decode instead of failing the client
- ``ValueError`` (bad prompt, bad sampling parameters) → INVALID_ARGUMENT, and so does a
  request that cannot even be parsed (e.g. a string field that is not UTF-8), which gRPC
  would otherwise answer UNKNOWN
- ``EngineFull`` → RESOURCE_EXHAUSTED
- ``ServiceUnavailable`` (draining, KV save/load failed; ``KVSaveFailed`` adds the trailer
  ``pdserve-error: kv-save-failed``), ``KVStoreError``, ``KVRecordError``,
  ``ConnectionError``, and the types passed as ``unavailable`` (the engine's
  ``EngineDeadError``) → UNAVAILABLE
- ``TimeoutError`` → DEADLINE_EXCEEDED
- anything else → INTERNAL (logged with its traceback)

It also counts every RPC by outcome (``ok``, ``cancelled``, ``deadline_exceeded`` or the
status code's name) in ``pdserve_service_requests_total``.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio

from kv_store.base import KVRecordError, KVStoreError

logger = logging.getLogger(__name__)

_HEALTH_PREFIX = "/grpc.health.v1."


class ServiceUnavailable(RuntimeError):
    """The service cannot take this request now (draining, store down); try another instance."""


class KVSaveFailed(ServiceUnavailable):
    """Prefill's KV save failed after its first token was sent: the instance is fine, the
    store is not. Answered UNAVAILABLE with trailing metadata ``pdserve-error:
    kv-save-failed`` so the router lets decode compute the prompt instead of taking the
    prefill instance out."""

    trailing_metadata = (("pdserve-error", "kv-save-failed"),)


class IncompatibleKvHandle(ValueError):
    """The KvHandle was written by an engine with another model, dtype or KV layout: a
    deployment mismatch, not bad client input."""


class EngineFull(RuntimeError):
    """The engine's waiting queue is at its limit; try later or elsewhere."""


class LoRASlotBusy(EngineFull):
    """The request waited past its deadline for a LoRA slot (docs/lora.md): the instance
    is fine, its slots are taken; RESOURCE_EXHAUSTED like a full queue."""


_UNAVAILABLE = (ServiceUnavailable, KVStoreError, KVRecordError, ConnectionError)


def status_for(
    exc: BaseException, unavailable: tuple[type[BaseException], ...] = ()
) -> grpc.StatusCode:
    """The status code a domain error maps to (order matters: KVRecordError is a ValueError).
    ``unavailable`` adds error types meaning "this instance cannot serve" (a dead engine)."""
    if isinstance(exc, (*_UNAVAILABLE, *unavailable)):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(exc, EngineFull):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED
    if isinstance(exc, IncompatibleKvHandle):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(exc, ValueError | TypeError):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INTERNAL


OutcomeRecorder = Callable[[str, str], None]


class _Unparsable:
    """Stands in for a request whose bytes did not parse; the handler refuses it."""

    __slots__ = ("error",)

    def __init__(self, error: Exception) -> None:
        self.error = error


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """A deserializer that returns ``_Unparsable`` instead of raising: an exception here
    would end the call with UNKNOWN before any handler (or this interceptor) runs."""
    if deserializer is None:
        return None

    def parse(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError and kin
            return _Unparsable(exc)

    return parse


def _check_parsed(request: Any) -> None:
    if isinstance(request, _Unparsable):
        raise ValueError(f"the request could not be parsed: {request.error}")


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every unary-unary and unary-stream handler with the mapping above."""

    def __init__(
        self,
        record_outcome: OutcomeRecorder | None = None,
        unavailable: tuple[type[BaseException], ...] = (),
    ) -> None:
        self._record = record_outcome or (lambda _method, _outcome: None)
        self._unavailable = unavailable

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(_HEALTH_PREFIX):
            return handler
        rpc = method.rsplit("/", 1)[-1]
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_stream(rpc, handler.unary_stream),
                request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(rpc, handler.unary_unary),
                request_deserializer=_tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        return handler

    def _wrap_unary(self, rpc: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                _check_parsed(request)
                response = await behavior(request, context)
            except BaseException as exc:
                await self._fail(rpc, exc, context)
                raise
            self._record(rpc, "ok")
            return response

        return unary

    def _wrap_stream(self, rpc: str, behavior: Callable[..., Any]) -> Callable[..., Any]:
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            try:
                _check_parsed(request)
                async for item in behavior(request, context):
                    yield item
            except BaseException as exc:
                await self._fail(rpc, exc, context)
                raise
            self._record(rpc, "ok")

        return stream

    async def _fail(self, rpc: str, exc: BaseException, context: grpc.aio.ServicerContext) -> None:
        """Record the outcome and, for a domain error, abort the RPC with its status code.

        ``context.abort`` raises ``AbortError``, which replaces ``exc`` on the way out. Errors
        that already carry a status (an earlier ``abort``) and cancellations only get counted.
        """
        if isinstance(exc, asyncio.CancelledError | GeneratorExit):
            remaining = context.time_remaining()
            expired = remaining is not None and remaining <= 0
            self._record(rpc, "deadline_exceeded" if expired else "cancelled")
            return
        if isinstance(exc, grpc.aio.AbortError):
            code = context.code()
            self._record(rpc, code.name.lower() if isinstance(code, grpc.StatusCode) else "aborted")
            return
        if not isinstance(exc, Exception):
            return
        code = status_for(exc, self._unavailable)
        self._record(rpc, code.name.lower())
        if code is grpc.StatusCode.INTERNAL:
            logger.exception("%s failed", rpc, exc_info=exc)
            message = f"internal error: {type(exc).__name__}: {exc}"
        else:
            logger.info("%s refused (%s): %s", rpc, code.name, exc)
            message = str(exc)
        await context.abort(code, message, trailing_metadata=_trailers(exc))


def _trailers(exc: BaseException) -> tuple[tuple[str, str], ...]:
    """Trailing metadata a domain error carries (``KVSaveFailed``), else none."""
    return tuple(getattr(exc, "trailing_metadata", ()))
