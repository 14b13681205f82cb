"""System overhead: what the P/D path adds over calling the engine in-process.

    python -m benchmarks.system.system_overhead   # ~2-3 min; writes results/system/system_overhead.json

With a tiny random Llama (compute is negligible, so what remains is our overhead), in one
run: the same seeded 64-token prompts, greedy, 32 output tokens, EOS ignored, one request at
a time, streamed and timed, through
1. ``AsyncLLMEngine`` driven in-process (the baseline) and a bare ``LLMEngine`` stepped in a
   loop (the floor), both in a worker process set up like a service's (own session, 1 torch
   thread), timed inside it;
2. ``pdserve up --prefill 1 --decode 1`` (fs connector), with a streaming HTTP client;
3. ``pdserve up --mode colocated --prefill 0 --decode 1`` (the router without a prefill hop).
Each prompt goes through every path back to back, the order rotating, so that all paths see
the same load on a shared machine. Then, through each router, a closed-loop sweep of
concurrent streams (short outputs) for the best completed requests/s with zero errors.
TTFT = call → first token-bearing output; ITL = gap between successive token-bearing
outputs; TPOT = per request (last − first) / (n − 1). ``--quick`` is a smoke run for tests.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import shlex
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx

from benchmarks.record import recorded_command, result_path
from benchmarks.system.system_overhead_paths import (
    EngineWorker,
    PdserveUp,
    RequestFailed,
    build_model,
    request_body,
    stream_http,
    up_argv,
)
from benchmarks.system.system_overhead_report import (
    TARGET_ITL_MS,
    TARGET_TTFT_MS,
    Stream,
    latency_summary,
    overhead,
    paired_added,
    phase_medians,
    render_markdown,
)
from common.flags import memory_size
from pdserve.bench.metrics import percentile
from pdserve.bench.offline import random_prompts
from pdserve.procs import free_ports

logger = logging.getLogger("system_overhead")
REPO = Path(__file__).resolve().parents[2]
VOCAB = 49152  # the tiny model uses SmolLM2's tokenizer


async def interleaved(
    worker: EngineWorker,
    client: httpx.AsyncClient,
    urls: dict[str, str],
    model: str,
    prompts: list[list[int]],
    args: Any,
) -> tuple[dict[str, list[Stream]], dict[str, list[float]]]:
    """Each prompt once through every path, one request at a time, the paths' order rotating
    per prompt, so that all paths see the same (shifting) load on this shared machine; after
    each router request, one ``GET /v1/models`` round trip (seconds; the HTTP floor). The
    first ``args.warmup`` prompts are not kept. Any failed request aborts the run."""
    paths = ["engine-sync", "in-process", *urls]
    streams: dict[str, list[Stream]] = {p: [] for p in paths}
    floors: dict[str, list[float]] = {p: [] for p in urls}
    for i, prompt in enumerate(prompts):
        for path in paths[i % len(paths) :] + paths[: i % len(paths)]:
            if path in ("engine-sync", "in-process"):
                s = await worker.run(path, f"{path}-{i}", prompt, args.output_len)
            else:
                body = request_body(model, prompt, args.output_len)
                s = await stream_http(client, urls[path], body, args.request_timeout)
                start = time.perf_counter()
                (await client.get(urls[path].replace("/completions", "/models"))).raise_for_status()
                floors[path].append(time.perf_counter() - start)
            streams[path].append(s)
    keep = args.warmup
    return {p: v[keep:] for p, v in streams.items()}, {p: v[keep:] for p, v in floors.items()}


async def closed_loop(
    client: httpx.AsyncClient,
    url: str,
    model: str,
    prompts: list[list[int]],
    concurrency: int,
    args: Any,
) -> dict[str, Any]:
    """``concurrency`` streams, each sending its next request when the last one ends, until
    ``len(prompts)`` were sent; completed req/s over the wall time of the whole batch."""
    todo = list(reversed(prompts))
    ttfts: list[float] = []
    errors: dict[str, int] = {}

    async def worker() -> None:
        while todo:
            body = request_body(model, todo.pop(), args.sweep_output_len)
            try:
                ttfts.append(
                    (await stream_http(client, url, body, args.request_timeout)).token_times[0]
                )
            except (RequestFailed, httpx.HTTPError, asyncio.TimeoutError, ValueError) as exc:
                kind = type(exc).__name__
                errors[kind] = errors.get(kind, 0) + 1
                logger.warning("request failed at concurrency %d: %s %s", concurrency, kind, exc)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    return {
        "concurrency": concurrency,
        "requests": len(prompts),
        "completed": len(ttfts),
        "errors": errors,
        "wall_s": wall,
        "req_per_s": len(ttfts) / wall,
        "output_tok_per_s": len(ttfts) * args.sweep_output_len / wall,
        "ttft_p50_ms": percentile(ttfts, 50) * 1e3 if ttfts else None,
    }


async def measure(
    model_dir: Path,
    ups: dict[str, PdserveUp],
    prompts: list[list[int]],
    sweep_prompts: list[list[int]],
    args: Any,
) -> tuple[dict[str, list[Stream]], dict[str, list[float]], dict[str, list[dict[str, Any]]]]:
    """The interleaved low-load series (streams, HTTP floors), then each system's sweep."""
    urls = {m: f"http://127.0.0.1:{up.port}/v1/completions" for m, up in ups.items()}
    limits = httpx.Limits(max_connections=max(args.concurrency) + 4)
    with EngineWorker(model_dir, args.kv_cache_memory, args.startup_timeout) as worker:
        async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as client:
            streams, floors = await interleaved(worker, client, urls, str(model_dir), prompts, args)
    async with httpx.AsyncClient(timeout=args.request_timeout, limits=limits) as client:
        sweeps: dict[str, list[dict[str, Any]]] = {m: [] for m in urls}
        for mode, url in urls.items():
            for c in args.concurrency:
                batch = sweep_prompts[: max(args.sweep_requests_per_stream * c, args.sweep_min)]
                sweeps[mode].append(await closed_loop(client, url, str(model_dir), batch, c, args))
                logger.info("%s, %d streams: %.1f req/s", mode, c, sweeps[mode][-1]["req_per_s"])
    return streams, floors, sweeps


def system_result(
    up: PdserveUp,
    streams: list[Stream],
    base: list[Stream],
    floor: list[float],
    sweep: list[dict[str, Any]],
    model_dir: Path,
) -> dict[str, Any]:
    """One system's entry in the JSON: low-load summary, overhead, phases, sweep."""
    base_summary, low = latency_summary(base), latency_summary(streams)
    clean = [s["req_per_s"] for s in sweep if not s["errors"] and s["completed"] == s["requests"]]
    return {
        "command": shlex.join(["pdserve", *up.argv[3:]]).replace(str(model_dir), "TINY_LLAMA_DIR"),
        "startup_s": up.startup_s,
        "low_load": low,
        "overhead": overhead(base_summary, low, TARGET_TTFT_MS, TARGET_ITL_MS),
        "paired_added_ms": paired_added(base, streams),
        "phases_ms": phase_medians(streams) | {"http_get_models": percentile(floor, 50) * 1e3},
        "outputs_equal_to_inprocess": sum(
            a.text == b.text for a, b in zip(base, streams, strict=True)
        ),
        "sweep": sweep,
        "max_sustained_req_s": max(clean) if clean else None,
    }


# -- main ------------------------------------------------------------------------------------
async def run(args: argparse.Namespace) -> dict[str, Any]:
    t_start, loadavg_start = time.perf_counter(), os.getloadavg()
    prompts = random_prompts(args.warmup + args.requests, args.prompt_len, VOCAB, seed=args.seed)
    sweep_n = max(args.sweep_requests_per_stream * max(args.concurrency), args.sweep_min)
    sweep_prompts = random_prompts(sweep_n, args.prompt_len, VOCAB, seed=args.seed + 1)
    with tempfile.TemporaryDirectory(prefix="system-overhead-") as tmp, ExitStack() as stack:
        model_dir = build_model(Path(tmp) / "tiny-llama")
        ups = {
            m: stack.enter_context(
                PdserveUp(up_argv(m, model_dir, free_ports(1)[0], args), args.startup_timeout)
            )
            for m in args.modes
        }
        loadavg_ready = os.getloadavg()
        streams, floors, sweeps = await measure(model_dir, ups, prompts, sweep_prompts, args)
        base = streams["in-process"]
        systems = {
            m: system_result(up, streams[m], base, floors[m], sweeps[m], model_dir)
            for m, up in ups.items()
        }
    return {
        "benchmark": "system_overhead",
        "command": recorded_command("benchmarks.system.system_overhead", args.argv),
        "host": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "loadavg_start": loadavg_start,
            "loadavg_systems_ready": loadavg_ready,
            "loadavg_end": os.getloadavg(),
        },
        "workload": {k: getattr(args, k) for k in WORKLOAD_KEYS},
        "targets": {"added_ttft_p50_ms": TARGET_TTFT_MS, "added_itl_p50_ms": TARGET_ITL_MS},
        "inprocess": latency_summary(base),
        "engine_sync": latency_summary(streams["engine-sync"]),
        "systems": systems,
        "wall_s": time.perf_counter() - t_start,
    }


WORKLOAD_KEYS = (
    "requests", "warmup", "prompt_len", "output_len", "concurrency", "sweep_output_len",
    "sweep_requests_per_stream", "sweep_min", "kv_cache_memory", "seed",
)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--quick", action="store_true", help="smoke run: a few requests (tests)")
    p.add_argument("--requests", type=int, default=100, help="low-load requests per system")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured requests first")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--sweep-output-len", type=int, default=8, help="tokens per sweep request")
    p.add_argument("--sweep-requests-per-stream", type=int, default=6)
    p.add_argument("--sweep-min", type=int, default=40, help="at least this many per level")
    p.add_argument("--modes", nargs="+", default=["disaggregated", "colocated"],
                   choices=["disaggregated", "colocated"])  # fmt: skip
    p.add_argument("--kv-cache-memory", default="64Mi", help="KV cache per engine")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--startup-timeout", type=float, default=240.0)
    p.add_argument("--request-timeout", type=float, default=60.0)
    p.add_argument(
        "--output-json", type=Path, default=result_path("system", "system_overhead.json")
    )
    p.add_argument("--output-md", type=Path, help="also write the markdown report here")
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv  # recorded in the result
    if args.quick:
        args.requests, args.warmup, args.output_len = 4, 1, 6
        args.concurrency, args.sweep_requests_per_stream, args.sweep_min = [1, 2], 2, 4
    if args.requests < 1 or args.output_len < 2 or args.prompt_len < 1 or args.warmup < 0:
        p.error("need --requests >= 1, --output-len >= 2, --prompt-len >= 1, --warmup >= 0")
    try:
        if memory_size(args.kv_cache_memory) is None:
            raise argparse.ArgumentTypeError("a size is required")
    except argparse.ArgumentTypeError as exc:
        p.error(f"--kv-cache-memory: {exc}")
    if min(args.concurrency) < 1 or args.sweep_output_len < 1:
        p.error("--concurrency values and --sweep-output-len must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request otherwise
    args = parse_args(argv)
    result = asyncio.run(run(args))
    args.output_json.write_text(json.dumps(result, indent=2) + "\n")
    md = render_markdown(result)
    if args.output_md:
        args.output_md.write_text(md)
    print(md)  # CLI output: the report
    return 0


if __name__ == "__main__":
    sys.exit(main())
