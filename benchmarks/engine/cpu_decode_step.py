"""Decode-step time on the CPU with the C paged-attention kernel off and on, side by side.

One engine (SmolLM2-135M, float32) gets 64 seeded random-token prompts of 256 tokens
(greedy, EOS ignored). After every prompt is prefilled, each pure-decode step runs with the
torch path (``PDSERVE_CPU_KERNELS=0`` behaviour: gather the context with index_select, then
one padded SDPA) or the C kernel, alternating step by step, so both see the same batch, the
same context lengths (±1 token) and the same machine load. Then a torch.profiler table of a
few decode steps with the kernel on shows what remains. This repeats for each torch thread
count asked for (default 2, then 1), on the same engine.

    python -m benchmarks.engine.cpu_decode_step   # writes benchmarks/results/engine/cpu_decode_step.json

The switch is flipped on the live backend (``TorchRefAttention.cpu_kernels``, which the
environment variable sets at construction) rather than by building two engines.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.record import recorded_command, result_path
from engine.attention.cpu_kernels import load_decode_kernel
from engine.attention.torch_ref import TorchRefAttention
from engine.config import EngineConfig
from engine.core.sampling_params import SamplingParams
from engine.llm_engine import LLMEngine
from pdserve.bench.offline import random_prompts


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model-dir", default=str(Path.home() / ".cache/pdserve/models/smollm2"))
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--decode-steps", type=int, default=40, help="timed steps (half each mode)")
    p.add_argument("--profile-steps", type=int, default=3)
    p.add_argument("--threads", type=int, nargs="+", default=[2, 1])
    p.add_argument("--output-md", default=None, help="also write the markdown report here")
    p.add_argument("--output-json", default=str(result_path("engine", "cpu_decode_step.json")))
    return p.parse_args(argv)


def run(args: argparse.Namespace) -> dict[str, Any]:
    if load_decode_kernel() is None:
        raise RuntimeError("the C kernel did not build; nothing to compare")
    max_tokens = 2 + (args.decode_steps + args.profile_steps) * len(args.threads)
    blocks_per_req = -(-(args.input_len + max_tokens) // 16)
    config = EngineConfig(
        model=args.model_dir,
        dtype="float32",
        max_num_seqs=256,
        max_num_batched_tokens=2048,
        num_kv_blocks=1 + args.num_prompts * blocks_per_req + 16,
        seed=0,
    )
    engine = LLMEngine(config)
    backend = engine.runner.backend
    if not isinstance(backend, TorchRefAttention):
        raise RuntimeError(f"expected the torch_ref backend, got {backend.name}")
    vocab = engine.args.vocab_size
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(random_prompts(args.num_prompts, args.input_len, vocab, seed=0)):
        engine.add_request(f"r{i}", prompt, params)
    started: set[str] = set()
    while len(started) < args.num_prompts:  # prefill (chunked); untimed
        started.update(o.request_id for o in engine.step() if o.new_token_ids)

    runs = [_compare(engine, backend, threads, args) for threads in args.threads]
    return {
        "config": {
            "model": args.model_dir,
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "decode_steps_per_mode": args.decode_steps // 2,
            "context_tokens": [args.input_len + 1, args.input_len + max_tokens - 1],
            "torch": torch.__version__,
            "cpu": _cpu_model(),
            "kernel_library": str(load_decode_kernel().path),  # type: ignore[union-attr]
        },
        "runs": runs,
    }


def _compare(
    engine: LLMEngine, backend: TorchRefAttention, threads: int, args: argparse.Namespace
) -> dict[str, Any]:
    """Alternate torch / kernel decode steps on ``threads`` threads, then profile."""
    torch.set_num_threads(threads)
    times: dict[str, list[float]] = {"torch": [], "kernel": []}
    for step in range(args.decode_steps):
        mode = "kernel" if step % 2 else "torch"
        backend.cpu_kernels = mode == "kernel"
        t0 = time.perf_counter()
        engine.step()
        times[mode].append(time.perf_counter() - t0)
    backend.cpu_kernels = True
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.profile_steps):
            engine.step()
    med = {m: statistics.median(ts) * 1e3 for m, ts in times.items()}
    return {
        "torch_threads": threads,
        "decode_step_ms": {
            m: {"median": med[m], "min": min(ts) * 1e3, "max": max(ts) * 1e3}
            for m, ts in times.items()
        },
        "speedup_median": med["torch"] / med["kernel"],
        "speedup_min": min(times["torch"]) / min(times["kernel"]),
        "profile_table": prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14),
    }


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def report(result: dict[str, Any], command: str, profile_steps: int) -> str:
    c = result["config"]
    rows, profiles = [], []
    for r in result["runs"]:
        d = r["decode_step_ms"]
        rows.append(
            f"| {r['torch_threads']} | {d['torch']['median']:.1f} | {d['kernel']['median']:.1f} "
            f"| **{r['speedup_median']:.2f}×** | {d['torch']['min']:.1f} | "
            f"{d['kernel']['min']:.1f} | {r['speedup_min']:.2f}× |"
        )
        profiles.append(
            f"### {r['torch_threads']} torch thread(s)\n\n```\n{r['profile_table']}\n```\n"
        )
    table = "\n".join(rows)
    prof = "\n".join(profiles)
    return f"""# CPU decode step: C paged-attention kernel vs torch path

`{command}`

SmolLM2-135M float32, {c["num_prompts"]} requests × {c["input_len"]}-token prompts, greedy;
torch {c["torch"]}, {c["cpu"]}. After prefill, pure-decode steps alternate between the torch
attention path (`PDSERVE_CPU_KERNELS=0`: index_select gather + padded SDPA) and the C
kernel within one engine ({c["decode_steps_per_mode"]} steps each per thread count), so
both see the same batch, context ({c["context_tokens"][0]}–{c["context_tokens"][1]} tokens per
request) and machine load.

| torch threads | torch path median ms | C kernel median ms | speedup | torch min | kernel min | speedup (min) |
|---|---|---|---|---|---|---|
{table}

## What remains with the kernel on ({profile_steps} decode steps, torch.profiler)

`pd_paged_decode` is the kernel (a `record_function` around the ctypes call).

{prof}"""


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.WARNING)
    args = parse_args(argv)
    command = recorded_command("benchmarks.engine.cpu_decode_step", argv)
    # libgomp reads these once at start-up; they change how torch's idle threads wait, which
    # matters for everything between parallel regions (this kernel included).
    env = [f"{k}={os.environ[k]}" for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if k in os.environ]
    command = " ".join([*env, command])
    result = run(args)
    result["command"] = command
    md = report(result, command, args.profile_steps)
    if args.output_md:
        Path(args.output_md).write_text(md)
    Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n")
    print(md)


if __name__ == "__main__":
    main()
