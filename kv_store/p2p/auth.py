"""Proof of the control-plane token on the p2p control channel (docs/design.md §3, "p2p
pull protocol").

The token is the services' gRPC token (``--grpc-token`` / ``PDSERVE_GRPC_TOKEN``), so one
secret admits a peer to both. It never crosses the wire: on accept the server sends a
``challenge`` with a fresh nonce; the peer's ``hello`` carries a nonce of its own and
``HMAC-SHA256(token, "client" ‖ server nonce ‖ peer nonce)``; the server's ``hello`` reply
carries the same HMAC under the label ``"server"``, so each side proves the token to the
other and a recorded proof answers no later challenge. A server with a token refuses a
peer without the proof (reason ``auth``) before any pair, group or cache mapping exists;
a puller with a token refuses a server whose reply does not prove it.

Standard library only.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from typing import Any

NONCE_BYTES = 16
_LABELS = {"client": b"pdserve-p2p client\0", "server": b"pdserve-p2p server\0"}


def new_nonce() -> str:
    """A fresh random nonce (hex) for one connection."""
    return secrets.token_hex(NONCE_BYTES)


def proof(token: str, side: str, server_nonce: str, client_nonce: str) -> str:
    """What ``side`` ("client" | "server") sends to prove ``token`` on the connection with
    these nonces (hex). The label keeps one side's proof from answering for the other."""
    msg = _LABELS[side] + server_nonce.encode() + b"\0" + client_nonce.encode()
    return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest()


def proves(token: str, side: str, server_nonce: str, client_nonce: Any, presented: Any) -> bool:
    """Whether ``presented`` is ``side``'s proof of ``token`` (constant-time); False for a
    missing or malformed proof or nonce (they come from an unauthenticated peer)."""
    if not isinstance(presented, str) or not isinstance(client_nonce, str):
        return False
    if not client_nonce or len(client_nonce) > 256:  # ours are 32 hex digits
        return False
    want = proof(token, side, server_nonce, client_nonce)
    return hmac.compare_digest(want.encode(), presented.encode("utf-8", "replace"))
