"""Where a graphed batch-1 decode step spends its GPU time (one H200, dummy bf16 weights).

    python3 -m benchmarks.gpu.decode_profile --model llama-3.1-8b \\
        --json benchmarks/results/gpu/decode_profile_h200.json --trace decode_trace.json

Profiles ``--replays`` replays of the captured batch-1 decode graph at a 512-token context
with torch.profiler (CUPTI sees the kernels inside the graph) and reports, per kernel name:
launches per step and GPU microseconds per step; and per step: the sum of kernel times
against the span from the first kernel's start to the last one's end (the difference is
the idle time between dependent kernels). It also times each projection's matmul alone at
one row (GB/s of weight read), so the GEMVs' share can be read against the copy ceiling.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu.gpu_bench_engine import decode_step_inputs, make_engine, model_numbers
from benchmarks.gpu.gpu_bench_kernels import bench_ms
from benchmarks.record import CONFIGS, recorded_command, result_path

log = logging.getLogger("decode_profile")


def decode_replay(engine: Any, bs: int, ctx: int) -> Any:
    """A closure replaying the graphed decode step for ``bs`` requests of ``ctx`` tokens."""
    tokens, pos, meta = decode_step_inputs(engine, bs, ctx)
    return lambda: engine.runner.graphs.run(tokens, pos, meta)


def kernel_table(prof: Any, replays: int) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """Per-kernel-name rows and the per-step busy / span totals from the profiler's events."""
    kernels = [
        e
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0
    ]
    by_name: dict[str, list[float]] = defaultdict(list)
    for e in kernels:
        by_name[e.name].append(e.time_range.elapsed_us())
    rows: list[dict[str, Any]] = [
        {
            "kernel": name[:120],
            "per_step": round(len(times) / replays, 2),
            "us_each": round(sum(times) / len(times), 2),
            "us_per_step": round(sum(times) / replays, 1),
        }
        for name, times in by_name.items()
    ]
    rows.sort(key=lambda r: -r["us_per_step"])
    starts = sorted((e.time_range.start, e.time_range.end) for e in kernels)
    busy = sum(end - start for start, end in starts)
    span = starts[-1][1] - starts[0][0] if starts else 0.0
    totals = {
        "kernels_per_step": round(len(kernels) / replays, 1),
        "busy_us_per_step": round(busy / replays, 1),
        "span_us_per_step": round(span / replays, 1),
    }
    return rows, totals


def gemv_rates(model: str, dev: torch.device) -> list[dict[str, Any]]:
    """Each projection's matmul alone at one row: microseconds and GB/s of weight read."""
    cfg = json.loads((CONFIGS / model / "config.json").read_text())
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    hd = h // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    shapes = {
        "qkv": (h + 2 * kv, h),
        "o": (h, h),
        "gate_up": (2 * inter, h),
        "down": (h, inter),
        "lm_head": (cfg["vocab_size"], h),
    }
    out = []
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        ms = bench_ms(functools.partial(torch.nn.functional.linear, x, w), dev, rep_ms=200)
        gbps = n * k * 2 / (ms * 1e-3) / 1e9
        out.append({"proj": name, "n": n, "k": k, "us": round(ms * 1e3, 2), "GBps": round(gbps)})
        del w, x
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="llama-3.1-8b")
    p.add_argument("--replays", type=int, default=20)
    p.add_argument("--json", type=Path, default=result_path("gpu", "decode_profile.json"))
    p.add_argument("--trace", type=Path, default=None, help="chrome trace of the profiled replays")
    p.add_argument("--opts", default="", help="gpu_bench.make_engine variant flags")
    p.add_argument("--gemv-sweep", default=None, help="gemv_sweep.py JSON as the GEMV table")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    dev = torch.device("cuda")
    result: dict[str, Any] = {
        "command": recorded_command("benchmarks.gpu.decode_profile", argv),
        "model": model_numbers(args.model),
        "gemv": gemv_rates(args.model, dev),
    }
    if args.gemv_sweep:
        from engine.models.triton_gemv import load_sweep

        load_sweep(args.gemv_sweep)
    engine = make_engine(args.model, "triton", True, args.opts)
    engine.runner.kv_cache.normal_()
    replay = decode_replay(engine, 1, 512)
    result["graph_replay_ms"] = round(bench_ms(replay, dev, rep_ms=300), 4)
    for _ in range(5):
        replay()
    torch.cuda.synchronize()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.replays):
            replay()
        torch.cuda.synchronize()
    rows, totals = kernel_table(prof, args.replays)
    result["kernels"] = rows
    result["totals"] = totals
    if args.trace is not None:
        prof.export_chrome_trace(str(args.trace))
    text = json.dumps(result, indent=1)
    if args.json is not None:
        args.json.write_text(text)
    print(json.dumps({k: v for k, v in result.items() if k != "kernels"}, indent=1))
    for r in rows[:40]:
        print(
            f"{r['us_per_step']:9.1f} us/step {r['per_step']:6.1f}x {r['us_each']:8.2f} us  {r['kernel']}"
        )


if __name__ == "__main__":
    main()
