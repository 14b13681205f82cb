"""The control plane's shared secret: how a gRPC caller presents it, and how it is checked.

With ``--grpc-token`` (``PDSERVE_GRPC_TOKEN``) set, the prefill and decode services refuse
every call but the standard health check that lacks the metadata
``authorization: Bearer <token>`` (UNAUTHENTICATED), and the router sends it on every call.
The token travels in plaintext: it keeps out callers that can reach the port but do not
know it (another tenant of the cluster network), not an eavesdropper on that network.

Torch-free and gRPC-free: the service interceptor (``service/auth.py``) and the
router's calls (``router/routing/pool.py``) share this.
"""

from __future__ import annotations

import hmac
import secrets
from collections.abc import Iterable

ENV = "PDSERVE_GRPC_TOKEN"
METADATA_KEY = "authorization"  # gRPC metadata keys are lower case


def call_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The metadata a caller sends: empty without a token."""
    return ((METADATA_KEY, f"Bearer {token}"),) if token else ()


def presented(metadata: Iterable[tuple[str, str | bytes]] | None, token: str) -> bool:
    """Whether ``metadata`` carries ``Bearer <token>`` (constant-time comparison)."""
    want = f"Bearer {token}".encode()
    for key, value in metadata or ():
        if key.lower() == METADATA_KEY:
            got = value if isinstance(value, bytes) else value.encode()
            if hmac.compare_digest(got, want):
                return True
    return False


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)
