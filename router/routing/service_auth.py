"""The router's side of the control-plane credential (docs/design.md §3, "Control-plane
security"; the wire format is ``common/grpc_token.py``'s).

Each instance has one ``ServiceIdentity``. Every health round first challenges the
instance with a fresh nonce; only an answer that proves the run's token sets the identity
the per-call credentials are bound to, and a failed proof clears it. Without a proven
identity a call carries no credential at all: a process that took a dead service's port
receives nothing it can use, and a credential sent in the moment before the next round
noticed names the dead instance only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import grpc

from common.grpc_token import (
    CHALLENGE_KEY,
    METADATA_KEY,
    PROOF_KEY,
    call_credential,
    new_nonce,
    verified_instance,
)
from pdserve_api.v1 import pdserve_pb2

logger = logging.getLogger(__name__)


class IdentityNotProven(Exception):
    """The address answered the challenge without proof of the run's token."""


@dataclass(slots=True)
class ServiceIdentity:
    """What the router knows of one address: ``instance`` is the identity its last
    challenge proved (None: not proven, so calls carry no credential)."""

    token: str = ""
    instance: str | None = None

    def metadata(self, rpc: str) -> tuple[tuple[str, str], ...]:
        """The metadata of one call of ``rpc`` (empty without a token or a proof)."""
        if not self.token or self.instance is None:
            return ()
        return ((METADATA_KEY, call_credential(self.token, self.instance, rpc)),)

    async def prove(self, stub: Any, timeout: float) -> None:
        """Challenge the service behind ``stub`` (a stub with ``GetLoad``); raises
        IdentityNotProven (identity cleared) unless it proves the token. Transport errors
        propagate and keep the identity: credentials bound to it are of no use to anyone
        but that instance, whoever holds the address now."""
        if not self.token:
            return
        nonce = new_nonce()
        try:
            await stub.GetLoad(
                pdserve_pb2.GetLoadRequest(), timeout=timeout, metadata=((CHALLENGE_KEY, nonce),)
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNAUTHENTICATED:
                raise
            answer = _trailing(exc, PROOF_KEY)
        else:
            answer = ""  # served a call without a credential: not one of this run's services
        instance = verified_instance(self.token, nonce, answer) if answer else None
        self.instance = instance
        if instance is None:
            raise IdentityNotProven("it did not prove the run's control-plane token")


def _trailing(exc: grpc.aio.AioRpcError, key: str) -> str:
    for k, value in exc.trailing_metadata() or ():
        if k == key:
            return value.decode(errors="replace") if isinstance(value, bytes) else str(value)
    return ""
