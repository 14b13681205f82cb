"""Proof of the control-plane token on NIXL notifications (docs/design.md §3, "nixl").

With a token (the services' ``--grpc-token``), every notification carries its send time
``ts`` (wall clock, milliseconds), a fresh random nonce ``n`` and
``HMAC-SHA256(token, label ‖ sender ‖ recipient ‖ body)``, where sender and recipient are
the two NIXL agents' names (the recipient as the handle's card names it, or the decode
agent the holder answers) and the body holds the lease id (``pin``/``done``/``fail``) and
``ts``/``n``. The receiver takes the sender's name from NIXL and its own name, so neither
travels twice, and refuses a notification (counted under the pull failure reasons):

- whose MAC does not verify under (sender, itself) — forged, or addressed to another agent
  (``auth``);
- sent longer ago than its window (twice the pull timeout, the longest a pin waits for its
  ``done``, plus ``SKEW_S`` of clock difference between hosts) or further ahead than
  ``SKEW_S`` (``stale``);
- whose (sender, nonce) it accepted already within the window (``replay``).

The seen nonces are kept only for the window (an older message is stale anyway), so the
set stays as small as the traffic of one window. Without a token nothing is added or
checked: a deployment without one admits any peer (docs/design.md §3).

Standard library only; one instance per connector, used by its progress thread only.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
import time
from typing import Any

from kv_store.nixl.card import MAGIC, CardError

LABEL = b"pdserve-nixl notif 2\0"
NONCE_BYTES = 8  # 64 random bits: one collision in 2^32 notifications of one window
SKEW_S = 5.0  # clock difference tolerated between two hosts' wall clocks
MAX_SEEN = 1 << 18  # nonces remembered at once; more in one window is a flood, refused
PURGE_EVERY_S = 1.0


def _mac(token: str, sender: str, recipient: str, body: dict[str, Any]) -> str:
    data = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
    msg = b"\0".join((LABEL + sender.encode(), recipient.encode(), data))
    return hmac.new(token.encode(), msg, hashlib.sha256).hexdigest()


class Seal:
    """Packs this agent's notifications and opens the ones it receives; see the module
    docstring. ``me``: this agent's name; ``window_s``: how long a notification is good."""

    def __init__(self, token: str, me: str, window_s: float) -> None:
        self._token, self._me, self._window_s = token, me, window_s + SKEW_S
        self._seen: dict[tuple[str, str], float] = {}  # (sender, nonce) -> forget after
        self._next_purge = 0.0

    def pack(self, msg: dict[str, Any], to: str, now: float | None = None) -> bytes:
        """The notification ``msg`` for agent ``to``: the magic, then the JSON body (with a
        token: its time, nonce and MAC). ``now``: the send time (tests send old ones)."""
        body = dict(msg)
        if self._token:
            body["ts"] = int((time.time() if now is None else now) * 1000)
            body["n"] = secrets.token_hex(NONCE_BYTES)
            body["auth"] = _mac(self._token, self._me, to, body)
        return MAGIC + json.dumps(body, separators=(",", ":")).encode()

    def unpack(self, raw: bytes, sender: str) -> dict[str, Any]:
        """The body of a notification from agent ``sender``; ``CardError`` (``protocol``,
        ``auth``, ``stale``, ``replay``, ``busy``) when it is not one of ours, does not
        prove the token for this pair of agents, is out of its window or seen before."""
        if not raw.startswith(MAGIC):
            raise CardError("not a pdserve nixl notification")
        try:
            body = json.loads(raw[len(MAGIC) :])
        except ValueError:
            raise CardError("malformed nixl notification") from None
        if not isinstance(body, dict) or not isinstance(body.get("op"), str):
            raise CardError("malformed nixl notification")
        auth = body.pop("auth", "")
        if not self._token:
            return body
        want = _mac(self._token, sender, self._me, body)
        if not (isinstance(auth, str) and hmac.compare_digest(auth.encode(), want.encode())):
            raise CardError(
                "the notification does not prove the control-plane token to this agent", "auth"
            )
        self._fresh(sender, body.pop("ts", None), body.pop("n", None))
        return body

    def _fresh(self, sender: str, ts: Any, nonce: Any) -> None:
        """Refuse a notification outside its window or seen already; remember it."""
        if not isinstance(ts, int) or not isinstance(nonce, str):
            raise CardError("the notification carries no time or nonce", "auth")
        now = time.time()
        sent = ts / 1000
        if sent < now - self._window_s or sent > now + SKEW_S:
            raise CardError(f"the notification was sent {now - sent:.1f} s ago", "stale")
        if now >= self._next_purge:
            self._seen = {k: t for k, t in self._seen.items() if t > now}
            self._next_purge = now + PURGE_EVERY_S
        key = (sender, nonce)
        if key in self._seen:
            raise CardError("the notification was received already", "replay")
        if len(self._seen) >= MAX_SEEN:
            raise CardError("too many notifications in one window", "busy")
        self._seen[key] = sent + self._window_s
