"""The services' server interceptors for the control plane (docs/design.md §3,
"Control-plane security"): the shared token (``common/grpc_token.py``) and the mTLS
client allow-list (``common/grpc_tls.py``).

A call without a valid credential (a per-call ``PDS1`` credential for this instance, or
``Bearer <token>``) ends with UNAUTHENTICATED before its request is even parsed; one that
carries a ``pdserve-challenge`` nonce instead gets this instance's proof of the token in
the trailing metadata of that refusal (how the router checks whom it talks to); the standard ``grpc.health.v1`` service stays open, because
Kubernetes probes and the launcher's readiness checks cannot send metadata. With mTLS the
handshake already refused callers without a certificate from the CA; with
``--grpc-allowed-clients`` a call whose certificate names none of the allowed identities
ends with PERMISSION_DENIED, again before its request is parsed.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio

from common.grpc_tls import identity_allowed, peer_identity
from common.grpc_token import (
    CHALLENGE_KEY,
    METADATA_KEY,
    PROOF_KEY,
    CallChecker,
    metadata_value,
    presented,
)

logger = logging.getLogger(__name__)

_HEALTH_PREFIX = "/grpc.health.v1."
_MESSAGE = "missing or wrong control-plane credential (common/grpc_token.py)"
_DENIED = "this client certificate is not in the service's --grpc-allowed-clients"


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls that lack the token; ``record_outcome(rpc, "unauthenticated")`` counts
    each refusal."""

    def __init__(self, token: str, record_outcome: Callable[[str, str], None] | None = None):
        if not token:
            raise ValueError("TokenAuthInterceptor needs a non-empty token")
        self._token = token
        self._checker = CallChecker(token)
        self._record = record_outcome or (lambda _rpc, _outcome: None)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        metadata = handler_call_details.invocation_metadata
        rpc = method.rsplit("/", 1)[-1]
        if (
            handler is None
            or method.startswith(_HEALTH_PREFIX)
            or self._checker.accepts(metadata_value(metadata, METADATA_KEY), rpc)
            or presented(metadata, self._token)
        ):
            return handler
        challenge = metadata_value(metadata, CHALLENGE_KEY)
        trailing: tuple[tuple[str, str], ...] = ()
        if challenge and len(challenge) <= 64:
            trailing = ((PROOF_KEY, self._checker.answer(challenge)),)
        else:
            logger.warning("refused %s: no valid control-plane credential", rpc)
            self._record(rpc, "unauthenticated")
        return _denial(handler, trailing)


def _denial(
    handler: grpc.RpcMethodHandler, trailing: tuple[tuple[str, str], ...]
) -> grpc.RpcMethodHandler:
    """A handler that refuses UNAUTHENTICATED (with ``trailing`` metadata) without reading
    the request at all. It is request-streaming whatever the RPC's kind: gRPC's server
    reads a unary request in full before it calls the handler, and the transport opens the
    stream's window to the whole announced message, so a unary refusal would come only
    after a 40 MiB message had been received (the size check runs on the complete message).
    A streaming handler that never reads leaves the client stuck at the stream's first
    window; the refusal ends the call at once (the wire format is the same)."""

    async def deny(_requests: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, _MESSAGE, trailing)
        yield  # pragma: no cover - abort raises; this makes the function a generator

    del handler  # its kind does not matter: see above
    return grpc.stream_stream_rpc_method_handler(deny)


class AllowedClientsInterceptor(grpc.aio.ServerInterceptor):
    """With mTLS: refuses (PERMISSION_DENIED) calls whose peer certificate names none of
    ``allowed`` (SAN or CN); health checks stay open to any peer the handshake let in."""

    def __init__(
        self, allowed: tuple[str, ...], record_outcome: Callable[[str, str], None] | None = None
    ):
        if not allowed:
            raise ValueError("AllowedClientsInterceptor needs at least one allowed identity")
        self._allowed = allowed
        self._record = record_outcome or (lambda _rpc, _outcome: None)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        method = handler_call_details.method
        handler = await continuation(handler_call_details)
        if handler is None or method.startswith(_HEALTH_PREFIX):
            return handler
        # The peer is known only inside the call (its context), so the check wraps the
        # handler instead of replacing it.
        return _checked(handler, method.rsplit("/", 1)[-1], self._allowed, self._record)


def _checked(
    handler: grpc.RpcMethodHandler,
    rpc: str,
    allowed: tuple[str, ...],
    record: Callable[[str, str], None],
) -> grpc.RpcMethodHandler:
    async def check(context: grpc.aio.ServicerContext) -> None:
        identity = peer_identity(context)
        if not identity_allowed(identity, allowed):
            logger.warning("refused %s from %r: not an allowed client", rpc, identity)
            record(rpc, "permission_denied")
            await context.abort(grpc.StatusCode.PERMISSION_DENIED, _DENIED)

    def parse(raw: bytes) -> Any:
        # Raw bytes until the peer is checked: a refused request is never parsed.
        return handler.request_deserializer(raw) if handler.request_deserializer else raw

    if handler.unary_stream is not None:
        inner_stream = handler.unary_stream

        async def stream(raw: bytes, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await check(context)
            async for item in inner_stream(parse(raw), context):
                yield item

        return grpc.unary_stream_rpc_method_handler(stream, None, handler.response_serializer)
    if handler.unary_unary is not None:
        inner_unary = handler.unary_unary

        async def unary(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            await check(context)
            return await inner_unary(parse(raw), context)

        return grpc.unary_unary_rpc_method_handler(unary, None, handler.response_serializer)
    raise ValueError(f"{rpc}: client-streaming RPCs are not served by pdserve")
