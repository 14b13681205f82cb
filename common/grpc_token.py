"""The control plane's shared secret: how a gRPC caller presents it, and how it is checked.

With ``--grpc-token`` (``PDSERVE_GRPC_TOKEN``) set, the prefill and decode services refuse
every call but the standard health check that carries no valid credential
(UNAUTHENTICATED). Two credentials are accepted (docs/design.md §3, "Control-plane
security"):

- ``authorization: PDS1 <instance>.<time>.<nonce>.<mac>``, what the router sends: an
  HMAC under the token over the service instance's identity, the RPC's name, the time and
  a fresh nonce. The router first has the instance prove that it knows the token (a
  challenge: ``pdserve-challenge: <nonce>`` with no credential is answered UNAUTHENTICATED
  with ``pdserve-proof: <instance>.<mac>`` in the trailing metadata) and sends nothing to
  an address that cannot. A process squatting a dead service's port gets no credential
  at all; a call credential caught anyway names one instance, one RPC, a short window and
  a nonce that instance accepts once, so it is good for nothing else.
- ``authorization: Bearer <token>``, the plain token, for operators' tools and the KV
  peers; the router never sends it.

Torch-free and gRPC-free: the service interceptor (``service/auth.py``) and the
router (``router/routing/service_auth.py``) share this.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

ENV = "PDSERVE_GRPC_TOKEN"
METADATA_KEY = "authorization"  # gRPC metadata keys are lower case
CHALLENGE_KEY = "pdserve-challenge"
PROOF_KEY = "pdserve-proof"
SCHEME = "PDS1"
# How far a call credential's time may be from the service's clock (either way), and how
# long the service remembers its nonce (replays inside the window are refused).
WINDOW_S = 60.0


def call_metadata(token: str) -> tuple[tuple[str, str], ...]:
    """The plain-token metadata (tools, KV peers): empty without a token."""
    return ((METADATA_KEY, f"Bearer {token}"),) if token else ()


def metadata_value(metadata: Iterable[tuple[str, str | bytes]] | None, key: str) -> str:
    """The first value of ``key`` in ``metadata`` as text ('' when absent)."""
    for k, value in metadata or ():
        if k.lower() == key:
            return value.decode(errors="replace") if isinstance(value, bytes) else value
    return ""


def presented(metadata: Iterable[tuple[str, str | bytes]] | None, token: str) -> bool:
    """Whether ``metadata`` carries ``Bearer <token>`` (constant-time comparison)."""
    want = f"Bearer {token}".encode()
    got = metadata_value(metadata, METADATA_KEY).encode()
    return bool(got) and hmac.compare_digest(got, want)


def new_token() -> str:
    """A fresh random token (256 bits, URL-safe text)."""
    return secrets.token_urlsafe(32)


def new_nonce() -> str:
    return secrets.token_hex(12)


def _mac(token: str, *parts: str) -> str:
    return hmac.new(token.encode(), "\x1f".join(parts).encode(), hashlib.sha256).hexdigest()


def proof(token: str, nonce: str, instance: str) -> str:
    """A service's answer to the challenge ``nonce``: its identity and a MAC only a holder
    of the token can make (the nonce is the caller's, so an old answer is no use)."""
    return f"{instance}.{_mac(token, 'proof', nonce, instance)}"


def verified_instance(token: str, nonce: str, answer: str) -> str | None:
    """The instance ``answer`` proves for the challenge ``nonce``, or None."""
    instance, _, mac = answer.partition(".")
    if not instance or not mac:
        return None
    return instance if hmac.compare_digest(mac, _mac(token, "proof", nonce, instance)) else None


def call_credential(token: str, instance: str, rpc: str, now: float | None = None) -> str:
    """The ``authorization`` value for one call of ``rpc`` to ``instance``."""
    stamp = f"{(time.time() if now is None else now):.3f}"
    nonce = new_nonce()
    return f"{SCHEME} {instance}.{stamp}.{nonce}.{_mac(token, 'call', instance, rpc, stamp, nonce)}"


@dataclass(slots=True)
class CallChecker:
    """A service's side: its identity, the answer to challenges and the check of call
    credentials, with the nonces seen within the window (one owner: the interceptor)."""

    token: str
    instance: str = field(default_factory=lambda: secrets.token_hex(8))
    window_s: float = WINDOW_S
    seen: dict[str, float] = field(default_factory=dict)  # nonce -> when it may be forgotten

    def answer(self, nonce: str) -> str:
        return proof(self.token, nonce, self.instance)

    def accepts(self, value: str, rpc: str, now: float | None = None) -> bool:
        """Whether ``value`` (an ``authorization`` value) is a fresh credential for this
        instance and ``rpc``; a nonce is accepted once."""
        scheme, _, rest = value.partition(" ")
        parts = rest.split(".")
        if scheme != SCHEME or len(parts) != 5:
            return False
        instance, whole, frac, nonce, mac = parts
        stamp = f"{whole}.{frac}"
        now = time.time() if now is None else now
        try:
            age = abs(now - float(stamp))
        except ValueError:
            return False
        if instance != self.instance or age > self.window_s:
            return False
        if not hmac.compare_digest(mac, _mac(self.token, "call", instance, rpc, stamp, nonce)):
            return False
        self._forget_old(now)
        if nonce in self.seen:
            return False
        self.seen[nonce] = now + 2 * self.window_s
        return True

    def _forget_old(self, now: float) -> None:
        # Insertion order is expiry order (a constant lifetime), so the oldest go first.
        while self.seen:
            nonce, until = next(iter(self.seen.items()))
            if until > now:
                return
            del self.seen[nonce]
