"""`pdserve tune`: find the `pdserve up` configuration with the highest goodput under SLOs.

For every grid point (prefill:decode split, router mode, per-pool tensor-parallel sizes,
`--max-num-seqs`, `--max-num-batched-tokens`) it starts `pdserve up` on a free port, runs `bench serve`
in-process at each request rate, and appends one line per (point, rate) to
`OUT/results.jsonl`; a re-run with the same workload skips what is already there. At the
end it writes `report.md` (table, best configuration, Helm values), `tune.png` and
`values-best.yaml` into OUT.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import re
import shlex
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve.bench.metrics import Slo, parse_slo
from pdserve.bench.serve import (
    ServeConfig,
    add_load_args,
    add_workload_args,
    discover_model,
    rate_list,
    run_serve,
    workload_load_from_args,
)
from pdserve.bench.serve_client import ENDPOINTS, Target
from pdserve.bench.serve_runner import LoadSpec
from pdserve.bench.workloads import WorkloadSpec
from pdserve.tune_grid import (
    MODES,
    GridPoint,
    ResultsFile,
    bench_fingerprint,
    build_grid,
    parse_ratios,
    point_row,
)
from pdserve.tune_launch import LaunchFailed, UpProcess, free_port
from pdserve.tune_report import write_report

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TunePlan:
    """Everything one tune needs, validated."""

    grid: list[GridPoint]
    rates: list[float]
    model: str
    tokenizer: str | None
    workload: WorkloadSpec
    load: LoadSpec
    slo: Slo
    out_dir: Path
    endpoint: str = "completions"
    device: str = "cpu"
    connector: str = "fs"
    up_args: list[str] = field(default_factory=list)
    pdserve_cmd: list[str] = field(default_factory=lambda: [sys.executable, "-m", "pdserve"])
    startup_timeout_s: float = 600.0
    request_timeout_s: float = 300.0
    request_timings: bool = False
    progress: bool = True

    def fingerprint(self) -> str:
        load = dataclasses.asdict(self.load)
        load.pop("request_rate")
        return bench_fingerprint(
            {
                "model": self.model,
                "tokenizer": self.tokenizer,
                "workload": dataclasses.asdict(self.workload),
                "load": load,
                "slo": dataclasses.asdict(self.slo),
                "endpoint": self.endpoint,
                "device": self.device,
                "connector": self.connector,
                "up_args": self.up_args,
                "request_timeout_s": self.request_timeout_s,
            }
        )

    def up_argv(self, point: GridPoint, port: int) -> list[str]:
        """The full `pdserve up` command line for one grid point."""
        return [
            *self.pdserve_cmd,
            "up",
            "--model",
            self.model,
            "--port",
            str(port),
            "--device",
            self.device,
            "--connector",
            self.connector,
            *point.up_args(),
            *self.up_args,
        ]


def _int_list(text: str | None, flag: str) -> list[int | None]:
    if not text:
        return [None]
    try:
        values = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes a comma list of integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"{flag} values must be >= 1, got {text!r}")
    return list(values)


def _instances(args: argparse.Namespace) -> tuple[int, int | None]:
    """(engine instances per configuration, GPU budget or None). With per-pool TP sizes
    both may be given: N engines, the points that need more than G GPUs dropped."""
    splits = bool(args.prefill_tensor_parallel_sizes or args.decode_tensor_parallel_sizes)
    if args.instances is None and args.gpu_budget is None:
        raise ValueError("give --instances N or --gpu-budget G")
    if args.instances is not None and args.gpu_budget is not None and not splits:
        raise ValueError(
            "give exactly one of --instances N or --gpu-budget G (both only with "
            "--prefill/--decode-tensor-parallel-sizes)"
        )
    if args.instances is not None:
        return int(args.instances), args.gpu_budget
    if args.gpus_per_instance < 1 or args.gpu_budget < args.gpus_per_instance:
        raise ValueError("--gpu-budget must be >= --gpus-per-instance >= 1")
    return int(args.gpu_budget // args.gpus_per_instance), int(args.gpu_budget)


def visible_gpus(up_args: list[str], environ: Mapping[str, str]) -> int | None:
    """The GPUs every `pdserve up` may spread over when no --gpu-budget is given: its
    ``--gpus N`` or ``--gpu-ids`` (from --up-arg), else ``CUDA_VISIBLE_DEVICES``; None
    when unknown (then no split is dropped for want of GPUs)."""
    for i, word in enumerate(up_args[:-1]):
        if word == "--gpus":
            return int(up_args[i + 1])
        if word == "--gpu-ids":
            return len([x for x in up_args[i + 1].split(",") if x.strip()])
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    return len([x for x in visible.split(",") if x.strip()]) if visible else None


def tp_sizes(text: str | None, flag: str) -> list[int]:
    """A pool's tensor-parallel sizes to try (a comma list); [1] when unset."""
    return [int(v) for v in _int_list(text, flag) if v is not None] if text else [1]


def valid_tp_sizes(model: str, flag: str, sizes: list[int]) -> list[int]:
    """The sizes that split the model's heads and KV heads (the engine's rule,
    ``pdserve/gpus.py``); each dropped one is logged with the reason. ValueError naming
    the flag when none is left."""
    from pdserve.gpus import check_tensor_parallel_size
    from pdserve.procs import LaunchError

    valid = []
    for size in sizes:
        try:
            check_tensor_parallel_size(model, size)
        except LaunchError as exc:
            log.warning("%s: %d skipped (%s)", flag, size, exc)
            continue
        valid.append(size)
    if not valid:
        raise ValueError(f"{flag}: no size in {sizes} splits {model}'s heads and KV heads")
    return valid


def _default_tokenizer(model: str) -> str:
    """The model's own directory: a path as given, or a known name resolved (pulled)."""
    if os.path.isdir(model):
        return model
    from common.models import resolve_model  # may pull the model on first use

    return resolve_model(model)


def plan_from_args(args: argparse.Namespace) -> TunePlan:
    """Validate the flags into a plan; ValueError with the flag's name when they are wrong."""
    if not args.goodput:
        raise ValueError("--goodput is required: tune maximises goodput under these SLOs")
    instances, budget = _instances(args)
    up_args = [a for item in args.up_arg for a in shlex.split(item)]
    if budget is None and args.device == "cuda":
        budget = visible_gpus(up_args, os.environ)
    sizes = {
        "--prefill-tensor-parallel-sizes": tp_sizes(
            args.prefill_tensor_parallel_sizes, "--prefill-tensor-parallel-sizes"
        ),
        "--decode-tensor-parallel-sizes": tp_sizes(
            args.decode_tensor_parallel_sizes, "--decode-tensor-parallel-sizes"
        ),
    }
    if any(size > 1 for values in sizes.values() for size in values):
        model_dir = _default_tokenizer(args.model)
        sizes = {flag: valid_tp_sizes(model_dir, flag, v) for flag, v in sizes.items()}
    grid = build_grid(
        instances,
        [m.strip() for m in args.modes.split(",") if m.strip()],
        parse_ratios(args.ratios) if args.ratios else None,
        _int_list(args.max_num_seqs, "--max-num-seqs"),
        _int_list(args.max_num_batched_tokens, "--max-num-batched-tokens"),
        sizes["--prefill-tensor-parallel-sizes"],
        sizes["--decode-tensor-parallel-sizes"],
        budget,
    )
    workload, load = workload_load_from_args(args)
    return TunePlan(
        grid=grid,
        rates=args.request_rates,
        model=args.model,
        tokenizer=args.tokenizer or (None if args.dry_run else _default_tokenizer(args.model)),
        workload=workload,
        load=load,
        slo=parse_slo(args.goodput),
        out_dir=Path(args.out),
        endpoint=args.endpoint,
        device=args.device,
        connector=args.connector,
        up_args=up_args,
        pdserve_cmd=shlex.split(args.pdserve_cmd)
        if args.pdserve_cmd
        else [sys.executable, "-m", "pdserve"],
        startup_timeout_s=args.startup_timeout,
        request_timeout_s=args.request_timeout,
        request_timings=args.request_timings,
        progress=not args.no_progress,
    )


def _slug(point: GridPoint) -> str:
    return re.sub(r"[^A-Za-z0-9_.=-]+", "_", point.key)


def run_point(plan: TunePlan, point: GridPoint, rates: list[float], results: ResultsFile) -> None:
    """Start `pdserve up` for `point`, bench each rate, append a line per rate."""
    port = free_port()
    log_dir = plan.out_dir / "logs" / _slug(point)
    # --log-dir keeps every child's log (router, services) next to the launcher's output.
    argv = [*plan.up_argv(point, port), "--log-dir", str(log_dir)]
    with UpProcess(argv, log_dir / "up.log", plan.startup_timeout_s):
        base_url = f"http://127.0.0.1:{port}"
        served = discover_model(base_url, 30.0)
        for rate in rates:
            target = Target(
                base_url,
                served,
                plan.endpoint,
                timeout_s=plan.request_timeout_s,
                request_timings=plan.request_timings,
            )
            # Fresh prompts per rate (same ones for every configuration): one server must
            # not serve a repeated prompt from its prefix cache.
            k = plan.rates.index(rate)
            config = ServeConfig(
                target=target,
                workload=dataclasses.replace(plan.workload, seed=plan.workload.seed + 101 * k),
                load=dataclasses.replace(plan.load, request_rate=rate, seed=plan.load.seed + k),
                tokenizer=plan.tokenizer,
                slo=plan.slo,
                progress=plan.progress,
            )
            (run,) = asyncio.run(run_serve(config))
            s = run.summary
            # The host's load average says how much others competed for the cores.
            row = point_row(point, rate, "ok", label=point.label, summary=s.to_dict())
            results.append({**row, "host_loadavg": os.getloadavg(), "cpus": os.cpu_count()})
            log.info(
                "%s @ %g req/s: goodput %.3f req/s, %d failed",
                point.label,
                rate,
                s.goodput or 0.0,
                s.failed,
            )


def run_tune(plan: TunePlan) -> list[dict[str, Any]]:
    """Run every unfinished (point, rate); return the latest row of each (finished or
    failed), in grid order."""
    results = ResultsFile(plan.out_dir / "results.jsonl", plan.fingerprint())
    done = results.load()
    for i, point in enumerate(plan.grid, 1):
        missing = [r for r in plan.rates if (point.key, r) not in done]
        if not missing:
            log.info("[%d/%d] %s: already done, skipped", i, len(plan.grid), point.label)
            continue
        log.info("[%d/%d] %s: rates %s", i, len(plan.grid), point.label, missing)
        try:
            run_point(plan, point, missing, results)
        except LaunchFailed as exc:
            log.error("%s: %s", point.label, exc)
            for rate in missing:
                if (point.key, rate) not in results.load():
                    results.append(point_row(point, rate, "launch_failed", error=str(exc)[-4000:]))
    latest = results.load_latest()
    return [latest[(p.key, r)] for p in plan.grid for r in plan.rates if (p.key, r) in latest]


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `pdserve tune`."""
    p = subparsers.add_parser(
        "tune",
        help="sweep P:D ratio and engine knobs for max goodput under SLOs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    g = p.add_argument_group("grid")
    g.add_argument("--model", default="smollm2", help="model name or local HF dir for pdserve up")
    g.add_argument("--instances", type=int, help="engine instances per configuration")
    g.add_argument("--gpu-budget", type=int, help="GPUs in all (instances = budget / per-instance)")
    g.add_argument("--gpus-per-instance", type=int, default=1)
    g.add_argument("--modes", default="colocated,disaggregated", help=f"comma list of {MODES}")
    g.add_argument("--ratios", help="prefill:decode ratios, e.g. 1:1,1:3 (default: every split)")
    g.add_argument("--max-num-seqs", help="comma list of values (default: engine default)")
    g.add_argument("--max-num-batched-tokens", help="comma list of values (default: engine's)")
    g.add_argument(
        "--prefill-tensor-parallel-sizes",
        help="comma list of the prefill pool's TP sizes to try (each must split the model's "
        "heads and KV heads; default 1)",
    )
    g.add_argument(
        "--decode-tensor-parallel-sizes",
        help="comma list of the decode pool's TP sizes to try (default 1); with "
        "--instances, --gpu-budget drops the splits needing more GPUs (CPU: processes)",
    )
    g.add_argument("--connector", default="fs", choices=["fs", "redis", "lmcache"])
    g.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    g.add_argument("--up-arg", action="append", default=[], help="extra `pdserve up` flags")
    g.add_argument("--pdserve-cmd", help="how to run pdserve (default: this python -m pdserve)")
    g.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to be ready")
    add_workload_args(p)
    add_load_args(p, with_rate=False)
    b = p.add_argument_group("bench")
    b.add_argument("--request-rates", type=rate_list, default=[1.0], help="comma list, req/s")
    b.add_argument("--endpoint", choices=list(ENDPOINTS), default="completions")
    b.add_argument("--request-timings", action="store_true", help='ask for "pdserve_timings"')
    b.add_argument("--out", required=True, help="results directory (resumable)")
    b.add_argument("--dry-run", action="store_true", help="print the grid and exit")
    b.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=tune_command)
    return p


def tune_command(args: argparse.Namespace) -> int:
    """CLI entry: 0 when a best configuration was found, 1 otherwise."""
    try:
        plan = plan_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"pdserve tune: error: {exc}") from None
    if args.dry_run:
        for point in plan.grid:
            print(shlex.join(plan.up_argv(point, 0)), "# rates", plan.rates)
        return 0
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request
    # SIGTERM must unwind like Ctrl-C so the running `pdserve up` group gets stopped.
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        rows = run_tune(plan)
    finally:
        signal.signal(signal.SIGTERM, previous)
    command = "pdserve " + shlex.join(sys.argv[1:])
    report = write_report(plan.out_dir, rows, plan.slo, command)
    print(report.text)
    return 0 if report.best is not None else 1


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")
