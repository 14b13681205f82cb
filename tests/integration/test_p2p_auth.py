"""The p2p control server authenticates its peers with the control-plane token (the
services' ``--grpc-token``) between real processes over gloo: a puller with a wrong token
or none is refused with reason ``auth`` before any pair is formed, and its refusal leaves
the lease for the rightful puller; a puller with the token refuses a source that cannot
prove it. The token itself never crosses the wire (``kv_store/p2p/auth.py``)."""

from __future__ import annotations

import json
import socket
import struct
import time
from typing import Any

import pytest

from kv_store.p2p.wire import recv_msg, send_msg, split_address

pytestmark = pytest.mark.timeout(180)

TOKEN = "the-control-plane-token"


def test_pull_needs_the_token(workers: Any) -> None:
    prefill = workers("prefill", seed=21, token=TOKEN)
    wrong = workers("wrong", seed=22, token="not-the-token")
    without = workers("without", seed=23)
    src, dst = [1, 2, 3, 4], [10, 11, 12, 13]
    offer = prefill.offer("r1", src)
    for puller in (wrong, without):
        got = puller.call("pull", **puller.pull_args(prefill, offer, "r1", src, dst))
        assert not got["ok"] and got["reason"] == "auth" and got["loaded"] == 0, got
    stats = prefill.call("stats")
    assert stats["p2p"]["pairs_made"] == 0, "no group is formed for an unauthenticated peer"
    assert stats["p2p"]["pull_failures"] == {"auth": 2}
    assert stats["generic"]["failures"] == {"auth": 2}
    assert stats["p2p"]["leases_held"] == 1 and stats["releases"] == []

    right = workers("right", seed=24, token=TOKEN)
    got = right.call("pull", **right.pull_args(prefill, offer, "r1", src, dst))
    assert got["ok"] and got["loaded"] == len(src) and got["equal"], got
    stats = prefill.call("wait_released", count=1, timeout=10)
    assert stats["releases"] == [{"request_id": "r1", "ok": True, "reason": None}]


def test_puller_with_the_token_refuses_a_source_without_it(workers: Any) -> None:
    prefill = workers("prefill", seed=31)
    decode = workers("decode", seed=32, token=TOKEN)
    offer = prefill.offer("r2", [5, 6])
    got = decode.call("pull", **decode.pull_args(prefill, offer, "r2", [5, 6], [7, 8]))
    assert not got["ok"] and got["reason"] == "auth", got
    assert decode.call("stats")["p2p"]["pairs_made"] == 0


def test_raw_peer_sees_a_nonce_never_the_token_and_is_refused(workers: Any) -> None:
    """What any client of the port sees: a challenge; presenting the token itself (or
    anything but the HMAC proof) is refused with reason ``auth``; an oversized hello is
    dropped unread."""
    prefill = workers("prefill", seed=41, token=TOKEN)
    host, port = split_address(prefill.address)
    with socket.create_connection((host, port), timeout=10) as sock:
        deadline = time.monotonic() + 10
        challenge = recv_msg(sock, deadline)
        assert challenge["op"] == "challenge" and len(challenge["nonce"]) == 32
        assert TOKEN not in json.dumps(challenge)
        send_msg(sock, {"op": "hello", "ok": True, "nonce": "ab" * 16, "auth": TOKEN}, deadline)
        reply = recv_msg(sock, deadline)
        assert reply["op"] == "hello" and not reply["ok"] and reply["reason"] == "auth", reply
    with socket.create_connection((host, port), timeout=10) as sock:
        deadline = time.monotonic() + 10
        recv_msg(sock, deadline)
        sock.sendall(struct.pack("!I", 1 << 20))  # a 1 MiB hello: more than any hello
        assert sock.recv(1) == b""  # closed without reading or answering
    assert prefill.call("stats")["p2p"]["pairs_made"] == 0
