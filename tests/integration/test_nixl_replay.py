"""A NIXL notification proves the token for one sender, one recipient, once, for a short
while (issue 36, ``kv_store/nixl/seal.py``): a recorded one sent again is refused
(``replay``), one addressed to prefill A and delivered to prefill B is refused (``auth``),
one sent too long ago is refused (``stale``), and none of them pins or ends a lease. Two
real prefill ``p2p_worker`` processes (``connector="nixl"``) and, in the test process, a
real NIXL agent holding the token that records the notifications it sends and sends
them again; then a real decode worker still reads both prefills' leases."""

from __future__ import annotations

import base64
import time
from typing import Any

import pytest
import torch

from kv_store.base import KvLayout
from kv_store.nixl.agent import PoolAgent, layout_dict
from kv_store.nixl.card import Card, hashes_digest, parse_transfer_id
from kv_store.nixl.seal import Seal
from tests.integration.p2p_support import LAYOUT, Worker, block_hashes

pytestmark = pytest.mark.timeout(180)

TOKEN = "s3cret"
NIXL = {"connector": "nixl", "token": TOKEN, "timeout_s": 2.0}
SRC, DST = [1, 3, 5], [2, 4, 6]


class Recorder:
    """A real NIXL agent with the token: sends pins, keeps their bytes, reads answers."""

    def __init__(self) -> None:
        layout = KvLayout(**LAYOUT)
        shape = (layout.num_layers, 2, 4, layout.block_size, layout.num_kv_heads, 8)
        self.agent = PoolAgent(torch.zeros(shape), layout_dict(layout), "fp-test")
        self.seal = Seal(TOKEN, self.agent.name, 4.0)
        self._peers: set[str] = set()

    def send(self, card: Card, msg: dict[str, Any], **kw: Any) -> bytes:
        if card.agent not in self._peers:
            self._peers.add(self.agent.add_peer(card.metadata))
        raw = self.seal.pack(msg, card.agent, **kw)
        assert self.agent.notify(card.agent, raw)
        return raw

    def greet(self, card: Card) -> bytes:
        md = base64.b64encode(self.agent.card.metadata).decode()
        return self.send(card, {"op": "hello", "md": md})

    def answers(self, seconds: float) -> list[dict[str, Any]]:
        """Every notification that arrives within ``seconds`` (opened under the token)."""
        out: list[dict[str, Any]] = []
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for sender, msgs in self.agent.notifications().items():
                out += [self.seal.unpack(bytes(m), sender) for m in msgs]
            time.sleep(0.02)
        return out


def pin(offer: dict[str, Any], request_id: str, pull: str) -> dict[str, Any]:
    card = Card.decode(offer["address"])
    lease, ids = parse_transfer_id(offer["transfer_id"])
    hashes = [bytes.fromhex(h) for h in block_hashes(request_id, len(ids))]
    return {
        "op": "pin",
        "lease": lease,
        "pull": pull,
        "start": 0,
        "ids": ids,
        "digest": hashes_digest(hashes),
        "fp": card.fingerprint,
        "layout": card.layout,
    }


def failures(w: Worker) -> dict[str, int]:
    return dict(w.call("stats")["p2p"]["pull_failures"])


def held(w: Worker) -> tuple[int, int, int]:
    p = w.call("stats")["p2p"]
    return p["leases_held"], p["leases_pinned"], p["blocks_held"]


def test_replayed_misaddressed_and_old_notifications_are_refused(workers: Any) -> None:
    a, b = workers("prefill-a", seed=61, **NIXL), workers("prefill-b", seed=62, **NIXL)
    rec = Recorder()
    try:
        _exchange(workers, a, b, rec)
    finally:
        rec.agent.close()


def _exchange(workers: Any, a: Worker, b: Worker, rec: Recorder) -> None:
    offer_a = a.offer("ra", SRC)
    card_a = Card.decode(offer_a["address"])
    lease_a = parse_transfer_id(offer_a["transfer_id"])[0]
    # The genuine exchange: hello, pin -> pinned, done -> the lease ends as pulled.
    hello = rec.greet(card_a)
    pin_bytes = rec.send(card_a, pin(offer_a, "ra", "p1"))
    got = rec.answers(1.0)
    assert [(m["op"], m["ok"]) for m in got] == [("pinned", True)], got
    done = rec.send(card_a, {"op": "done", "lease": lease_a, "pull": "p1"})
    released = a.call("wait_released", count=1, timeout=10)["releases"]
    assert released == [{"request_id": "ra", "ok": True, "reason": None}]

    # The same bytes again, each: refused unanswered, counted.
    for raw in (hello, pin_bytes, done):
        assert rec.agent.notify(card_a.agent, raw)
    assert rec.answers(1.0) == []
    assert failures(a) == {"replay": 3}

    # A pin addressed to A, delivered to B (same token, B's own live lease): refused.
    offer_b = b.offer("rb", SRC)
    card_b = Card.decode(offer_b["address"])
    rec.greet(card_b)
    forwarded = Seal(TOKEN, rec.agent.name, 4.0).pack(pin(offer_b, "rb", "p2"), card_a.agent)
    assert rec.agent.notify(card_b.agent, forwarded)
    # A pin for B sent a minute ago (the receiver's window: 2 x 2 s + skew): refused.
    rec.send(card_b, pin(offer_b, "rb", "p3"), now=time.time() - 60)
    assert rec.answers(1.0) == []
    assert failures(b) == {"auth": 1, "stale": 1}
    assert held(b) == (1, 0, len(SRC))  # nothing pinned: still held for its decode

    # The genuine decode still reads B's lease, and a fresh one of A.
    decode = workers("decode", seed=63, **NIXL)
    got = decode.call("pull", **decode.pull_args(b, offer_b, "rb", SRC, DST))
    assert got["ok"] and got["equal"], got
    offer = a.offer("ra2", SRC)
    got = decode.call("pull", **decode.pull_args(a, offer, "ra2", SRC, DST))
    assert got["ok"] and got["equal"], got
    assert a.call("wait_released", count=2, timeout=10)["releases"][-1]["ok"]
    assert held(a) == (0, 0, 0)
    assert decode.call("stats")["p2p"]["pull_failures"] == {}
