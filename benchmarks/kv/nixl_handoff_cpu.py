"""nixl beside p2p (gloo) on the CPU: the handoff of a long prompt between two processes.

    python -m benchmarks.kv.nixl_handoff_cpu    # writes benchmarks/results/kv/nixl_handoff_cpu.{json,md}

Each connector runs in two ``tests.integration.p2p_worker`` children (DRAM pools of the
Llama-3.1-8B KV shape: 32 layers, 8 KV heads x 128, bf16, 16-token blocks = 2 MiB a block).
A handoff is timed on the decode side from ``start_load`` to its result: for nixl the pin
round trip and the READ of scattered blocks into scattered blocks; for p2p the pull
request, the gather into staging, gloo's send/recv and the scatter. The first pull of each
size also forms the pair (nixl: loads the peer's metadata, UCX connects) and is reported
apart; then the median of ``--repeats``. The first pull of each size is checked bit for bit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.record import recorded_command, result_path
from tests.integration.p2p_support import LAYOUT, Worker

SHAPE = {**LAYOUT, "dtype": "bfloat16", "num_layers": 32, "num_kv_heads": 8, "head_dim": 128}
BLOCK_BYTES = 32 * 2 * 16 * 8 * 128 * 2


def measure(connector: str, sizes: list[int], repeats: int, tmp: Path) -> list[dict[str, Any]]:
    blocks = max(sizes) + 4
    while blocks % 7 == 0 or blocks % 11 == 0:  # strides 7 and 11 must visit every block
        blocks += 1
    cfg = {"connector": connector, "layout": SHAPE, "num_blocks": blocks, "timeout_s": 120.0}
    prefill = Worker(tmp, f"{connector}-prefill", seed=1, **cfg)
    decode = Worker(tmp, f"{connector}-decode", seed=2, **cfg)
    rows = []
    try:
        for n in sizes:
            src = [(7 * i) % blocks for i in range(n)]  # scattered, as a real request's are
            dst = [(11 * i + 3) % blocks for i in range(n)]
            times = []
            for rep in range(repeats + 1):
                rid = f"{connector}-{n}-{rep}"
                offer = prefill.offer(rid, src)
                pull = decode.pull_args(prefill, offer, rid, src, dst)
                if rep:
                    pull.pop("src_seed")
                got = decode.call("pull", timeout=300, **pull)
                assert got["ok"] and got["loaded"] == n, got
                assert rep or got["equal"], got
                times.append(got["seconds"])
            med = statistics.median(times[1:])
            rows.append(
                {
                    "connector": connector if connector == "nixl" else "p2p (gloo)",
                    "blocks": n,
                    "tokens": n * 16,
                    "mib": n * BLOCK_BYTES / 2**20,
                    "first_ms": round(times[0] * 1e3, 1),
                    "handoff_ms_p50": round(med * 1e3, 1),
                    "gb_s": round(n * BLOCK_BYTES / med / 1e9, 2),
                    "seconds": times,
                }
            )
    finally:
        prefill.stop()
        decode.stop()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--connectors", default="nixl,p2p")
    p.add_argument("--blocks", default="32,256", help="prompt sizes in blocks (256 = 4k tokens)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default=str(result_path("kv", "nixl_handoff_cpu.json")))
    p.add_argument("--md", default=str(result_path("kv", "nixl_handoff_cpu.md")))
    args = p.parse_args()
    sizes = [int(x) for x in args.blocks.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.connectors.split(","):
            rows += measure(name, sizes, args.repeats, Path(tmp))
    command = recorded_command("benchmarks.kv.nixl_handoff_cpu")
    lines = [
        "# nixl beside p2p (gloo) on the CPU: handoff of a long prompt, two processes",
        "",
        f"`{command}`",
        "",
        "Llama-3.1-8B KV shape (2 MiB a block, bf16), DRAM pools; decode-side time from",
        "start_load to the result; median of the repeats after the first (which forms the pair).",
        "",
        "| connector | tokens | MiB | first ms | handoff p50 ms | GB/s |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['connector']} | {r['tokens']} | {r['mib']:.0f} | {r['first_ms']} | "
            f"{r['handoff_ms_p50']} | {r['gb_s']} |"
        )
    md = "\n".join(lines) + "\n"
    print(md)
    Path(args.md).write_text(md)
    Path(args.json).write_text(
        json.dumps({"command": command, "args": vars(args), "results": rows}, indent=2) + "\n"
    )


if __name__ == "__main__":
    main()
