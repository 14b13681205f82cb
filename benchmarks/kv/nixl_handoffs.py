"""Many nixl handoffs between two real processes with aborts mixed in: nothing leaks.

    python -m benchmarks.kv.nixl_handoffs --handoffs 1000
        # writes benchmarks/results/kv/nixl_handoffs_cpu.{json,md}

The prefill and decode sides are ``tests.integration.p2p_worker`` children (DRAM pools,
the connector as the services run it); in waves of 8, each request's blocks are offered,
every third is aborted on the prefill before its decode comes, and the wave is pulled at
once (the pulls overlap). At the end the prefill must hold no lease, pin and block, every
lease must have ended once (pulled or aborted), and the decode side must count exactly the
aborted ones as refused. ``make test`` runs the same check scaled to 60 handoffs
(tests/integration/test_nixl_transport.py); through the real services and the router the
pools' free-block counts are checked in tests/integration/test_nixl_router.py.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from benchmarks.record import recorded_command, result_path
from tests.integration.p2p_support import Worker

WAVE = 8


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--handoffs", type=int, default=1000)
    p.add_argument("--json", default=str(result_path("kv", "nixl_handoffs_cpu.json")))
    p.add_argument("--md", default=str(result_path("kv", "nixl_handoffs_cpu.md")))
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cfg = {"connector": "nixl", "token": "bench", "num_blocks": 64}
        prefill = Worker(Path(tmp), "prefill", seed=1, **cfg)
        decode = Worker(Path(tmp), "decode", seed=2, **cfg)
        try:
            result = _run(prefill, decode, args.handoffs)
        finally:
            prefill.stop()
            decode.stop()
    result["command"] = recorded_command("benchmarks.kv.nixl_handoffs")
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    md = (
        f"# nixl: {result['handoffs']} handoffs with aborts mixed in (CPU, DRAM, 2 processes)\n\n"
        f"`{result['command']}`\n\n| handoffs | pulled | aborted | seconds | prefill leases / "
        "pinned / blocks held after | decode refusals | leaked |\n|---|---|---|---|---|---|---|\n"
        f"| {result['handoffs']} | {result['pulled']} | {result['aborted']} | "
        f"{result['seconds']:.1f} | {result['held_after']} | {result['decode_failures']} | "
        f"{result['leaked']} |\n"
    )
    Path(args.md).write_text(md)
    print(md)


def _run(prefill: Worker, decode: Worker, handoffs: int) -> dict:
    aborted = pulled = failed = 0
    t0 = time.perf_counter()
    for wave in range(handoffs // WAVE):
        pulls = []
        for k in range(WAVE):
            rid = f"w{wave}.{k}"
            src = [(wave * 3 + k * 4 + i) % 64 for i in range(4)]
            offer = prefill.offer(rid, src)
            if k % 3 == 2:
                prefill.call("abort", request_id=rid)
                aborted += 1
            pulls.append(decode.pull_args(prefill, offer, rid, src, [k * 4 + i for i in range(4)]))
        for pull in pulls:
            pull.pop("src_seed")  # bytes are checked in the tests; here only the books
        for got in decode.call("pull_many", pulls=pulls, timeout=120)["pulls"]:
            pulled += bool(got["ok"])
            failed += not got["ok"] and got["reason"] != "missing"
    seconds = time.perf_counter() - t0
    done = pulled + aborted
    stats = prefill.call("wait_released", count=done, timeout=60)
    p2p = stats["p2p"]
    held = (p2p["leases_held"], p2p["leases_pinned"], p2p["blocks_held"])
    reasons = [r["reason"] for r in stats["releases"]]
    leaked = held != (0, 0, 0) or len(reasons) != done or failed > 0
    return {
        "handoffs": done,
        "pulled": pulled,
        "aborted": aborted,
        "seconds": seconds,
        "held_after": "/".join(map(str, held)),
        "lease_ends": {r or "pulled": reasons.count(r) for r in set(reasons)},
        "decode_failures": decode.call("stats")["p2p"]["pull_failures"],
        "leaked": leaked,
    }


if __name__ == "__main__":
    main()
