"""p2p failures between real processes: nothing hangs past a deadline, nothing leaks.

- the prefill process is killed mid-transfer → the pull fails fast (connection closed);
- the prefill process stalls (SIGSTOP) mid-transfer → the pull fails at its deadline;
- the decode process is killed mid-transfer → the prefill keeps serving and frees the
  blocks when the lease ends;
- after any of these the surviving side makes a new pair and the next transfer works.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.integration.p2p_support import wait_for

pytestmark = pytest.mark.timeout(240)

BATCH = 6 * 1024  # 3 blocks a batch (2 KiB blocks)
STALL_ATTEMPTS = 4
SRC, DST = [1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14]


def slow(marker: Path, seconds: float) -> dict[str, Any]:
    """Fault injection: the sender pauses before its second batch (see p2p_worker)."""
    return {"batch_bytes": BATCH, "slow_tag": 1, "slow_s": seconds, "marker": str(marker)}


def test_prefill_killed_mid_transfer(workers: Any, tmp_path: Path) -> None:
    marker = tmp_path / "sending"
    prefill = workers("prefill", seed=1, **slow(marker, 60.0))
    decode = workers("decode", seed=2, batch_bytes=BATCH, timeout_s=20.0)
    offer = prefill.offer("k", SRC)
    decode.send("pull", **decode.pull_args(prefill, offer, "k", SRC, DST))
    wait_for(marker, 30)
    prefill.kill()
    # The guard is the wait for the answer (its 20 s deadline would end it as "timeout"):
    # a dead peer must be noticed as "unreachable", not waited out.
    got = decode.reply(30)
    assert not got["ok"] and got["loaded"] == 0 and got["reason"] == "unreachable", got
    assert decode.call("stats")["p2p"]["pairs_torn_down"] == 1

    # A new prefill instance (another address): the decode side pairs with it at once.
    other = workers("prefill2", seed=3, batch_bytes=BATCH)
    offer = other.offer("k2", SRC)
    got = decode.call("pull", **decode.pull_args(other, offer, "k2", SRC, DST))
    assert got["ok"] and got["equal"], got


def test_stalled_prefill_fails_at_the_deadline(workers: Any, tmp_path: Path) -> None:
    marker = tmp_path / "sending"
    prefill = workers("prefill", seed=1, **slow(marker, 0.5))
    decode = workers("decode", seed=2, batch_bytes=BATCH, timeout_s=4.0)
    # The stop must land within the sender's 0.5 s pause (a longer one would also slow the
    # fresh pull below past its deadline); an attempt where it came after, on a loaded
    # machine, is a whole and correct pull, and is made again.
    for attempt in range(STALL_ATTEMPTS):
        marker.unlink(missing_ok=True)
        rid = f"s{attempt}"
        offer = prefill.offer(rid, SRC)
        decode.send("pull", **decode.pull_args(prefill, offer, rid, SRC, DST))
        wait_for(marker, 30)
        prefill.kill(signal.SIGSTOP)  # alive but silent: only the deadline ends the pull
        got = decode.reply(30)  # the guard: a pull that ignored its 4 s deadline would hang
        if not got["ok"]:
            break
        assert got["equal"], got
        prefill.kill(signal.SIGCONT)
    else:
        pytest.fail(f"the stop never landed mid-transfer in {STALL_ATTEMPTS} tries")
    assert got["loaded"] == 0 and got["reason"] == "timeout", got
    prefill.kill(signal.SIGCONT)
    pairs = decode.call("stats")["p2p"]["pairs_made"]
    end = time.monotonic() + 20  # the old pull's thread wakes, finds its pair gone, unpins
    while prefill.call("stats")["p2p"]["leases_pinned"] and time.monotonic() < end:
        time.sleep(0.1)

    # The prefill side saw its pair break; the lease is still held (the decode may come
    # back) and a fresh pull on a new pair succeeds.
    got = decode.call("pull", **decode.pull_args(prefill, offer, rid, SRC, DST))
    assert got["ok"] and got["equal"], got
    assert decode.call("stats")["p2p"]["pairs_made"] == pairs + 1


def test_decode_killed_mid_transfer_frees_at_lease_end(workers: Any, tmp_path: Path) -> None:
    marker = tmp_path / "sending"
    prefill = workers("prefill", seed=1, lease_s=4.0, **slow(marker, 1.0))
    decode = workers("decode", seed=2, batch_bytes=BATCH)
    offer = prefill.offer("d", SRC)
    decode.send("pull", **decode.pull_args(prefill, offer, "d", SRC, DST))
    wait_for(marker, 30)
    decode.kill()
    stats = prefill.call("wait_released", count=1, timeout=30)
    assert stats["releases"] == [{"request_id": "d", "ok": False, "reason": "expired"}]
    p2p = stats["p2p"]
    assert (p2p["leases_held"], p2p["leases_pinned"], p2p["blocks_held"]) == (0, 0, 0)
    assert p2p["pairs_torn_down"] == 1

    # The prefill keeps serving other decode instances.
    marker.unlink()
    decode2 = workers("decode2", seed=4, batch_bytes=BATCH)
    offer = prefill.offer("d2", SRC)
    got = decode2.call("pull", **decode2.pull_args(prefill, offer, "d2", SRC, DST))
    assert got["ok"] and got["equal"], got


def test_unreachable_source_fails_fast(workers: Any) -> None:
    decode = workers("decode", seed=2, timeout_s=5.0)
    from pdserve.procs import free_ports

    (port,) = free_ports(1)  # nothing listens there
    offer = {"address": f"127.0.0.1:{port}", "transfer_id": "gone.0"}
    # Refused at connect ("unreachable"), not waited out to the 5 s deadline ("timeout").
    got = decode.call("pull", **decode.pull_args(decode, offer, "gone", SRC, DST))
    assert not got["ok"] and got["reason"] == "unreachable", got
