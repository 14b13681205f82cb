"""p2p transport between two real processes over gloo: blocks arrive bit for bit, leases end
exactly once (pulled, expired, aborted) and the blocks-held gauge returns to 0.

Each side is a ``tests.integration.p2p_worker`` child (see ``p2p_support``); the caches are
random from a seed, so the puller checks what it received against the source's seed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.integration.p2p_support import LAYOUT, Worker, wait_for

pytestmark = pytest.mark.timeout(180)

# 2 layers x 2 x 16 tokens x 2 heads x 8 dims x 4 bytes = 2 KiB a block: 3 blocks a batch.
BATCH = 6 * 1024


def held(w: Worker) -> tuple[int, int]:
    """(leases held, blocks held) on ``w``."""
    p2p = w.call("stats")["p2p"]
    return p2p["leases_held"], p2p["blocks_held"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_pull_is_bit_exact_and_ends_the_lease(workers: Any, dtype: str) -> None:
    layout = {**LAYOUT, "dtype": dtype}
    prefill = workers("prefill", seed=11, layout=layout, batch_bytes=BATCH)
    decode = workers("decode", seed=12, layout=layout, batch_bytes=BATCH)
    src, dst = [1, 3, 5, 7, 9, 11, 13], [30, 2, 4, 6, 8, 10, 0]
    offer = prefill.offer("r1", src)
    assert offer["held"] and offer["transfer_id"].startswith("r1.")
    assert held(prefill) == (1, len(src))

    got = decode.call("pull", **decode.pull_args(prefill, offer, "r1", src, dst))
    assert got["ok"] and got["loaded"] == len(src) and got["equal"], got
    assert got["bytes"] == len(src) * 2 * 2 * 16 * 2 * 8 * (2 if dtype == "bfloat16" else 4)

    stats = prefill.call("wait_released", count=1, timeout=10)
    assert stats["releases"] == [{"request_id": "r1", "ok": True, "reason": None}]
    assert (stats["p2p"]["leases_held"], stats["p2p"]["blocks_held"]) == (0, 0)
    assert stats["generic"]["blocks_saved"] == len(src)  # sent blocks count as saved

    # Pulled once: a second pull (a retried decode) is refused, and the link stays usable.
    again = decode.call("pull", **decode.pull_args(prefill, offer, "r1", src, dst))
    assert not again["ok"] and again["reason"] == "missing" and again["loaded"] == 0
    offer2 = prefill.offer("r2", src)
    got2 = decode.call("pull", **decode.pull_args(prefill, offer2, "r2", src, dst))
    assert got2["ok"] and got2["equal"]
    assert decode.call("stats")["p2p"]["pairs_made"] == 1  # one pair for all three pulls


def test_partial_pull_and_mismatched_prompt(workers: Any) -> None:
    prefill = workers("prefill", seed=21, batch_bytes=BATCH)
    decode = workers("decode", seed=22, batch_bytes=BATCH)
    src, dst = [2, 4, 6, 8, 10], [1, 3, 5, 7, 9]
    offer = prefill.offer("p", src)
    # Blocks 0-1 are in the decode's prefix cache already: only 2.. travel.
    got = decode.call("pull", **decode.pull_args(prefill, offer, "p", src, dst, start_block=2))
    assert got["ok"] and got["loaded"] == 3 and got["equal"], got

    # A decode request whose prompt differs (other hashes from block 0) gets nothing.
    offer = prefill.offer("q", src)
    args = decode.pull_args(prefill, offer, "q", src, dst)
    args["hashes"] = args["hashes"][:2] + ["00" * 32] * 3
    got = decode.call("pull", **args)
    assert not got["ok"] and got["loaded"] == 2 and got["reason"] == "mismatch", got
    stats = prefill.call("wait_released", count=2, timeout=10)  # done either way: the decode
    assert stats["p2p"]["blocks_held"] == 0  # recomputes what it did not get


def test_lease_expiry_frees_blocks(workers: Any) -> None:
    prefill = workers("prefill", seed=31, lease_s=1.0)
    decode = workers("decode", seed=32)
    offer = prefill.offer("x", [1, 2, 3])
    assert held(prefill) == (1, 3)
    stats = prefill.call("wait_released", count=1, timeout=15)
    assert stats["releases"] == [{"request_id": "x", "ok": False, "reason": "expired"}]
    assert (stats["p2p"]["leases_held"], stats["p2p"]["blocks_held"]) == (0, 0)
    got = decode.call("pull", **decode.pull_args(prefill, offer, "x", [1, 2, 3], [4, 5, 6]))
    assert not got["ok"] and got["reason"] == "missing"


def test_abort_before_pull(workers: Any) -> None:
    prefill = workers("prefill", seed=41)
    decode = workers("decode", seed=42)
    offer = prefill.offer("a", [1, 2, 3])
    assert prefill.call("abort", request_id="a")["found"]
    assert not prefill.call("abort", request_id="a")["found"]  # ends exactly once
    stats = prefill.call("wait_released", count=1, timeout=10)
    assert stats["releases"] == [{"request_id": "a", "ok": False, "reason": "aborted"}]
    assert stats["p2p"]["blocks_held"] == 0
    got = decode.call("pull", **decode.pull_args(prefill, offer, "a", [1, 2, 3], [4, 5, 6]))
    assert not got["ok"] and got["reason"] == "missing" and got["loaded"] == 0


def test_abort_during_pull_voids_the_data(workers: Any, tmp_path: Path) -> None:
    marker = tmp_path / "sending"
    prefill = workers(
        "prefill", seed=51, batch_bytes=BATCH, slow_tag=1, slow_s=2.0, marker=str(marker)
    )
    decode = workers("decode", seed=52, batch_bytes=BATCH)
    src = [1, 2, 3, 4, 5, 6, 7]
    offer = prefill.offer("m", src)
    decode.send("pull", **decode.pull_args(prefill, offer, "m", src, [8, 9, 10, 11, 12, 13, 14]))
    wait_for(marker, 30)  # batch 0 sent, batch 1 about to go: the lease is pinned
    assert prefill.call("abort", request_id="m")["found"]
    assert held(prefill) == (1, len(src))  # still held: the pull in progress reads them
    got = decode.reply(30)
    assert not got["ok"] and got["reason"] == "aborted" and got["loaded"] == 0, got
    stats = prefill.call("wait_released", count=1, timeout=10)
    assert stats["releases"] == [{"request_id": "m", "ok": False, "reason": "aborted"}]
    assert stats["p2p"]["blocks_held"] == 0
