"""The NIXL notification seal's rules that the process test does not reach: a changed
body, a time from the future, a seen nonce forgotten after its window, no token."""

from __future__ import annotations

import json
import time

import pytest

from kv_store.nixl.card import MAGIC, CardError
from kv_store.nixl.seal import SKEW_S, Seal

MSG = {"op": "done", "lease": "L1", "pull": "p1"}


def pair(token: str = "t", window_s: float = 4.0) -> tuple[Seal, Seal]:
    return Seal(token, "decode", window_s), Seal(token, "prefill", window_s)


def refused(seal: Seal, raw: bytes, sender: str = "decode") -> str:
    with pytest.raises(CardError) as info:
        seal.unpack(raw, sender)
    return info.value.reason


def test_a_sealed_notification_opens_once_for_its_pair_only() -> None:
    dec, pre = pair()
    raw = dec.pack(MSG, "prefill")
    assert pre.unpack(raw, "decode") == MSG
    assert refused(pre, raw) == "replay"
    assert refused(Seal("t", "prefill-2", 4.0), raw) == "auth"  # another recipient
    assert refused(Seal("t", "prefill", 4.0), raw, sender="other") == "auth"
    assert refused(Seal("u", "prefill", 4.0), dec.pack(MSG, "prefill")) == "auth"


def test_a_changed_body_or_missing_fields_are_refused() -> None:
    dec, pre = pair()
    body = json.loads(dec.pack(MSG, "prefill")[len(MAGIC) :])
    assert refused(pre, MAGIC + json.dumps({**body, "lease": "L2"}).encode()) == "auth"
    bare = {k: v for k, v in body.items() if k not in ("ts", "n")}
    assert refused(pre, MAGIC + json.dumps(bare).encode()) == "auth"
    assert refused(pre, b"xxxx{}") == "protocol"


def test_the_window_both_ways_and_forgetting() -> None:
    dec, pre = pair(window_s=1.0)
    now = time.time()
    assert refused(pre, dec.pack(MSG, "prefill", now=now - 1.0 - SKEW_S - 1)) == "stale"
    assert refused(pre, dec.pack(MSG, "prefill", now=now + SKEW_S + 1)) == "stale"
    # Just inside the window: accepted, remembered until it would be stale anyway.
    raw = dec.pack(MSG, "prefill", now=now - SKEW_S)
    assert pre.unpack(raw, "decode") == MSG
    assert refused(pre, raw) == "replay"
    pre._next_purge = 0.0  # the next message purges: this nonce's window is over soon
    time.sleep(1.1)
    assert refused(pre, raw) == "stale"  # outside the window, so never seen twice
    assert pre.unpack(dec.pack(MSG, "prefill"), "decode") == MSG
    assert len(pre._seen) == 1  # the old nonce was forgotten


def test_without_a_token_nothing_is_added_or_checked() -> None:
    dec, pre = pair(token="")
    raw = dec.pack(MSG, "prefill")
    assert raw == MAGIC + json.dumps(MSG, separators=(",", ":")).encode()
    assert pre.unpack(raw, "anyone") == MSG
