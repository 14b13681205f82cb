"""The online peer table from the JSONs of ``online.py`` (one per server and precision).

    python -m benchmarks.peers.online_report benchmarks/results/peers/online/h200 > table.md

Per precision and rate: TTFT and ITL p50/p99, output tok/s and goodput of each server, and
each pdserve mode's goodput and output tok/s over vLLM's at the same rate. Also names the
highest rate where vLLM still meets the SLO (every request within it: TTFT <= 1 s and
TPOT <= 50 ms), the rate the issue's goodput target is read at.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def load(folder: Path) -> dict[str, dict[str, Any]]:
    """label -> document, for every online_*.json in ``folder``."""
    out = {}
    for path in sorted(folder.glob("online_*.json")):
        doc = json.loads(path.read_text())
        out[doc["label"]] = doc
    return out


def by_rate(doc: dict[str, Any]) -> dict[float, dict[str, Any]]:
    return {run["request_rate"]: run["summary"] for run in doc["bench"]["runs"]}


def _ms(stats: dict[str, float] | None, key: str) -> str:
    return "-" if not stats else f"{stats[key]:.0f}" if stats[key] >= 100 else f"{stats[key]:.1f}"


def _ratio(ours: float | None, theirs: float | None) -> str:
    return "-" if not ours or not theirs else f"{ours / theirs:.2f}x"


def meets_slo(summary: dict[str, Any]) -> bool:
    """Every request completed and within the SLO."""
    done = summary["completed"]
    return done > 0 and summary["failed"] == 0 and summary["good_requests"] == done


def table(docs: dict[str, dict[str, Any]], precision: str) -> list[str]:
    labels = [lab for lab in docs if lab.endswith(f"-{precision}")]
    labels.sort(key=lambda lab: (not lab.startswith("vllm"), lab))
    if not labels:
        return []
    vllm = by_rate(docs[labels[0]]) if labels[0].startswith("vllm") else {}
    lines = [
        f"### {precision}",
        "",
        "| server | rate (req/s) | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | out tok/s | goodput (req/s) | tok/s vs vLLM | goodput vs vLLM |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for lab in labels:
        for rate, s in sorted(by_rate(docs[lab]).items()):
            theirs = vllm.get(rate, {})
            lines.append(
                f"| {lab.rsplit('-', 1)[0]} | {rate:g} | {_ms(s['ttft_ms'], 'p50')} / {_ms(s['ttft_ms'], 'p99')}"
                f" | {_ms(s['itl_ms'], 'p50')} / {_ms(s['itl_ms'], 'p99')} | {s['output_throughput']:.0f}"
                f" | {s['goodput'] or 0:.2f} | {_ratio(s['output_throughput'], theirs.get('output_throughput'))}"
                f" | {_ratio(s['goodput'], theirs.get('goodput'))} |"
            )
    if vllm:
        ok = [rate for rate, s in sorted(vllm.items()) if meets_slo(s)]
        lines += [
            "",
            f"Highest rate where vLLM meets the SLO: {ok[-1]:g} req/s."
            if ok
            else "vLLM met the SLO at no rate.",
        ]
    return lines + [""]


def main() -> None:
    folder = Path(sys.argv[1])
    docs = load(folder)
    for precision in ("bf16", "fp8"):
        print("\n".join(table(docs, precision)))
    for lab, doc in docs.items():
        print(f"- {lab}: `{doc['server_command']}` (ready after {doc['ready_s']:.0f} s)")


if __name__ == "__main__":
    main()
