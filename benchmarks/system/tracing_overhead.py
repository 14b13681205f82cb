"""What OpenTelemetry tracing costs a decode service (docs/design.md §3 "Tracing"): the same
decode service twice on the tiny random Llama, once untraced and once with
``--otlp-traces-endpoint`` exporting every span to a real OTLP/gRPC receiver in this
process (tests/otlp_receiver.py).

    python -m benchmarks.system.tracing_overhead --md benchmarks/results/system/tracing_overhead.md
    # ~3 min; writes benchmarks/results/system/tracing_overhead.json

Per round, alternating which service goes first (a shared machine's noise hits both
alike): ``--streams`` concurrent greedy 32-token ``Decode`` streams, each with a
``traceparent`` in its metadata (the untraced service ignores it). The engine's step loop
batches them, so tokens per second over the round is the step loop's rate; a single
stream's time is what one request sees. Medians of per-round values; read the ratios.
"""

from __future__ import annotations

import argparse
import json
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


def one_round(address: str, streams: int, seed: int) -> dict[str, float]:
    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.DecodeServiceStub(channel)
        single = one_stream(stub, seed)
        t = time.perf_counter()
        with ThreadPoolExecutor(streams) as pool:
            list(pool.map(lambda i: one_stream(stub, seed * 1000 + i), range(streams)))
        wall = time.perf_counter() - t
    return {"single_stream_s": single, "batch_tokens_per_s": streams * STREAM.max_tokens / wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=12)
    parser.add_argument("--streams", type=int, default=8, help="concurrent streams per round")
    parser.add_argument("--json", type=Path, default=result_path("system", "tracing_overhead.json"))
    parser.add_argument("--md", type=Path, help="also write the markdown report here")
    args = parser.parse_args()
    results: dict[str, list[dict[str, float]]] = {"off": [], "on": []}
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
                    row = one_round(services[name].address, args.streams, r)
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
    ratio = {k: summary["on"][k] / summary["off"][k] for k in summary["off"]}
    data = {
        "command": recorded_command("benchmarks.system.tracing_overhead"),
        "machine": platform.platform(),
        "rounds": args.rounds,
        "streams": args.streams,
        "spans_received": spans,
        "median": summary,
        "ratio_on_over_off": ratio,
        "raw": results,
    }
    args.json.write_text(json.dumps(data, indent=1) + "\n")
    table = _table(results, summary, ratio)
    print(table)
    if args.md:
        args.md.write_text(_report(data, table))
    return 0


def _table(results: dict[str, Any], summary: dict[str, Any], ratio: dict[str, float]) -> str:
    lines = ["| measure | tracing off | tracing on | ratio | paired ratio, min–max |"]
    lines.append("|---|---|---|---|---|")
    labels = {
        "batch_tokens_per_s": "concurrent streams, tokens/s",
        "single_stream_s": "one 32-token stream (ms)",
    }
    for key, label in labels.items():
        scale = 1e3 if key.endswith("_s") else 1.0
        a, b = summary["off"][key] * scale, summary["on"][key] * scale
        pairs = [y[key] / x[key] for x, y in zip(results["off"], results["on"], strict=True)]
        spread = f"{min(pairs):.2f}–{max(pairs):.2f}"
        lines.append(f"| {label} | {a:.1f} | {b:.1f} | {ratio[key]:.3f} | {spread} |")
    return "\n".join(lines)


def _report(data: dict[str, Any], table: str) -> str:
    return f"""# Tracing overhead on a decode service

Command: `{data["command"]}` (repository root; `.venv`), on `{data["machine"]}`,
a shared 2-core machine. {data["rounds"]} rounds alternating the two decode services
(tiny random Llama, 1 torch thread each), medians of per-round values; per round one
stream alone, then {data["streams"]} concurrent streams. The traced service exported
{data["spans_received"]} spans to the receiver.

{table}

The engine's step loop does no tracing work: the service emits a call's spans when it
ends, from the timings its chunks already carry (service/spans.py). What tracing
adds is that span work and the exporter's batches, on the service's process. Read the
ratios with their spread: one that straddles 1 is the machine's noise. With tracing off
nothing of OpenTelemetry is imported (tests/unit/test_tracing.py).
"""


if __name__ == "__main__":
    sys.exit(main())
