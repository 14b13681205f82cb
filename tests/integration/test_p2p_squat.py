"""A process squatting a p2p source's control port gets nothing it can use (issue 36): the
puller's proof of the control-plane token is bound to the address it dialed, so a squatter
that relays the real (restarted) prefill's challenge from its new port gets a proof the
real prefill refuses (reason ``auth``, no pair made); what the squatter recorded holds no
token. Real processes: a prefill and a decode ``p2p_worker``, and a squatter
(``p2p_squatter.py``) that records every byte the decode sends it and relays the rest."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.integration.p2p_support import REPO

pytestmark = pytest.mark.timeout(180)

TOKEN = "the-control-plane-token"


def test_a_squatter_relaying_to_the_real_prefill_is_refused(workers: Any, tmp_path: Path) -> None:
    prefill = workers("prefill", seed=51, token=TOKEN)
    decode = workers("decode", seed=52, token=TOKEN)
    record = tmp_path / "squatter.bin"
    squatter = subprocess.Popen(
        [sys.executable, "-m", "tests.integration.p2p_squatter", str(record), prefill.address],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert squatter.stdout is not None
        squatted = squatter.stdout.readline().strip()
        src, dst = [1, 2, 3], [4, 5, 6]
        offer = prefill.offer("r1", src)
        # The handle names the old address, which the squatter holds now.
        args = {**decode.pull_args(prefill, offer, "r1", src, dst), "address": squatted}
        got = decode.call("pull", **args)
        assert not got["ok"] and got["reason"] == "auth" and got["loaded"] == 0, got
        stats = prefill.call("stats")
        assert stats["p2p"]["pairs_made"] == 0 and stats["p2p"]["pull_failures"] == {"auth": 1}
        seen = record.read_bytes()
        assert b'"op":"hello"' in seen and TOKEN.encode() not in seen
        # The lease is untouched: the decode that dials the prefill itself gets the blocks.
        got = decode.call("pull", **decode.pull_args(prefill, offer, "r1", src, dst))
        assert got["ok"] and got["loaded"] == len(src) and got["equal"], got
    finally:
        squatter.kill()
        squatter.wait(timeout=10)
