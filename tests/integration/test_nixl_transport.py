"""nixl transport between two real processes (DRAM pools, UCX): blocks arrive bit for bit,
many pulls overlap, leases end exactly once (pulled, aborted, expired), nothing stays held,
and the three deaths — abort, decode, prefill — in the middle of a pull end within a
deadline. Each side is a ``tests.integration.p2p_worker`` child with ``connector="nixl"``;
"in the middle" is held open by the prefill side pausing after it pinned a lease (the
decode side is then waiting to READ).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integration.p2p_support import LAYOUT, Worker, wait_for

pytestmark = [
    pytest.mark.timeout(240),
]
NIXL = {"connector": "nixl", "token": "s3cret"}
SRC, DST = [1, 3, 5, 7, 9, 11, 13], [30, 2, 4, 6, 8, 10, 0]
LEAK_HANDOFFS = 60  # scaled for make test; benchmarks/kv/nixl_handoffs.py runs 1,000


def held(w: Worker) -> tuple[int, int, int]:
    """(leases held, pinned, blocks held) on ``w``."""
    p = w.call("stats")["p2p"]
    return p["leases_held"], p["leases_pinned"], p["blocks_held"]


def test_overlapping_pulls_are_bit_exact(workers: Any) -> None:
    layout = {**LAYOUT, "dtype": "bfloat16"}
    prefill = workers("prefill", seed=11, layout=layout, **NIXL)
    decode = workers("decode", seed=12, layout=layout, **NIXL)
    assert prefill.address.startswith("nixl:")
    pulls = []
    for k in range(4):  # disjoint source and destination blocks, pulled at once
        src, dst = [k * 7 + i for i in range(7)], [31 - k * 7 - i for i in range(7)]
        offer = prefill.offer(f"r{k}", src)
        pulls.append(decode.pull_args(prefill, offer, f"r{k}", src, dst))
    got = decode.call("pull_many", pulls=pulls)["pulls"]
    assert all(g["ok"] and g["loaded"] == 7 and g["equal"] for g in got), got
    assert got[0]["bytes"] == 7 * 2 * 2 * 16 * 2 * 8 * 2
    stats = prefill.call("wait_released", count=4, timeout=10)
    assert sorted(r["request_id"] for r in stats["releases"] if r["ok"]) == ["r0", "r1", "r2", "r3"]
    assert held(prefill) == (0, 0, 0)

    # Pulled once: a retried pull is refused (stale), and the pair still works.
    again = decode.call("pull", **pulls[0])
    assert not again["ok"] and again["reason"] == "missing" and again["loaded"] == 0
    # A decode that needs none of the blocks (all cached) still releases the hold at once.
    offer = prefill.offer("none", SRC)
    got = decode.call("pull", **decode.pull_args(prefill, offer, "none", SRC, DST, start_block=7))
    assert got["ok"] and got["loaded"] == 0 and got["bytes"] == 0, got
    assert prefill.call("wait_released", count=5, timeout=10)["releases"][-1]["ok"]
    assert held(prefill) == (0, 0, 0)


def test_a_peer_without_the_token_is_refused(workers: Any) -> None:
    prefill = workers("prefill", seed=1, **NIXL)
    rogue = workers("rogue", seed=2, connector="nixl", token="wrong", timeout_s=3.0)
    offer = prefill.offer("t", SRC)
    got = rogue.call("pull", **rogue.pull_args(prefill, offer, "t", SRC, DST))
    # Its notifications are dropped unanswered: it gets nothing, by its deadline.
    assert not got["ok"] and got["loaded"] == 0 and got["reason"] == "timeout", got
    assert prefill.call("stats")["p2p"]["pull_failures"].get("auth", 0) >= 1
    assert held(prefill) == (1, 0, len(SRC))  # still held for the genuine decode
    decode = workers("decode", seed=3, **NIXL)
    got = decode.call("pull", **decode.pull_args(prefill, offer, "t", SRC, DST))
    assert got["ok"] and got["equal"], got


def test_abort_mid_transfer(workers: Any, tmp_path: Path) -> None:
    marker = tmp_path / "pinned"
    prefill = workers("prefill", seed=1, slow_s=1.5, marker=str(marker), **NIXL)
    decode = workers("decode", seed=2, **NIXL)
    offer = prefill.offer("a", SRC)
    decode.send("pull", **decode.pull_args(prefill, offer, "a", SRC, DST))
    wait_for(marker, 30)
    assert prefill.call("abort", request_id="a")["found"]
    # The pinned blocks were kept until the READ was done: the data is whole...
    got = decode.reply(30)
    assert got["ok"] and got["equal"], got
    # ...and the lease then ended as the abort, freeing them.
    stats = prefill.call("wait_released", count=1, timeout=10)
    assert stats["releases"] == [{"request_id": "a", "ok": False, "reason": "aborted"}]
    assert held(prefill) == (0, 0, 0)


def test_decode_killed_mid_transfer_frees_at_lease_end(workers: Any, tmp_path: Path) -> None:
    marker = tmp_path / "pinned"
    prefill = workers(
        "prefill", seed=1, lease_s=4.0, timeout_s=2.0, slow_s=0.5, marker=str(marker), **NIXL
    )
    decode = workers("decode", seed=2, **NIXL)
    offer = prefill.offer("d", SRC)
    decode.send("pull", **decode.pull_args(prefill, offer, "d", SRC, DST))
    wait_for(marker, 30)
    decode.kill()
    stats = prefill.call("wait_released", count=1, timeout=30)
    assert stats["releases"] == [{"request_id": "d", "ok": False, "reason": "expired"}]
    assert held(prefill) == (0, 0, 0)

    decode2 = workers("decode2", seed=4, **NIXL)  # the prefill keeps serving others
    offer = prefill.offer("d2", SRC)
    got = decode2.call("pull", **decode2.pull_args(prefill, offer, "d2", SRC, DST))
    assert got["ok"] and got["equal"], got


def test_prefill_killed_mid_transfer(workers: Any, tmp_path: Path) -> None:
    marker = tmp_path / "pinned"
    prefill = workers("prefill", seed=1, slow_s=60.0, marker=str(marker), **NIXL)
    decode = workers("decode", seed=2, timeout_s=4.0, **NIXL)
    offer = prefill.offer("k", SRC)
    decode.send("pull", **decode.pull_args(prefill, offer, "k", SRC, DST))
    wait_for(marker, 30)
    prefill.kill()
    got = decode.reply(30)  # the guard: a pull past its 4 s deadline would hang here
    assert not got["ok"] and got["loaded"] == 0 and got["reason"] == "timeout", got

    other = workers("prefill2", seed=3, **NIXL)  # another prefill: the decode reads from it
    offer = other.offer("k2", SRC)
    got = decode.call("pull", **decode.pull_args(other, offer, "k2", SRC, DST))
    assert got["ok"] and got["equal"], got


def test_many_handoffs_with_aborts_leave_nothing_held(workers: Any) -> None:
    prefill = workers("prefill", seed=1, **NIXL)
    decode = workers("decode", seed=2, **NIXL)
    aborted = pulled = 0
    for wave in range(LEAK_HANDOFFS // 6):
        pulls = []
        for k in range(6):
            rid = f"w{wave}.{k}"
            src = [(wave * 6 + k + i) % 32 for i in range(4)]
            offer = prefill.offer(rid, src)
            if k % 3 == 2:  # every third is aborted before its decode comes
                assert prefill.call("abort", request_id=rid)["found"]
                aborted += 1
            pulls.append(decode.pull_args(prefill, offer, rid, src, [k * 4 + i for i in range(4)]))
        for k, got in enumerate(decode.call("pull_many", pulls=pulls)["pulls"]):
            if k % 3 == 2:
                assert not got["ok"] and got["reason"] == "missing", got
            else:
                assert got["ok"] and got["equal"], got
                pulled += 1
    stats = prefill.call("wait_released", count=LEAK_HANDOFFS, timeout=30)
    reasons = [r["reason"] for r in stats["releases"]]
    assert reasons.count(None) == pulled and reasons.count("aborted") == aborted
    assert held(prefill) == (0, 0, 0)
    assert decode.call("stats")["p2p"]["pull_failures"] == {"missing": aborted}
