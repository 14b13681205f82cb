"""Serving overhead at batch: what the service and the router cost per token, beside the engine.

    python -m benchmarks.system.serving_overhead                    # ~5 min on 2 cores
    python -m benchmarks.system.serving_overhead --tree base=/path/to/old/checkout --tree new=.
    python -m benchmarks.system.serving_overhead --paths service router \
        --tree thread=.@--engine-process=off --tree process=.@--engine-process=on

A tiny random Llama (SmolLM2's tokenizer, a small vocabulary so that the forward and the
sampling are cheap on a CPU) makes the serving path dominate. N concurrent streams of
``--output-len`` tokens (EOS ignored, greedy) go through, per N in ``--streams``:

- ``engine``: a bare ``LLMEngine`` stepped in a loop (the floor);
- ``async``: ``AsyncLLMEngine`` with one asyncio consumer per request (engine thread + loop);
- ``service``: a real ``python -m service decode`` process, N ``Decode`` streams over gRPC;
- ``router``: ``pdserve up --mode colocated``, N streamed completions over HTTP (SSE).

Per path: the median time per token of a stream (TPOT), decode tok/s (N / TPOT), output
tok/s over the wall time, tokens per message (1.0 = one message per token), and for the
engine paths the step's wall vs engine-thread CPU time (their gap: waiting for the GIL, or
for a core). ``--tree NAME=PATH`` runs the service/router/engine processes from each
checkout, interleaved per N, for A/B comparisons in one run (ratios against the first tree);
``NAME=PATH@FLAGS`` adds engine flags to that tree's service and ``pdserve up``. With
``--engine-process=on`` the service's CPU includes its engine process's (role ``engine``),
and the step timings are not read (they are taken in the service process).
``--profile SECONDS`` records a py-spy profile of each tree's service during its largest-N
batch (needs ``py-spy``, the dev extra).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from benchmarks.record import recorded_command, result_path
from benchmarks.system.serving_overhead_paths import (
    ServiceProc,
    cpu_by_role,
    cpu_per_token,
    grpc_batch,
    http_batch,
    process_tree,
    prompts_for,
    read_step_stats,
    run_engine_worker,
    step_delta,
    summarize,
)
from benchmarks.system.system_overhead_paths import PdserveUp, build_model
from common.flags import memory_size
from pdserve.procs import free_ports

logger = logging.getLogger("serving_overhead")
REPO = Path(__file__).resolve().parents[2]
PATHS = ("engine", "async", "service", "router")


def engine_flags(model_dir: Path, args: Any) -> list[str]:
    return [
        *("--model", str(model_dir), "--kv-cache-memory", args.kv_cache_memory),
        *("--max-num-seqs", str(max(args.streams)), "--torch-threads", "1"),
    ]


class Tree:
    """One checkout's service and ``pdserve up``, started once for the whole run."""

    def __init__(
        self, name: str, path: Path, model_dir: Path, tmp: Path, args: Any, flags: list[str]
    ) -> None:
        self.name, self.path = name, path
        port, metrics = free_ports(2)
        self.stats_file = tmp / f"{name}-steps.json"
        argv = [
            *(sys.executable, "-m", "benchmarks.system.serving_overhead_paths", "--timed-service"),
            *(str(self.stats_file), "decode", "--host", "127.0.0.1", "--port", str(port)),
            *("--metrics-port", str(metrics), *engine_flags(model_dir, args), *flags),
        ]
        self.service = ServiceProc(path, argv, port, tmp / f"{name}-service.log")
        up = [
            *(sys.executable, "-m", "pdserve", "up", "--mode", "colocated", "--prefill", "0"),
            *("--decode", "1", "--port", str(free_ports(1)[0]), "--shutdown-grace", "10"),
            *engine_flags(model_dir, args),
            *flags,
        ]
        self.up = PdserveUp(up, args.startup_timeout, env={"PYTHONPATH": str(path)}, cwd=path)


async def measure_one(tree: Tree, path: str, model: str, prompts: Any, args: Any) -> Any:
    """One batch through ``path`` of ``tree``: the summary (service: with step timings)."""
    tokens = len(prompts) * args.output_len
    if path == "service":
        assert tree.service.proc is not None
        pids = process_tree(tree.service.proc.pid)  # with its engine process, if any
        await grpc_batch(tree.service.address, prompts, 4, args.request_timeout)  # warm
        before, cpu = read_step_stats(tree.stats_file), cpu_by_role(pids)
        recs, wall = await grpc_batch(
            tree.service.address, prompts, args.output_len, args.request_timeout
        )
        cpu = cpu_per_token(cpu, cpu_by_role(pids), tokens)
        time.sleep(0.5)  # the stats file is rewritten every 0.2 s
        steps = step_delta(before, read_step_stats(tree.stats_file))
        return summarize(recs, wall, args.output_len) | steps | cpu
    assert tree.up.proc is not None
    pids = process_tree(tree.up.proc.pid)
    url = f"http://127.0.0.1:{tree.up.port}/v1/completions"
    await http_batch(url, model, prompts, 4, args.request_timeout)  # warm
    cpu = cpu_by_role(pids)
    recs, wall = await http_batch(url, model, prompts, args.output_len, args.request_timeout)
    cpu = cpu_per_token(cpu, cpu_by_role(pids), tokens)
    return summarize(recs, wall, args.output_len) | cpu


def start_profile(pid: int, out: Path, seconds: float) -> subprocess.Popen[bytes] | None:
    """py-spy on ``pid`` and its children (raw collapsed stacks with thread names, idle
    samples kept, without pausing the process); None when py-spy is not installed."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(spy).exists():
        logger.warning("py-spy not found: no profile")
        return None
    argv = [
        *(spy, "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", "100"),
        *("--threads", "--idle", "--nonblocking", "--subprocesses", "--format", "raw"),
        *("-o", str(out)),
    ]
    return subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


async def run_all(trees: list[Tree], model_dir: Path, args: Any) -> dict[str, Any]:
    rows: dict[str, dict[str, dict[str, Any]]] = {t.name: {} for t in trees}
    for n in args.streams:
        prompts = prompts_for(n, args.prompt_len, args.vocab, args.seed + n)
        for rep in range(args.repeats):
            order = trees if rep % 2 == 0 else list(reversed(trees))
            for path in args.paths:
                for tree in order:
                    key = f"{path}/{n}"
                    if path in ("engine", "async"):
                        if key not in rows[tree.name]:
                            spec = {
                                "streams": n, "output_len": args.output_len, "seed": args.seed + n,
                                "prompt_len": args.prompt_len, "vocab": args.vocab,
                                "kv_bytes": memory_size(args.kv_cache_memory),
                                "max_num_seqs": max(args.streams),
                            }  # fmt: skip
                            got = run_engine_worker(tree.path, model_dir, spec, 600)
                            rows[tree.name].update({f"{p}/{n}": got[p] for p in got})
                        continue
                    spy = None
                    if args.profile and n == max(args.streams) and rep == 0:
                        proc = tree.service.proc if path == "service" else tree.up.proc
                        assert proc is not None
                        out = args.profile_dir / f"{tree.name}-{path}.txt"
                        spy = start_profile(proc.pid, out, args.profile)
                    got = await measure_one(tree, path, str(model_dir), prompts, args)
                    if spy is not None:
                        spy.wait(timeout=args.profile + 60)
                    rows[tree.name].setdefault(key, {"runs": []})["runs"].append(got)
                    logger.info("%s %s: %s", tree.name, key, json.dumps(got))
    return rows


def best_of(rows: dict[str, Any]) -> dict[str, Any]:
    """A repeated row: the run with the median TPOT (the others kept under ``runs``),
    CPU per token the median of the runs'."""
    out: dict[str, Any] = {}
    for key, row in rows.items():
        if "runs" in row:
            runs = sorted(row["runs"], key=lambda r: r["tpot_p50_ms"])
            med = dict(runs[len(runs) // 2])
            for k in [k for k in med if k.startswith("cpu_us_per_token")]:
                vals = sorted(r[k] for r in runs if k in r)
                med[k] = vals[len(vals) // 2]
            out[key] = med | {"runs": row["runs"]}
        else:
            out[key] = row
    return out


def _cpu(row: dict[str, Any]) -> str:
    """Service (+ its engine process, when it has one) + router CPU µs per token."""
    svc = row.get("cpu_us_per_token_service")
    eng = row.get("cpu_us_per_token_engine")
    rtr = row.get("cpu_us_per_token_router")
    if svc is None:
        return ""
    text = f"{svc:.0f}" + (f"+e{eng:.0f}" if eng is not None else "")
    return text + (f"+{rtr:.0f}" if rtr is not None else "")


def _cpu_total(row: dict[str, Any]) -> float:
    roles = ("service", "engine", "router")
    return float(sum(row.get(f"cpu_us_per_token_{role}", 0.0) for role in roles))


def render(result: dict[str, Any]) -> str:
    """One row per path and N: per tree TPOT p50, tokens per message, CPU µs per token
    (service + router); then each later tree against the first (decode tok/s, CPU/token)."""
    names = list(result["trees"])
    head = ["path", "N"]
    for n in names:
        head += [f"{n} TPOT p50 ms", f"{n} tok/msg", f"{n} CPU µs/tok"]
    for n in names[1:]:
        head += [f"{n}/{names[0]} decode tok/s", f"{n}/{names[0]} CPU/tok"]
    host = result["host"]
    lines = [
        "# Serving overhead at batch (tiny model, CPU)",
        "",
        f"Command: `{result['command']}`",
        "",
        f"Host: {host['cpu_count']} cores, load average {host['loadavg_start'][0]:.1f} at the "
        f"start, {host['loadavg_end'][0]:.1f} at the end. CPU µs/tok: the service's (+ the "
        "router's) CPU time per generated token.",
        "",
        "| " + " | ".join(head) + " |",
        "|---|---:|" + "---:|" * (len(head) - 2),
    ]
    for path in result["paths"]:
        for n in result["streams"]:
            rows = [result["trees"][name].get(f"{path}/{n}") for name in names]
            cells = [path, str(n)]
            for row in rows:
                if row is None:
                    cells += ["", "", ""]
                    continue
                cells += [
                    f"{row['tpot_p50_ms']:.2f}",
                    f"{row['tokens_per_message']:.2f}",
                    _cpu(row),
                ]
            base = rows[0]
            for row in rows[1:]:
                if not (row and base and base["decode_tok_s"] and _cpu_total(base)):
                    cells += ["", ""]
                    continue
                cells += [
                    f"{row['decode_tok_s'] / base['decode_tok_s']:.2f}x",
                    f"{_cpu_total(row) / _cpu_total(base):.2f}x",
                ]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n" + _render_steps(result, names)


def _render_steps(result: dict[str, Any], names: list[str]) -> str:
    """The engine step's wall time against the engine thread's CPU time in it: the gap is
    time the thread could not run (waiting for the GIL, or for a core on a busy machine)."""
    lines = [
        "",
        "Engine step, wall / engine-thread CPU / gap (ms per step):",
        "",
        "| path | N | " + " | ".join(names) + " |",
        "|---|---:|" + "---|" * len(names),
    ]
    for path in ("engine", "async", "service"):
        for n in result["streams"]:
            cells = []
            for name in names:
                row = result["trees"][name].get(f"{path}/{n}") or {}
                if "step_wall_ms" not in row:
                    cells.append("")
                    continue
                wall, cpu, gap = row["step_wall_ms"], row["step_cpu_ms"], row["step_wait_ms"]
                cells.append(f"{wall:.2f} / {cpu:.2f} / {gap:.2f}")
            if any(cells):
                lines.append(f"| {path} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    args = parse_args(argv)
    loadavg_start, t0 = os.getloadavg(), time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="serving-overhead-") as tmp, ExitStack() as stack:
        model_dir = build_model(Path(tmp) / "tiny-llama", args.vocab)
        trees = [
            Tree(name, path, model_dir, Path(tmp), args, flags) for name, path, flags in args.trees
        ]
        for tree in trees:
            if "service" in args.paths:
                stack.callback(tree.service.stop)
                tree.service.start(args.startup_timeout)
            if "router" in args.paths:
                stack.enter_context(tree.up)
        rows = asyncio.run(run_all(trees, model_dir, args))
    result = {
        "benchmark": "serving_overhead",
        "command": recorded_command("benchmarks.system.serving_overhead", args.argv),
        "host": {
            "platform": platform.platform(),
            "python": platform.python_version(),
            "cpu_count": os.cpu_count(),
            "loadavg_start": loadavg_start,
            "loadavg_end": os.getloadavg(),
        },  # fmt: skip
        "workload": {k: getattr(args, k) for k in ("prompt_len", "output_len", "vocab", "seed")},
        "streams": args.streams,
        "paths": args.paths,
        "tree_paths": {name: str(path) for name, path, _ in args.trees},
        "tree_flags": {name: flags for name, _, flags in args.trees},
        "trees": {name: best_of(r) for name, r in rows.items()},
        "wall_s": time.perf_counter() - t0,
    }
    args.output_json.write_text(json.dumps(result, indent=2) + "\n")
    md = render(result)
    if args.output_md:
        args.output_md.write_text(md)
    print(md)  # CLI output: the report
    return 0


def _tree(text: str) -> tuple[str, Path, list[str]]:
    name, sep, rest = text.partition("=")
    path, _, flags = rest.partition("@")
    if not sep or not name or not Path(path).is_dir():
        raise argparse.ArgumentTypeError(
            f"want NAME=DIR[@FLAGS] (an existing checkout, extra engine flags), got {text!r}"
        )
    return name, Path(path).resolve(), flags.split()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--streams", type=int, nargs="+", default=[32, 64, 128])
    p.add_argument("--paths", nargs="+", default=list(PATHS), choices=PATHS)
    p.add_argument("--tree", dest="trees", type=_tree, action="append", default=[])
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=2048, help="the tiny model's vocabulary")
    p.add_argument("--repeats", type=int, default=1, help="batches per path and N (median kept)")
    p.add_argument("--kv-cache-memory", default="128Mi")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--profile", type=float, default=0.0, help="py-spy seconds (0: none)")
    p.add_argument("--profile-dir", type=Path, default=result_path("system", "serving_profile"))
    p.add_argument("--startup-timeout", type=float, default=240.0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument(
        "--output-json", type=Path, default=result_path("system", "serving_overhead.json")
    )
    p.add_argument("--output-md", type=Path, help="also write the markdown report here")
    args = p.parse_args(argv)
    args.argv = sys.argv[1:] if argv is None else argv
    if not args.trees:
        args.trees = [("current", REPO, [])]
    if len({n for n, _, _ in args.trees}) != len(args.trees):
        p.error("--tree names must differ")
    if min(args.streams) < 1 or args.output_len < 2:
        p.error("need --streams >= 1 and --output-len >= 2")
    if args.profile:
        args.profile_dir.mkdir(parents=True, exist_ok=True)
    return args


if __name__ == "__main__":
    sys.exit(main())
