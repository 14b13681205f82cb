"""Chaos benchmark: ``pdserve up`` (2 prefill + 2 decode, CPU, tiny Llama) over the redis,
fs or p2p connector under steady load from the official ``openai`` client while one fault
at a time is injected (issue 17, item 7).

Phases, in order, each ``--phase-seconds`` long:

- ``none`` (undisturbed); ``kill_*`` / ``stop_*``: SIGKILL, or SIGSTOP for
  ``--pause-seconds``, of ``decode-0``, ``prefill-0`` or the private redis-server, at
  ``--fault-at`` seconds (``pdserve up`` restarts what was killed; a paused child is
  always resumed);
- ``*_records`` (see ``chaos_poison.py``): both decode instances are restarted first (an
  empty prefix cache, so their next loads read the store), then a share of the records of
  the ``POISON_PROMPTS`` (in the store since the undisturbed run) is overwritten with
  garbage, forged (valid checksum, no MAC), replaced by a FIFO or grown past any record
  (fs), and the load runs on those prompts: the poison is read, must be refused and
  recomputed, and the output must stay identical;
- ``disconnect``: half the streams hang up after 1-8 chunks; afterwards every service must
  go back to idle (no request running, KV usage back to the baseline);
- ``squat_decode``, ``grpc_flood``, ``body_flood``, ``abort_storm``, ``grammar_bomb``
  (issue 24, ``chaos_inputs.py``); with ``--prefill 1``, ``kill_prefill`` is the
  single-prefill kill.

Every phase also records the worst gap between two chunks of an unrelated stream
(``unrelated_stream.worst_stall_s``; the ``none`` phase is its baseline) and each child's
RSS before and after (``rss_mib``).

Every request is greedy with a known expected output (each prompt run once, undisturbed,
before the phases). Per phase: requests sent / identical / wrong (must be 0) / failed with a
clear error / hung (no answer within ``--request-timeout``: must be 0), latencies, the time
until every instance is healthy again and until the first identical answer of a request
sent after the fault, and the router's and services' counters that moved. A soak reading
(RSS, open fds, KV gauges, temp files) is taken before the first and after the last phase.

    python -m benchmarks.system.chaos --connector redis   # writes results/system/chaos_redis.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import openai

from benchmarks.record import recorded_command, result_path
from benchmarks.system import chaos_poison
from benchmarks.system.chaos_cluster import (
    Cluster,
    counter_delta,
    inject_signal,
    restart_decodes,
    wait_until,
)
from benchmarks.system.chaos_inputs import INPUT_FAULTS, StallWatch, inject_input, rss_mib
from benchmarks.system.chaos_load import MODEL, load, one
from benchmarks.system.chaos_report import (
    Outcome,
    first_ok_after,
    markdown_table,
    settle_table,
    soak_table,
    summarize,
)
from benchmarks.system.system_overhead_paths import PdserveUp, build_model
from tests.servers import free_port

REPO = Path(__file__).resolve().parents[2]

SIGNAL_FAULTS = ("kill_decode", "stop_decode", "kill_prefill", "stop_prefill", "kill_redis", "stop_redis")  # fmt: skip
POISON_FAULTS = tuple(f"{k}_records" for k in chaos_poison.FS_KINDS)
FAULTS = ("none", *SIGNAL_FAULTS, *POISON_FAULTS, "disconnect", *INPUT_FAULTS)
DEFAULT_FAULTS = {
    "redis": ("none", *SIGNAL_FAULTS, "garbage_records", "forged_records", "disconnect"),
    "fs": ("none", *SIGNAL_FAULTS[:4], *POISON_FAULTS, "disconnect"),
    "p2p": ("none", *SIGNAL_FAULTS[:4], "disconnect"),
    "nixl": ("none", *SIGNAL_FAULTS[:4], "disconnect"),
}
WORDS = ["grey", "calm", "stormy", "silver", "dark", "quiet", "wide", "cold"] * 2
PROMPTS = [
    f"Story {i}: the keeper of the lighthouse looked out over the {w} sea and"
    for i, w in enumerate(WORDS)
]
# Longer prompts (several KV blocks each), used only by the poisoning phases.
POISON_PROMPTS = [
    f"Record {i}: on the {w} morning the harbour master wrote in the ledger that the ships "
    f"from the north had come in late, that the fishermen of the {w} bay were mending nets "
    f"on the quay, that the lamp oil was low again and that the keeper"
    for i, w in enumerate(WORDS)
]


def store_of(cluster: Cluster, args: argparse.Namespace) -> Path | str:
    """The fs store's directory, or the private redis-server's URL."""
    return args.kv_path if args.connector == "fs" else cluster.redis_url()


async def seed_records(base: str, expected: dict[str, str], args: argparse.Namespace) -> list[Outcome]:  # fmt: skip
    """Each poison prompt once, concurrently (the prefill instances save their records)."""
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0,
                                timeout=args.request_timeout)  # fmt: skip

    async def seed(p: str) -> Outcome:
        t0 = time.monotonic()
        try:
            text = await one(client, p, args.max_tokens)
        except (openai.APIError, httpx.HTTPError) as e:
            return Outcome(False, False, time.monotonic() - t0, type(e).__name__)
        return Outcome(True, text == expected[p], time.monotonic() - t0)

    try:
        return list(await asyncio.gather(*(seed(p) for p in POISON_PROMPTS)))
    finally:
        await client.close()


async def run_phase(
    cluster: Cluster, fault: str, expected: dict[str, str], args: argparse.Namespace, seed: int
) -> dict[str, Any]:
    poisoned: int | None = None
    prompts = POISON_PROMPTS if fault in POISON_FAULTS else PROMPTS
    seeded: dict[str, Any] | None = None
    if fault in POISON_FAULTS:
        # Records of every poison prompt in the store (a store restart may have emptied
        # it), then decode instances that have none of them cached, then the poison.
        await asyncio.to_thread(chaos_poison.clear_store, store_of(cluster, args))
        seeded = summarize(await seed_records(cluster.base, expected, args))
        await restart_decodes(cluster, args.recovery_timeout)
        poisoned = await asyncio.to_thread(
            chaos_poison.poison_store,
            store_of(cluster, args),
            fault,
            args.poison_share,
            1000 * seed,
        )
    before, svc_before = cluster.router_counters(), cluster.service_counters()
    start = time.monotonic()
    hit = start if fault in POISON_FAULTS else start + args.fault_at
    recovered: float | None = None
    injected: dict[str, Any] = {}
    rss_before = {n: rss_mib(int(c["pid"])) for n, c in cluster.children().items()}
    watch = StallWatch(cluster.base, MODEL[0])
    watch.start()

    async def fault_then_recovery() -> float | None:
        await asyncio.sleep(max(0.0, hit - time.monotonic()))
        if fault in SIGNAL_FAULTS:
            await inject_signal(cluster, fault, args.pause_seconds)
        if fault in INPUT_FAULTS:
            end = start + args.phase_seconds
            injected.update(await inject_input(cluster, fault, MODEL[0], end))
        if fault in POISON_FAULTS:
            repoison.append(asyncio.create_task(keep_poisoning()))
        await asyncio.sleep(0.5)
        waited = await wait_until(cluster.healthy, args.recovery_timeout)
        return None if waited is None else round(time.monotonic() - hit, 2)

    repoison: list[asyncio.Task[None]] = []

    async def keep_poisoning() -> None:
        # Again and again through the phase: a record rewritten by a prefill's save between
        # two rounds is poisoned again before some decode reads it (the prefill's save
        # replaces a FIFO or an oversized file at once, before any decode could read it).
        nonlocal poisoned
        n = 0
        while time.monotonic() < start + args.phase_seconds - args.repoison_every:
            await asyncio.sleep(args.repoison_every)
            n += 1
            got = await asyncio.to_thread(
                chaos_poison.poison_store,
                store_of(cluster, args),
                fault,
                args.poison_share,
                1000 * seed + n,
            )
            poisoned = (poisoned or 0) + got

    recovery = asyncio.create_task(fault_then_recovery())
    outcomes = await load(cluster.base, prompts, [expected[p] for p in prompts], args,
                          hang_up=fault == "disconnect")  # fmt: skip
    recovered = await recovery
    stall = await watch.stop()
    rss_after = {n: rss_mib(int(c["pid"])) for n, c in cluster.children().items()}
    settled: dict[str, float | None] = {}
    if args.settle_seconds > 0:  # issue #36: memory back within 10 % a minute after a phase
        await asyncio.sleep(args.settle_seconds)
        settled = {n: rss_mib(int(c["pid"])) for n, c in cluster.children().items()}
    for task in repoison:
        await task
    left = None
    if fault in POISON_FAULTS:
        if args.connector == "fs":
            left = chaos_poison.special_files(args.kv_path)
        await asyncio.to_thread(chaos_poison.clear_store, store_of(cluster, args))
    if fault == "disconnect":  # recovered: every service idle again after the hang-ups
        hit = time.monotonic()
        recovered = await wait_until(cluster.idle, args.recovery_timeout)
    return {
        "fault": fault,
        "poisoned": poisoned,
        "seed_requests": seeded,
        "special_files_left": left,
        "summary": summarize(outcomes),
        "recovered_s": recovered if fault != "none" else None,
        "first_ok_s": first_ok_after(outcomes, hit) if fault != "none" else None,
        "router_counters": counter_delta(before, cluster.router_counters()),
        "service_counters": _sum_services(svc_before, cluster.service_counters()),
        "idle_gauges_after": cluster.gauges() if fault == "disconnect" else None,
        "restarts": {n: c["restarts"] for n, c in cluster.children().items()},
        "injected": injected or None,
        "unrelated_stream": stall,
        "rss_mib": {n: [rss_before.get(n), rss_after[n]] for n in rss_after},
        "rss_settled_mib": settled or None,
    }


def _sum_services(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, float]:  # fmt: skip
    """Each service's counter deltas, summed over services by counter."""
    total: dict[str, float] = {}
    for name, now in after.items():
        for k, v in counter_delta(before.get(name, {}), now).items():
            total[k] = round(total.get(k, 0.0) + v, 3)
    return total


def up_argv(model: Path, args: argparse.Namespace) -> list[str]:
    argv = [
        sys.executable, "-m", "pdserve", "up", "--model", str(model), "--prefill", str(args.prefill),
        "--decode", str(args.decode), "--connector", args.connector, "--port", str(free_port()),
        "--torch-threads", "1", "--kv-cache-memory", "64Mi", "--max-restarts", "10",
        "--shutdown-grace", "10",
    ]  # fmt: skip
    if args.connector == "fs":
        argv += ["--kv-path", str(args.kv_path)]
    return argv + (["--log-dir", str(args.log_dir)] if args.log_dir else [])


async def run(args: argparse.Namespace) -> dict[str, Any]:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="chaos-") as tmp:
        model = build_model(Path(tmp) / "tiny-llama")
        MODEL[0] = str(model)
        args.kv_path = Path(tmp) / "kv"
        with PdserveUp(up_argv(model, args), args.startup_timeout) as up:
            assert up.proc is not None
            cluster = Cluster(f"http://127.0.0.1:{up.port}", up.lines, up.proc.pid)
            client = openai.AsyncOpenAI(base_url=f"{cluster.base}/v1", api_key="x", max_retries=0)
            expected = {p: await one(client, p, args.max_tokens) for p in PROMPTS + POISON_PROMPTS}
            await client.close()
            await wait_until(cluster.idle, args.recovery_timeout)
            store_dir = args.kv_path if args.connector == "fs" else None
            soak_before = cluster.soak(store_dir)
            phases = []
            for seed, fault in enumerate(args.faults):
                phases.append(await run_phase(cluster, fault, expected, args, seed))
                print(json.dumps(phases[-1]["summary"] | {"fault": fault}), flush=True)
            await wait_until(cluster.idle, args.recovery_timeout)
            soak_after = cluster.soak(store_dir)
    return {
        "benchmark": "chaos",
        "command": recorded_command("benchmarks.system.chaos"),
        "system": f"pdserve up --prefill {args.prefill} --decode {args.decode} "
        f"--connector {args.connector}"
        + (" (private redis-server)" if args.connector == "redis" else "")
        + ", tiny random Llama, CPU, --torch-threads 1",
        "host": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "loadavg_end": os.getloadavg(),
        },  # fmt: skip
        "settings": {
            k: str(v) if isinstance(v, Path) else v
            for k, v in vars(args).items()
            if k not in ("out", "md", "kv_path")
        },  # fmt: skip
        "startup_s": round(up.startup_s, 1),
        "total_s": round(time.perf_counter() - started, 1),
        "phases": phases,
        "soak": {"before": soak_before, "after": soak_after},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--connector", default="redis", choices=["redis", "fs", "p2p", "nixl"])
    ap.add_argument("--faults", nargs="+", choices=FAULTS,
                    help="phases in order (default: every one that applies to --connector)")  # fmt: skip
    ap.add_argument("--concurrency", type=int, default=16, help="concurrent streams")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--phase-seconds", type=float, default=25.0)
    ap.add_argument(
        "--prefill", type=int, default=2, help="prefill instances (1: single-prefill kill)"
    )
    ap.add_argument("--decode", type=int, default=2, help="decode instances")
    ap.add_argument("--fault-at", type=float, default=5.0, help="seconds into a phase")
    ap.add_argument("--pause-seconds", type=float, default=8.0, help="SIGSTOP length")
    ap.add_argument("--poison-share", type=float, default=0.5, help="share of records poisoned")
    ap.add_argument("--repoison-every", type=float, default=2.0, help="seconds between poisonings")
    ap.add_argument("--request-timeout", type=float, default=120.0)
    ap.add_argument("--recovery-timeout", type=float, default=120.0)
    ap.add_argument("--startup-timeout", type=float, default=300.0)
    ap.add_argument("--log-dir", type=Path, help="keep pdserve up's child logs here")
    ap.add_argument("--settle-seconds", type=float, default=0.0,
                    help="after each phase, wait this long and record every process's RSS again")  # fmt: skip
    ap.add_argument(
        "--out",
        type=Path,
        help="write the JSON result here (default: benchmarks/results/system/chaos_<connector>.json)",
    )
    ap.add_argument("--md", type=Path, help="write the markdown tables here")
    args = ap.parse_args()
    args.faults = args.faults or list(DEFAULT_FAULTS[args.connector])
    args.out = args.out or result_path("system", f"chaos_{args.connector}.json")
    if args.connector != "redis" and any(f.endswith("_redis") for f in args.faults):
        ap.error("the redis faults need --connector redis")
    if args.connector in ("p2p", "nixl") and any(f in POISON_FAULTS for f in args.faults):
        ap.error("record poisoning needs a store: --connector fs or redis")
    if args.connector == "redis" and {"fifo_records", "oversized_records"} & set(args.faults):
        ap.error("fifo_records and oversized_records are fs faults (--connector fs)")
    if not 0 < args.poison_share <= 1:
        ap.error("--poison-share must be in (0, 1]")
    result = asyncio.run(run(args))
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    if args.md:
        soak = result["soak"]
        args.md.write_text(
            markdown_table(result["phases"])
            + "\n"
            + settle_table(result["phases"])
            + "\n"
            + soak_table(soak["before"], soak["after"])
        )


if __name__ == "__main__":
    main()
