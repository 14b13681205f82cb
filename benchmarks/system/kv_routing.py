"""Routing on held blocks (issue 30): the guessing index against the event index (and the
event index with the engines' host-memory KV tier), under a multi-turn chat workload.

For each topology (1 prefill + 2 decode in ``auto`` mode, and 2 colocated replicas) and
each index, this starts ``pdserve up`` with ``prefix_aware`` on both pools, runs
``pdserve bench serve --dataset-name chat`` against it (shared system prompts, growing
conversations; ``pdserve/bench/workloads_chat.py``) and records the prefix-cache hit rate
(the prompt tokens the engines served from cache, as the router reports them in
``usage.prompt_tokens_details.cached_tokens``), TTFT p50/p99 and throughput, side by side.
The KV pools are kept small so that the conversations do not all fit: the guessing index
then believes in blocks that were evicted.

    python -m benchmarks.system.kv_routing                  # the committed CPU run
    python3 -m benchmarks.system.kv_routing --device cuda --model DIR --kv-cache-memory 2Gi \
        --up-flags "--load-format dummy --dtype bfloat16" --out .../kv_routing_h200.json

Writes ``benchmarks/results/system/kv_routing_cpu.json`` and ``.md`` (``--out``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import secrets
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.record import recorded_command, result_path
from benchmarks.system import kv_routing_routers as two
from benchmarks.system.system_overhead_paths import PdserveUp
from pdserve.bench.metrics import Summary, summarize
from pdserve.bench.serve import ServeConfig, run_serve
from pdserve.bench.serve_client import Target
from pdserve.bench.serve_runner import LoadSpec
from pdserve.bench.workloads import WorkloadSpec, build_prompts, load_codec
from pdserve.procs import free_ports

INDEXES = {
    "guess": ["--prefix-index", "guess"],
    "events": ["--prefix-index", "events"],
    "events+host": ["--prefix-index", "events"],  # plus the engines' host tier flag below
    # the event index alone: routes do not stand in for events not reported yet
    "events-only": ["--prefix-index", "events", "--kv-pending-window", "0"],
}
TOPOLOGIES = {
    "1P+2D": ["--mode", "auto", "--prefill", "1", "--decode", "2"],
    "2 colocated": ["--mode", "colocated", "--prefill", "0", "--decode", "2"],
    # the same, behind two routers (turns alternate): what one router placed, the other
    # finds only through the events (benchmarks/system/kv_routing_routers.py)
    "2 colocated x 2 routers": ["--mode", "colocated", "--prefill", "0", "--decode", "2"],
}
ROUTER_FLAGS = ["--decode-policy", "prefix_aware", "--prefill-policy", "prefix_aware"]


def up_argv(args: argparse.Namespace, topology: str, index: str, port: int) -> list[str]:
    argv = [
        *[sys.executable, "-m", "pdserve", "up", "--model", args.model, "--port", str(port)],
        *TOPOLOGIES[topology],
        *INDEXES[index],
        *ROUTER_FLAGS,
        *["--kv-cache-memory", args.kv_cache_memory, "--device", args.device],
        *["--shutdown-grace", "10"],
    ]
    if args.device == "cpu":
        argv += ["--torch-threads", "1"]
    if index == "events+host":
        argv += args.host_tier_flags.split()
    return argv + args.up_flags.split()


def model_path(name: str) -> str:
    from common.models import resolve_model

    return str(resolve_model(name))


async def one_run(args: argparse.Namespace, topology: str, index: str) -> dict[str, Any]:
    (port,) = free_ports(1)
    argv = up_argv(args, topology, index, port)
    with PdserveUp(argv, args.startup_timeout) as up:
        target = Target(
            base_url=f"http://127.0.0.1:{up.port}",
            model=args.model,
            timeout_s=args.request_timeout,
            request_timings=True,
        )
        workload = WorkloadSpec(
            kind="chat",
            num_prompts=args.num_prompts,
            input_len=args.input_len,
            output_len=args.output_len,
            prefix_len=args.prefix_len,
            num_prefixes=args.num_prefixes,
            num_turns=args.num_turns,
            seed=args.seed,
        )
        load = LoadSpec(max_concurrency=args.max_concurrency, max_requests=args.num_prompts)
        config = ServeConfig(target, workload, load, tokenizer=args.model, progress=False)
        started = time.perf_counter()
        if topology.endswith("2 routers"):
            summary = await _two_routers(args, up, index, target, workload)
        else:
            (rate_run,) = await run_serve(config)
            summary = rate_run.summary
        return {
            "topology": topology,
            "index": index,
            "up_argv": argv[2:],
            "wall_s": round(time.perf_counter() - started, 1),
            "loadavg": os.getloadavg(),
            "summary": summary.to_dict(),
        }


async def _two_routers(
    args: argparse.Namespace, up: PdserveUp, index: str, target: Target, workload: WorkloadSpec
) -> Summary:
    codec = load_codec(args.model)
    prompts = build_prompts(workload, codec)
    conversations = math.ceil(workload.num_prompts / workload.num_turns)
    flags = [*ROUTER_FLAGS, *INDEXES[index], "--mode", "colocated"]
    instances = two.instances_file(up.lines)
    with two.second_router(args.model, instances, flags, args.startup_timeout) as url:
        targets = [target, two.with_base(target, url)]
        records, duration = await two.alternate(
            targets, prompts, conversations, args.max_concurrency, codec
        )
    return summarize(records, duration, None)


def markdown(doc: dict[str, Any]) -> str:
    lines = [
        "# Routing on held blocks: guessing index vs event index",
        "",
        f"{doc['date']}, {doc['machine']}; command: `{doc['command']}`",
        "",
        f"Workload: {doc['workload']}",
        "",
        "| topology | index | done | prefix hit rate | TTFT p50 (ms) | TTFT p99 (ms) | "
        "req/s | out tok/s | load avg |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["runs"]:
        s = r["summary"]
        ttft = s["ttft_ms"] or {}
        lines.append(
            f"| {r['topology']} | {r['index']} | {s['completed']}/{s['completed'] + s['failed']} "
            f"| {s['prefix_hit_rate']:.3f} | {ttft.get('p50', 0):.0f} | {ttft.get('p99', 0):.0f} "
            f"| {s['request_throughput']:.3f} | {s['output_throughput']:.2f} "
            f"| {r['loadavg'][0]:.1f} |"
        )
    if doc.get("skipped"):
        lines += ["", f"Not run: {doc['skipped']}"]
    return "\n".join(lines) + "\n"


def host_tier_available(flags: str) -> bool:
    """Whether the engines accept the host-tier flags (the engine side may not have it)."""
    flag = flags.split()[0] if flags.split() else ""
    if not flag:
        return False
    out = subprocess.run(
        [sys.executable, "-m", "pdserve", "decode", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    return flag in out.stdout


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    args.model = model_path(args.model)
    indexes = [i for i in args.indexes.split(",") if i]
    skipped = ""
    if "events+host" in indexes and not host_tier_available(args.host_tier_flags):
        indexes.remove("events+host")
        skipped = f"events+host (the engines have no {args.host_tier_flags.split()[0]} flag)"
    runs = []
    for topology in args.topologies.split(","):
        for index in indexes:
            print(f"== {topology} / {index}", flush=True)
            run = await one_run(args, topology, index)
            s = run["summary"]
            print(
                f"   hit rate {s['prefix_hit_rate']:.3f}, TTFT p50 {s['ttft_ms']['p50']:.0f} ms, "
                f"{s['completed']} done in {run['wall_s']} s",
                flush=True,
            )
            runs.append(run)
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": f"{os.cpu_count()} CPUs, {args.device}",
        "command": recorded_command("benchmarks.system.kv_routing"),
        "workload": (
            f"chat, {args.num_prompts} requests, {args.num_prefixes} system prompts of "
            f"{args.prefix_len} tokens, {args.num_turns} turns, user turns {args.input_len} "
            f"tokens, answers {args.output_len}, {args.max_concurrency} in flight; KV pool "
            f"{args.kv_cache_memory} per engine"
        ),
        "runs": runs,
        "skipped": skipped,
    }


def main(argv: list[str] | None = None) -> int:
    # One control-plane token for `pdserve up` and the second router of a two-router run.
    os.environ.setdefault("PDSERVE_GRPC_TOKEN", secrets.token_hex(16))
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--device", default="cpu")
    ap.add_argument(
        "--topologies", default=",".join(TOPOLOGIES), help="comma list of: " + ", ".join(TOPOLOGIES)
    )
    ap.add_argument("--indexes", default="guess,events,events+host")
    ap.add_argument("--host-tier-flags", default="--kv-offloading-size 256Mi",
                    help="engine flags that turn the host-memory KV tier on (events+host)")  # fmt: skip
    ap.add_argument("--kv-cache-memory", default="24Mi")
    ap.add_argument("--up-flags", default="", help="more `pdserve up` flags, e.g. for a GPU")
    ap.add_argument("--num-prompts", type=int, default=24)
    ap.add_argument("--num-prefixes", type=int, default=2)
    ap.add_argument("--prefix-len", type=int, default=96)
    ap.add_argument("--num-turns", type=int, default=3)
    ap.add_argument("--input-len", default="32")
    ap.add_argument("--output-len", default="8")
    ap.add_argument("--max-concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--request-timeout", type=float, default=300.0)
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--out", type=Path, default=result_path("system", "kv_routing_cpu.json"))
    args = ap.parse_args(argv)
    doc = asyncio.run(main_async(args))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    args.out.with_suffix(".md").write_text(markdown(doc), encoding="utf-8")
    print(markdown(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
