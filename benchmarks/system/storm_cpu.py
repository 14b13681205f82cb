"""Where the CPU goes in an abort storm (issue 24; docs/router.md "Garbage collection").

    python -m benchmarks.system.storm_cpu

Starts ``pdserve up`` (1 prefill, 1 decode, fs connector, the chaos benchmark's tiny
model and flags), runs one unrelated stream after another (chaos's ``StallWatch``), then
the chaos attacker's storm (500 streams dropped after their first chunk, at the lowest
CPU priority) ``--storms`` times, and records for each storm its wall time and the CPU
seconds the router, the prefill and the decode spent during it (from /proc), beside the
unrelated streams' first tokens and worst gap. Writes
benchmarks/results/system/storm_cpu.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.record import recorded_command, result_path
from benchmarks.system.chaos import build_model, up_argv
from benchmarks.system.chaos_cluster import Cluster
from benchmarks.system.chaos_inputs import StallWatch
from benchmarks.system.process_cpu import cpu_seconds
from benchmarks.system.system_overhead_paths import PdserveUp


async def one_storm(cluster: Cluster, model: str, pids: dict[str, int]) -> dict[str, Any]:
    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    start = time.monotonic()
    attack = await asyncio.create_subprocess_exec(
        "nice", "-n", "19", sys.executable, "-m", "benchmarks.system.chaos_attack",
        "abort_storm", json.dumps({"base": cluster.base, "model": model}),
        stdout=subprocess.PIPE,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(attack.communicate(), timeout=300)
    wall = time.monotonic() - start
    spent = {name: round(cpu_seconds(pid) - before[name], 2) for name, pid in pids.items()}
    return {"wall_s": round(wall, 2), "cpu_s": spent, "attack": json.loads(out)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="storm-") as tmp:
        model = build_model(Path(tmp) / "tiny-llama")
        up_args = argparse.Namespace(prefill=1, decode=1, connector="fs",
                                     kv_path=Path(tmp) / "kv", log_dir=None)  # fmt: skip
        with PdserveUp(up_argv(model, up_args), 180) as up:
            assert up.proc is not None
            cluster = Cluster(f"http://127.0.0.1:{up.port}", up.lines, up.proc.pid)
            pids = {name.split("-")[0]: int(c["pid"]) for name, c in cluster.children().items()}
            quiet = StallWatch(cluster.base, str(model))
            quiet.start()
            await asyncio.sleep(args.quiet_seconds)
            undisturbed = await quiet.stop()
            storms = []
            for _ in range(args.storms):
                watch = StallWatch(cluster.base, str(model))
                watch.start()
                storm = await one_storm(cluster, str(model), pids)
                await asyncio.sleep(1.0)  # the tail of the storm's aborts
                storms.append(storm | {"unrelated_stream": await watch.stop()})
    return {"benchmark": "storm_cpu", "command": recorded_command("benchmarks.system.storm_cpu"),
            "host": {"platform": platform.platform(), "cpus": os.cpu_count()},
            "undisturbed": undisturbed, "storms": storms}  # fmt: skip


def markdown(report: dict[str, Any]) -> str:
    quiet = report["undisturbed"]
    lines = [f"`{report['command']}` ({report['host']['platform']}, {report['host']['cpus']} CPUs)\n",
             f"Undisturbed: first token p50 {quiet['first_token_p50_s']} s, worst "
             f"{quiet['first_token_worst_s']} s; worst gap {quiet['worst_stall_s']} s.\n",
             "| storm | wall s | router CPU s | prefill CPU s | decode CPU s "
             "| first token p50 / worst s | worst gap s |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for i, s in enumerate(report["storms"], 1):
        cpu, w = s["cpu_s"], s["unrelated_stream"]
        lines.append(f"| {i} | {s['wall_s']} | {cpu.get('router')} | {cpu.get('prefill')} "
                     f"| {cpu.get('decode')} | {w['first_token_p50_s']} / {w['first_token_worst_s']} "
                     f"| {w['worst_stall_s']} |")  # fmt: skip
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--storms", type=int, default=3)
    ap.add_argument("--quiet-seconds", type=float, default=5.0)
    ap.add_argument("--out", default=str(result_path("system", "storm_cpu.json")))
    args = ap.parse_args()
    report = asyncio.run(run(args))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
