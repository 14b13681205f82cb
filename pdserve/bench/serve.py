"""`pdserve bench serve`: load-test any OpenAI-compatible server over streaming HTTP.

Programmatic use (what `pdserve tune` does): build a `ServeConfig` and `await
run_serve(config)`; the CLI is a thin layer over it. `add_serve_parser(subparsers)`
registers `serve` under the `bench` command group.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import httpx

from pdserve.bench.metrics import Slo, Summary, parse_slo, summarize
from pdserve.bench.serve_client import ENDPOINTS, Target
from pdserve.bench.serve_report import format_summary, format_sweep, record_to_dict
from pdserve.bench.serve_runner import LoadSpec, RunResult, run_load
from pdserve.bench.workloads import KINDS, WorkloadSpec, build_prompts, load_codec

log = logging.getLogger(__name__)
# Prompts generated when only --duration bounds the run (they are cycled).
DURATION_POOL = 200


@dataclass(slots=True)
class ServeConfig:
    """One bench serve invocation: one run, or one per rate in `sweep_rates`."""

    target: Target
    workload: WorkloadSpec
    load: LoadSpec
    tokenizer: str | None = None
    slo: Slo | None = None
    sweep_rates: list[float] = field(default_factory=list)
    progress: bool = True

    def rates(self) -> list[float]:
        return list(self.sweep_rates) or [self.load.request_rate]


@dataclass(slots=True)
class RateRun:
    """One run at one request rate and its summary."""

    request_rate: float
    run: RunResult
    summary: Summary


async def run_serve(config: ServeConfig) -> list[RateRun]:
    """Run the workload at each rate; raises ValueError on a bad config.

    Each rate gets prompts of its own (workload seed + rate index) and warm-ups get
    prompts of their own too: a server's prefix cache must not turn a repeated prompt
    into a cheap one. (A JSONL workload is the same file every time: it repeats.)"""
    config.target.validate()
    config.load.validate()
    config.workload.validate()
    codec = load_codec(config.tokenizer)
    out = []
    for i, rate in enumerate(config.rates()):
        seed = config.workload.seed + i
        prompts = build_prompts(replace(config.workload, seed=seed), codec)
        warmups = None
        if config.load.num_warmups:
            spec = replace(config.workload, seed=seed + 7919, num_prompts=config.load.num_warmups)
            warmups = build_prompts(spec, codec)
        load = replace(config.load, request_rate=rate, seed=config.load.seed + i)
        run = await run_load(config.target, prompts, load, codec, config.progress, warmups)
        out.append(RateRun(rate, run, summarize(run.records, run.duration_s, config.slo)))
    return out


def result_json(config: ServeConfig, runs: list[RateRun], with_requests: bool) -> dict[str, Any]:
    """The `--result-json` document: the configuration and one entry per rate."""
    return {
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        # Competing load on the client's host (1, 5, 15 min), for reading noisy numbers.
        "host_loadavg": os.getloadavg(),
        "cpus": os.cpu_count(),
        "config": {
            "target": asdict(config.target),
            "workload": asdict(config.workload),
            "load": asdict(config.load),
            "tokenizer": config.tokenizer,
            "slo": None if config.slo is None else asdict(config.slo),
        },
        "runs": [
            {
                "request_rate": _json_float(r.request_rate),
                "summary": r.summary.to_dict(),
                **(
                    {"requests": [record_to_dict(x) for x in r.run.records]}
                    if with_requests
                    else {}
                ),
            }
            for r in runs
        ],
    }


def _json_float(x: float) -> float | str:
    return "inf" if math.isinf(x) else x


def discover_model(base_url: str, timeout_s: float) -> str:
    """The first model id served at `base_url` (GET /v1/models); ValueError if none."""
    url = base_url.rstrip("/").removesuffix("/v1") + "/v1/models"
    try:
        resp = httpx.get(url, timeout=min(timeout_s, 30.0), trust_env=False)
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise ValueError(f"no --model given and {url} did not name one ({exc})") from None


def _rate(text: str) -> float:
    value = float(text)
    if math.isnan(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"request rate must be > 0 or inf, got {text!r}")
    return value


def rate_list(text: str) -> list[float]:
    """`"1,2,4"` -> [1.0, 2.0, 4.0] (each > 0; `inf` allowed)."""
    rates = [_rate(part) for part in text.split(",") if part.strip()]
    if not rates:
        raise argparse.ArgumentTypeError(f"expected a comma list of rates, got {text!r}")
    return rates


def add_workload_args(parser: argparse.ArgumentParser) -> None:
    """Workload flags (shared with `pdserve tune`)."""
    w = parser.add_argument_group("workload")
    w.add_argument("--tokenizer", help="local HF tokenizer dir for sizing prompts in tokens")
    w.add_argument("--dataset-name", choices=KINDS, default="random")
    w.add_argument("--dataset-path", help="JSONL file for --dataset-name jsonl")
    w.add_argument("--input-len", default="256", help="tokens: N or LOW:HIGH (uniform)")
    w.add_argument("--output-len", default="64", help="tokens: N or LOW:HIGH (uniform)")
    w.add_argument(
        "--prefix-len", type=int, default=256, help="shared prefix tokens (prefix; chat: system)"
    )
    w.add_argument("--num-prefixes", type=int, default=4, help="prefix groups (prefix, chat)")
    w.add_argument("--num-turns", type=int, default=4, help="turns per conversation (chat)")
    w.add_argument("--seed", type=int, default=0)


def add_load_args(parser: argparse.ArgumentParser, with_rate: bool = True) -> None:
    """Arrival, bound and SLO flags (shared with `pdserve tune`, which has its own rates)."""
    a = parser.add_argument_group("load")
    a.add_argument("--num-prompts", type=int, help="requests to send (default 100)")
    a.add_argument("--duration", type=float, help="stop sending after this many seconds")
    if with_rate:
        a.add_argument("--request-rate", type=_rate, default=math.inf, help="req/s")
    a.add_argument("--burstiness", type=float, default=1.0, help="gamma shape; 1 = Poisson")
    a.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    a.add_argument("--num-warmups", type=int, default=0, help="uncounted warm-up requests")
    a.add_argument("--request-timeout", type=float, default=300.0, help="seconds per request")
    a.add_argument("--goodput", nargs="+", metavar="KEY:MS", help="SLOs: ttft:MS tpot:MS e2e:MS")


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `serve` on the `bench` group's subparsers; returns its parser."""
    p = subparsers.add_parser(
        "serve",
        help="load-test an OpenAI-compatible server (streaming)",
        description="Load-test an OpenAI-compatible server with streamed requests: TTFT, ITL, "
        "TPOT, E2E percentiles, throughput and goodput under SLOs.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    t = p.add_argument_group("target")
    t.add_argument("--base-url", default="http://127.0.0.1:8000")
    t.add_argument("--endpoint", choices=list(ENDPOINTS), default="completions")
    t.add_argument("--model", help="model name sent in the body (default: first of /v1/models)")
    t.add_argument(
        "--lora-models",
        type=lambda s: tuple(n for n in s.split(",") if n),
        default=(),
        help="comma list of LoRA adapter names: each prompt goes to one of --model and these "
        "(a mixed-adapter workload, docs/lora.md)",
    )
    t.add_argument("--temperature", type=float, default=0.0)
    t.add_argument("--request-timings", action="store_true", help='ask for "pdserve_timings"')
    add_workload_args(p)
    add_load_args(p)
    o = p.add_argument_group("output")
    o.add_argument("--sweep-rates", type=rate_list, help="comma list of rates, one run each")
    o.add_argument("--result-json", help="write results to this JSON file")
    o.add_argument("--save-requests", action="store_true", help="per-request data in the JSON")
    o.add_argument("--plot-dir", help="write PNG plots here")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=serve_command)
    return p


def workload_load_from_args(args: argparse.Namespace) -> tuple[WorkloadSpec, LoadSpec]:
    """The workload and load that the shared flags describe."""
    if args.num_prompts is not None:
        n_prompts, max_requests = args.num_prompts, args.num_prompts
    elif args.duration is not None:
        n_prompts, max_requests = DURATION_POOL, None
    else:
        n_prompts, max_requests = 100, 100
    workload = WorkloadSpec(
        kind=args.dataset_name,
        num_prompts=n_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        prefix_len=args.prefix_len,
        num_prefixes=args.num_prefixes,
        num_turns=args.num_turns,
        path=args.dataset_path,
        seed=args.seed,
    )
    load = LoadSpec(
        request_rate=getattr(args, "request_rate", math.inf),
        burstiness=args.burstiness,
        max_concurrency=args.max_concurrency,
        max_requests=max_requests,
        duration_s=args.duration,
        num_warmups=args.num_warmups,
        seed=args.seed,
    )
    workload.validate()
    load.validate()
    return workload, load


def config_from_args(args: argparse.Namespace) -> ServeConfig:
    """Translate parsed flags into a ServeConfig; ValueError on inconsistent flags."""
    workload, load = workload_load_from_args(args)
    model = args.model or discover_model(args.base_url, args.request_timeout)
    target = Target(
        base_url=args.base_url,
        model=model,
        endpoint=args.endpoint,
        timeout_s=args.request_timeout,
        request_timings=args.request_timings,
        temperature=args.temperature,
        lora_models=args.lora_models,
    )
    return ServeConfig(
        target=target,
        workload=workload,
        load=load,
        tokenizer=args.tokenizer,
        slo=parse_slo(args.goodput) if args.goodput else None,
        sweep_rates=args.sweep_rates or [],
        progress=not args.no_progress,
    )


def write_outputs(config: ServeConfig, runs: list[RateRun], args: argparse.Namespace) -> list[Path]:
    """Write the JSON and plots that the flags ask for; returns the paths written."""
    written: list[Path] = []
    if args.result_json:
        path = Path(args.result_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        doc = result_json(config, runs, args.save_requests)
        path.write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
        written.append(path)
    if args.plot_dir:
        from pdserve.bench.plots import plot_cdfs, plot_sweep

        plot_dir = Path(args.plot_dir)
        labelled = {f"rate={r.request_rate:g}": r.run.records for r in runs}
        written.append(plot_cdfs(labelled, plot_dir / "latency_cdf.png"))
        if len(runs) > 1:
            rows = [(r.request_rate, r.summary) for r in runs]
            written.append(plot_sweep(rows, plot_dir / "sweep.png"))
    return written


def serve_command(args: argparse.Namespace) -> int:
    """CLI entry: run, print the tables, write outputs. Exit 1 when no request succeeded."""
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request
    try:
        config = config_from_args(args)
        runs = asyncio.run(run_serve(config))
    except ValueError as exc:
        raise SystemExit(f"pdserve bench serve: error: {exc}") from None
    for r in runs:
        print(format_summary(r.summary, f"Serving Benchmark Result (rate={r.request_rate:g})"))
    if len(runs) > 1:
        print(format_sweep([(r.request_rate, r.summary) for r in runs]))
    for path in write_outputs(config, runs, args):
        print(f"wrote {path}")
    return 0 if any(r.summary.completed for r in runs) else 1


def main(argv: list[str] | None = None) -> int:
    """Standalone entry (`python -m pdserve.bench.serve ...`), same flags as the CLI."""
    parser = argparse.ArgumentParser(prog="pdserve bench")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["serve", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=logging.WARNING)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
