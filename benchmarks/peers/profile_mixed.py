"""Where the time of the seeded mixed set goes, per engine: the profile behind the peer
table's mixed row (README.md here, "What still loses, and why").

    python -m benchmarks.peers.profile_mixed --engine pdserve --precision bf16 --num-prompts 300
    PYTHONPATH=/tmp/vllm-site:. python -m benchmarks.peers.profile_mixed --engine vllm \\
        --precision fp8 --num-prompts 300
    python -m benchmarks.peers.profile_compare OURS.json VLLM.json

The engine is built as ``offline.py`` builds it (the same ``SETTINGS``, model, precision and
sampling: greedy, EOS ignored), vLLM in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``,
so its engine core's kernels are recorded here). After an untimed warm-up (32 requests of
another seed), the first ``--num-prompts`` requests of the mixed set (the same requests as
the first ones of offline.py's 1,000) run once unprofiled (the speed without the profiler)
and once under ``torch.profiler`` with CUDA activity only (recording host ops would slow the
host side, the very thing the idle share measures). Our engine keeps its CUDA graphs on,
mixed-step graphs included (``--graphs``); CUPTI records the kernels of graph replays.

The JSON and the markdown beside it (profile_events.py computes both): wall time, device
busy time (the union of kernel intervals) and the idle rest (the host-side overhead), split
by gap length; kernel time per category and per output token; the top kernels. A CPU dry
run: ``--device cpu --num-prompts 4 --max-output 16`` (the tiny Llama, float32; aten ops
stand in for kernels).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.peers.offline import (
    CONFIGS,
    RESULTS,
    SETTINGS,
    Generate,
    _json_or_str,
    build_pdserve,
    build_vllm,
)
from benchmarks.peers.profile_events import CATEGORY_LABELS, Event, summarize
from benchmarks.peers.workloads import mixed_set
from benchmarks.record import recorded_command

log = logging.getLogger("peers.profile_mixed")
WARMUP_PROMPTS, WARMUP_SEED = 32, 1
# The profiler's activity names -> Event.kind (anything else, e.g. annotations, is dropped).
KINDS = {
    "kernel": "kernel",
    "gpu_memcpy": "memcpy",
    "gpu_memset": "memset",
    "cuda_runtime": "runtime",
    "cuda_driver": "runtime",
    "cpu_op": "cpu_op",
}


def _kind(evt: Any) -> str | None:
    if hasattr(evt, "activity_type"):
        return KINDS.get(str(evt.activity_type()))
    # Older profilers: no activity type; device events are CUDA, launch calls named cuda*.
    if "CUDA" in str(evt.device_type()):
        return "kernel"
    return "runtime" if evt.name().startswith(("cuda", "cu")) else "cpu_op"


def collect_events(prof: Any) -> list[Event]:
    """The raw profiler events as ``Event`` records (the profiler's own function-event
    tree is never built: for ~10^6 kernels that would take minutes)."""
    out = []
    for evt in prof.profiler.kineto_results.events():
        kind = _kind(evt)
        if kind is None:
            continue
        start = evt.start_ns()
        out.append(
            Event(
                name=evt.name(),
                start_ns=start,
                end_ns=start + evt.duration_ns(),
                kind=kind,
                correlation=evt.correlation_id(),
                thread=evt.start_thread_id(),
                flow=evt.flow_id() if hasattr(evt, "flow_id") else 0,
            )
        )
    return out


def build(args: argparse.Namespace, model_dir: str) -> tuple[Generate, dict[str, Any]]:
    if args.engine == "vllm":
        # The engine core in this process, so its kernels are in this process's profile.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        return build_vllm(model_dir, args.precision, args.device)
    overrides: dict[str, Any] = {}
    if args.graphs == "on":
        overrides.update(cuda_graphs=True, mixed_cuda_graphs=True)
    elif args.graphs == "off":
        overrides.update(cuda_graphs=False, mixed_cuda_graphs=False)
    overrides.update({k: _json_or_str(v) for k, v in (s.split("=", 1) for s in args.pdserve_set)})
    if args.device == "cpu":
        overrides.update(cuda_graphs=False, mixed_cuda_graphs=False)
    return build_pdserve(model_dir, args.precision, args.device, overrides)


def profile_run(
    generate: Generate, prompts: list[list[int]], max_tokens: list[int], device: str
) -> tuple[float, tuple[int, int], list[Event]]:
    """(wall seconds, window on the profiler's clock, events) of one profiled run."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CUDA] if device.startswith("cuda") else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        t0 = time.time_ns()
        wall = generate(prompts, max_tokens)
        t1 = time.time_ns()
    t2 = time.perf_counter()
    events = collect_events(prof)
    log.info("%d events read in %.1f s", len(events), time.perf_counter() - t2)
    return wall, (t0, t1), events


def markdown(out: dict[str, Any]) -> str:
    p = out["profile"]
    lines = [
        f"# Mixed-set profile: {out['engine']} {out['precision']}",
        "",
        f"`{out['command']}`  ",
        f"{out.get('gpu', out['device'])}, torch {out.get('torch', '?')}, {out['started']}; "
        f"{out['num_prompts']} requests, {out['in_tokens']} prompt / {out['out_tokens']} "
        f"output tokens; graphs: {out['graphs']}",
        "",
        "| measure | value |",
        "|---|---:|",
        f"| output tok/s, unprofiled | {out['out_tok_s']:.1f} |",
        f"| wall, unprofiled / profiled (s) | {out['wall_unprofiled_s']:.3f} / {p['wall_s']:.3f} |",
        f"| device busy (s, union of kernels) | {p['device_busy_s']:.3f} |",
        f"| kernel time, summed (s) | {p['kernel_time_s']:.3f} |",
        f"| device idle (host-side overhead) | {p['idle_s']:.3f} s = {100 * p['idle_share']:.1f} % |",
        f"| idle / busy per output token (us) | {p['idle_us_per_out_token']:.2f} / "
        f"{p['busy_us_per_out_token']:.2f} |",
        f"| device events per output token | {p['kernels_per_out_token']:.1f} |",
        f"| graph launches / kernel launch calls | {p['launches']['graph_launches']} / "
        f"{p['launches']['kernel_launch_calls']} |",
        f"| kernel time inside graph replays | {100 * p['launches']['kernel_time_in_graphs_share']:.1f} % |",
        f"| idle by gap length (s) | {', '.join(f'{k} {v}' for k, v in p['idle_by_gap_s'].items())} |",
        "",
        "| category | time (s) | share | us / output token | kernels |",
        "|---|---:|---:|---:|---:|",
    ]  # fmt: skip
    for cat, row in p["categories"].items():
        lines.append(
            f"| {CATEGORY_LABELS[cat]} | {row['time_s']:.3f} | {100 * row['share']:.1f} % | "
            f"{row['us_per_out_token']:.2f} | {row['count']} |"
        )
    lines += ["", "| kernel | category | time (s) | calls | avg (us) | share |", "|---|---|---:|---:|---:|---:|"]  # fmt: skip
    for k in p["top_kernels"]:
        name = k["name"] if len(k["name"]) <= 90 else k["name"][:87] + "..."
        name = name.replace("|", "\\|")
        lines.append(
            f"| `{name}` | {k['category']} | {k['time_s']:.3f} | {k['count']} | "
            f"{k['avg_us']:.1f} | {100 * k['share']:.1f} % |"
        )
    lines += [""] + [f"Note: {n}" for n in p["notes"]]
    return "\n".join(lines).rstrip() + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--engine", choices=("pdserve", "vllm"), required=True)
    ap.add_argument("--precision", choices=("bf16", "fp8"), default="bf16")
    ap.add_argument("--num-prompts", type=int, default=300, help="the first N of the mixed set")
    ap.add_argument("--model", default="llama-3.1-8b", help="a directory under benchmarks/configs")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run (tiny-llama)")
    ap.add_argument(
        "--graphs", choices=("on", "off", "default"), default="on",
        help="ours: CUDA graphs for decode and mixed steps (on), none (off), engine defaults",
    )  # fmt: skip
    ap.add_argument(
        "--pdserve-set", action="append", default=[], metavar="FIELD=VALUE",
        help="an EngineConfig field for our engine only (as in offline.py; repeatable)",
    )  # fmt: skip
    ap.add_argument(
        "--max-output", type=int, default=0,
        help="cap each request's output tokens (0: the set's own; for CPU dry runs)",
    )  # fmt: skip
    ap.add_argument("--top", type=int, default=15, help="kernels listed by time")
    ap.add_argument(
        "--json", default=None,
        help="default benchmarks/results/peers/profile/<engine>_<precision>.json (.md beside)",
    )  # fmt: skip
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    import torch

    path = Path(args.json or RESULTS / "profile" / f"{args.engine}_{args.precision}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    cuda = args.device.startswith("cuda")
    model_dir = str(CONFIGS / (args.model if cuda else "tiny-llama"))
    out: dict[str, Any] = {
        "command": recorded_command("benchmarks.peers.profile_mixed", argv),
        "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "host": platform.node(),
        "engine": args.engine,
        "precision": args.precision,
        "model": Path(model_dir).name,
        "device": args.device,
        "graphs": args.graphs if args.engine == "pdserve" else "vllm default",
        "settings": SETTINGS,
        "torch": torch.__version__,
    }
    if cuda:
        out["gpu"] = torch.cuda.get_device_name()
    t0 = time.perf_counter()
    generate, out["engine_config"] = build(args, model_dir)
    out["build_s"] = round(time.perf_counter() - t0, 1)
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    warm = mixed_set(min(WARMUP_PROMPTS, args.num_prompts), vocab, seed=WARMUP_SEED)
    generate(
        [r.prompt for r in warm], [min(r.max_tokens, args.max_output or 1 << 30) for r in warm]
    )
    reqs = mixed_set(args.num_prompts, vocab, seed=0)
    prompts, max_tokens = [r.prompt for r in reqs], [r.max_tokens for r in reqs]
    if args.max_output:
        max_tokens = [min(m, args.max_output) for m in max_tokens]
    out.update(
        num_prompts=len(reqs),
        in_tokens=sum(len(p) for p in prompts),
        out_tokens=sum(max_tokens),
    )
    out["wall_unprofiled_s"] = round(generate(prompts, max_tokens), 4)
    out["out_tok_s"] = round(out["out_tokens"] / out["wall_unprofiled_s"], 1)
    wall, window, events = profile_run(generate, prompts, max_tokens, args.device)
    out["profile"] = summarize(events, wall, out["out_tokens"], window, top=args.top)
    out["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    path.write_text(json.dumps(out, indent=1) + "\n")
    text = markdown(out)
    path.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
