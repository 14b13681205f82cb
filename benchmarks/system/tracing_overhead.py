"""What OpenTelemetry tracing costs a decode service (docs/design.md §3 "Tracing"): the same
decode service twice on the tiny random Llama, once untraced and once with
``--otlp-traces-endpoint`` exporting every span to a real OTLP/gRPC receiver in this
process (tests/otlp_receiver.py).

    python -m benchmarks.system.tracing_overhead --md benchmarks/results/system/tracing_overhead.md
    # ~3 min; writes benchmarks/results/system/tracing_overhead.json

Per round, alternating which service goes first (a shared machine's noise hits both
alike): one greedy 32-token ``Decode`` stream, then ``--streams`` concurrent ones, each
with a ``traceparent`` in its metadata (the untraced service ignores it). The engine's
step loop batches them, so tokens per second over the round is the step loop's rate; a
single stream's time is what one request sees; the service process's CPU time (every
thread: the step loop, gRPC, the spans and their exporter) per token is the cost least
disturbed by other jobs on the machine. Medians of per-round values and the best round
of each; read the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import secrets
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

from benchmarks.record import recorded_command, result_path
from benchmarks.system.process_cpu import cpu_seconds
from pdserve.procs import free_ports, grpc_probe
from pdserve_api.v1 import pdserve_pb2 as pb
from pdserve_api.v1 import pdserve_pb2_grpc as pb_grpc
from tests.model_fixtures import make_tiny_llama
from tests.otlp_receiver import OtlpReceiver
from tests.service_fixtures import SMALL_ENGINE_ARGS, ServiceProcess, spawn, wait_healthy

STREAM = pb.SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)


def start(name: str, model: Path, logs: Path, endpoint: str) -> ServiceProcess:
    port, metrics_port = free_ports(2)
    argv = [
        *(sys.executable, "-m", "service", "decode", "--host", "127.0.0.1"),
        *("--port", str(port), "--metrics-port", str(metrics_port)),
        *("--model", str(model), *SMALL_ENGINE_ARGS),
        *(["--otlp-traces-endpoint", endpoint] if endpoint else []),
    ]
    child = ServiceProcess(name, spawn(name, argv, logs, {}), logs / f"{name}.log", port)
    wait_healthy(child, grpc_probe(child.address, None))
    return child


def one_stream(stub: Any, seed: int) -> float:
    prompt = [1000 + (seed * 97 + i * 13) % 30000 for i in range(64)]
    metadata = (("traceparent", f"00-{secrets.token_hex(16)}-{secrets.token_hex(8)}-01"),)
    t = time.perf_counter()
    request = pb.DecodeRequest(prompt_token_ids=prompt, params=STREAM)
    tokens = sum(len(c.token_ids) for c in stub.Decode(request, timeout=120, metadata=metadata))
    assert tokens == STREAM.max_tokens, tokens
    return time.perf_counter() - t


def one_round(svc: ServiceProcess, streams: int, seed: int) -> dict[str, float]:
    cpu = cpu_seconds(svc.proc.pid)
    with grpc.insecure_channel(svc.address) as channel:
        stub = pb_grpc.DecodeServiceStub(channel)
        single = one_stream(stub, seed)
        t = time.perf_counter()
        with ThreadPoolExecutor(streams) as pool:
            list(pool.map(lambda i: one_stream(stub, seed * 1000 + i), range(streams)))
        wall = time.perf_counter() - t
    tokens = (streams + 1) * STREAM.max_tokens
    return {
        "single_stream_s": single,
        "batch_tokens_per_s": streams * STREAM.max_tokens / wall,
        "service_cpu_ms_per_token": (cpu_seconds(svc.proc.pid) - cpu) * 1e3 / tokens,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams per round")
    parser.add_argument("--json", type=Path, default=result_path("system", "tracing_overhead.json"))
    parser.add_argument("--md", type=Path, help="also write the markdown report here")
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="tracing-bench-") as tmp, OtlpReceiver() as receiver:
        root = Path(tmp)
        model = make_tiny_llama(root / "model")
        services = {
            "off": start("off", model, root / "logs", ""),
            "on": start("on", model, root / "logs", receiver.endpoint),
        }
        try:
            for r in range(args.rounds + 1):  # round 0 warms both up
                order = ["off", "on"] if r % 2 == 0 else ["on", "off"]
                for name in order:
                    row = one_round(services[name], args.streams, r)
                    if r:
                        results[name].append(row)
        finally:
            for svc in services.values():
                svc.stop()
        spans = len(receiver.spans)
    summary = {
        name: {k: statistics.median(row[k] for row in rows) for k in rows[0]}
        for name, rows in results.items()
    }
    # The least disturbed round of each: a shared machine's load only ever slows a round
    # (throughput takes the best, i.e. highest, round; times the lowest).
    best = {
        name: {
            k: (max if k == "batch_tokens_per_s" else min)(row[k] for row in rows) for k in rows[0]
        }
        for name, rows in results.items()
    }
    ratio = {k: summary["on"][k] / summary["off"][k] for k in summary["off"]}
    data = {
        "command": recorded_command("benchmarks.system.tracing_overhead"),
        "machine": platform.platform(),
        "rounds": args.rounds,
        "streams": args.streams,
        "spans_received": spans,
        "load_average_1m": [round(load_before, 1), round(os.getloadavg()[0], 1)],
        "median": summary,
        "best": best,
        "ratio_on_over_off": ratio,
        # The spans are per call, not per token: the added CPU per Decode call.
        "added_cpu_ms_per_call": round(
            (summary["on"]["service_cpu_ms_per_token"] - summary["off"]["service_cpu_ms_per_token"])
            * STREAM.max_tokens,
            2,
        ),
        "raw": results,
    }
    args.json.write_text(json.dumps(data, indent=1) + "\n")
    table = _table(results, summary, best, ratio)
    print(table)
    if args.md:
        args.md.write_text(_report(data, table))
    return 0


def _table(
    results: dict[str, Any], summary: dict[str, Any], best: dict[str, Any], ratio: dict[str, float]
) -> str:
    lines = [
        "| measure | off (median) | on (median) | ratio | paired ratio, min–max "
        "| off (best round) | on (best round) | ratio |"
    ]
    lines.append("|---|---|---|---|---|---|---|---|")
    labels = {
        "service_cpu_ms_per_token": ("service CPU per token (ms)", 1.0),
        "batch_tokens_per_s": ("concurrent streams, tokens/s", 1.0),
        "single_stream_s": ("one 32-token stream (ms)", 1e3),
    }
    for key, (label, scale) in labels.items():
        a, b = summary["off"][key] * scale, summary["on"][key] * scale
        pairs = [y[key] / x[key] for x, y in zip(results["off"], results["on"], strict=True)]
        spread = f"{min(pairs):.2f}–{max(pairs):.2f}"
        c, d = best["off"][key] * scale, best["on"][key] * scale
        lines.append(
            f"| {label} | {a:.2f} | {b:.2f} | {ratio[key]:.3f} | {spread} | {c:.2f} | {d:.2f} "
            f"| {d / c:.3f} |"
        )
    return "\n".join(lines)


def _report(data: dict[str, Any], table: str) -> str:
    return f"""# Tracing overhead on a decode service

Command: `{data["command"]}` (repository root; `.venv`), on `{data["machine"]}`,
a shared 2-core machine (1-minute load average {data["load_average_1m"][0]} at the start,
{data["load_average_1m"][1]} at the end: other jobs ran throughout). {data["rounds"]} rounds alternating the two decode services
(tiny random Llama, 1 torch thread each), medians of per-round values and the best round
of each; per round one
stream alone, then {data["streams"]} concurrent streams. The traced service exported
{data["spans_received"]} spans to the receiver.

{table}

The engine's step loop does no tracing work: the service emits a call's spans when it
ends, from the timings its chunks already carry (service/spans.py). What tracing adds is
that span work and the exporter's batches (OTLP/gRPC, on a thread of the service's
process): per call, not per token or per step — the medians put it at
{data["added_cpu_ms_per_call"]} ms of CPU per 32-token Decode call. On this tiny model a
token costs under 1 ms of CPU, so the same cost is a visible fraction here; beside a real
model's forward it is a smaller one (not measured here). The wall-clock measures straddle 1 widely (the paired
ratios): on this machine they are the other jobs' noise, not tracing. With tracing off
nothing of OpenTelemetry is imported and no span is made (tests/unit/test_tracing.py);
what remains is one async-generator hop per chunk in the servicer.
"""


if __name__ == "__main__":
    sys.exit(main())
