"""The services' server interceptor for the control plane's shared token
(``common/grpc_token.py``).

A call without ``authorization: Bearer <token>`` ends with UNAUTHENTICATED before its
request is even parsed; the standard ``grpc.health.v1`` service stays open, because
Kubernetes probes and the launcher's readiness checks cannot send metadata.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio

from common.grpc_token import presented

logger = logging.getLogger(__name__)

_HEALTH_PREFIX = "/grpc.health.v1."
_MESSAGE = "missing or wrong control-plane token: send 'authorization: Bearer <token>'"


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls that lack the token; ``record_outcome(rpc, "unauthenticated")`` counts
    each refusal."""

    def __init__(self, token: str, record_outcome: Callable[[str, str], None] | None = None):
        if not token:
            raise ValueError("TokenAuthInterceptor needs a non-empty token")
        self._token = token
        self._record = record_outcome or (lambda _rpc, _outcome: None)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        if (
            handler is None
            or method.startswith(_HEALTH_PREFIX)
            or presented(handler_call_details.invocation_metadata, self._token)
        ):
            return handler
        rpc = method.rsplit("/", 1)[-1]
        logger.warning("refused %s: no valid control-plane token", rpc)
        self._record(rpc, "unauthenticated")
        # No request_deserializer: an unauthenticated request is never parsed.
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(_deny_stream)
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(_deny_stream)
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(_deny_unary)
        return grpc.unary_unary_rpc_method_handler(_deny_unary)


async def _deny_unary(_request: Any, context: grpc.aio.ServicerContext) -> Any:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _MESSAGE)


async def _deny_stream(_request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, _MESSAGE)
    yield  # pragma: no cover - abort raises; this makes the function a generator
