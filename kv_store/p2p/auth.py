"""Proof of the control-plane token on the p2p control channel (docs/design.md §3, "p2p
pull protocol").

The token is the services' gRPC token (``--grpc-token`` / ``PDSERVE_GRPC_TOKEN``), so one
secret admits a peer to both. It never crosses the wire: on accept the server sends a
``challenge`` with a fresh nonce; the peer's ``hello`` carries a nonce of its own and
``HMAC-SHA256(token, "client" ‖ server nonce ‖ peer nonce ‖ address)``; the server's
``hello`` reply carries the same HMAC under the label ``"server"``, so each side proves
the token to the other and a recorded proof answers no later challenge. ``address`` is
the source's control address as the handle names it: the one the puller dialed, and the
one the server advertises. So a proof is good for one server only: a process squatting a
restarted prefill's old port that relays the real prefill's challenge (now on another
port) gets a proof the real prefill refuses, and the real prefill's answer, relayed back,
does not prove the dialed address to the puller either. A server with a token refuses a
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
_LABELS = {"client": b"pdserve-p2p client 2\0", "server": b"pdserve-p2p server 2\0"}


def new_nonce() -> str:
    """A fresh random nonce (hex) for one connection."""
    return secrets.token_hex(NONCE_BYTES)


def proof(token: str, side: str, server_nonce: str, client_nonce: str, address: str) -> str:
    """What ``side`` ("client" | "server") sends to prove ``token`` on the connection with
    these nonces (hex) to the source at ``address``. The label keeps one side's proof from
    answering for the other."""
    msg = b"\0".join(
        (_LABELS[side] + server_nonce.encode(), client_nonce.encode(), address.encode())
    )
    return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest()


def proves(
    token: str, side: str, server_nonce: str, client_nonce: Any, address: str, presented: Any
) -> bool:
    """Whether ``presented`` is ``side``'s proof of ``token`` (constant-time); False for a
    missing or malformed proof or nonce (they come from an unauthenticated peer)."""
    if not isinstance(presented, str) or not isinstance(client_nonce, str):
        return False
    if not client_nonce or len(client_nonce) > 256:  # ours are 32 hex digits
        return False
    want = proof(token, side, server_nonce, client_nonce, address)
    return hmac.compare_digest(want.encode(), presented.encode("utf-8", "replace"))
