"""Text and JSON renderings of bench serve results (pure: strings and dicts in, out)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from pdserve.bench.metrics import RequestRecord, Stats, Summary

_WIDTH = 56


def _row(label: str, value: object) -> str:
    if isinstance(value, float):
        value = f"{value:.2f}"
    return f"{label:<40}{value!s:>16}"


def _section(title: str) -> str:
    return f" {title} ".center(_WIDTH, "-")


def _stats_rows(name: str, stats: Stats | None) -> list[str]:
    if stats is None:
        return [_row(f"{name} (ms):", "n/a")]
    return [
        _row(f"Mean {name} (ms):", stats.mean),
        _row(f"P50 {name} (ms):", stats.p50),
        _row(f"P90 {name} (ms):", stats.p90),
        _row(f"P99 {name} (ms):", stats.p99),
    ]


def format_summary(summary: Summary, title: str = "Serving Benchmark Result") -> str:
    """The end-of-run table, in the layout of `vllm bench serve`."""
    lines = [
        f" {title} ".center(_WIDTH, "="),
        _row("Successful requests:", summary.completed),
        _row("Failed requests:", summary.failed),
    ]
    lines += [_row(f"  errors[{kind}]:", n) for kind, n in summary.errors.items()]
    lines += [
        _row("Benchmark duration (s):", summary.duration_s),
        _row("Total input tokens:", summary.input_tokens),
        _row("Total generated tokens:", summary.output_tokens),
        _row("Prefix cache hit rate:", summary.prefix_hit_rate),
        _row("Request throughput (req/s):", summary.request_throughput),
        _row("Output token throughput (tok/s):", summary.output_throughput),
        _row("Total token throughput (tok/s):", summary.total_token_throughput),
    ]
    if summary.goodput is not None:
        lines.append(_row("Request goodput (req/s):", summary.goodput))
        lines.append(_row("Requests within SLO:", summary.good_requests))
    for title_, name, stats in (
        ("Time to First Token", "TTFT", summary.ttft_ms),
        ("Time per Output Token (excl. 1st token)", "TPOT", summary.tpot_ms),
        ("Inter-token Latency", "ITL", summary.itl_ms),
        ("End-to-end Latency", "E2E", summary.e2e_ms),
    ):
        lines.append(_section(title_))
        lines += _stats_rows(name, stats)
    if summary.phase_ms:
        lines.append(_section("Router phase timings"))
        for phase, stats in summary.phase_ms.items():
            lines.append(_row(f"{phase} mean / p99 (ms):", f"{stats.mean:.2f} / {stats.p99:.2f}"))
    lines.append("=" * _WIDTH)
    return "\n".join(lines)


def _p(stats: Stats | None, attr: str) -> str:
    return "-" if stats is None else f"{getattr(stats, attr):.1f}"


SWEEP_HEADER = (
    "| rate (req/s) | done | failed | req/s | out tok/s | TTFT p50 | TTFT p99 "
    "| ITL p50 | ITL p99 | TPOT p50 | E2E p99 | goodput (req/s) |"
)


def sweep_row(rate: float, s: Summary) -> str:
    """One markdown table row of a rate sweep (latencies in ms)."""
    goodput = "-" if s.goodput is None else f"{s.goodput:.2f}"
    cells = [
        f"{rate:g}",
        str(s.completed),
        str(s.failed),
        f"{s.request_throughput:.2f}",
        f"{s.output_throughput:.1f}",
        _p(s.ttft_ms, "p50"),
        _p(s.ttft_ms, "p99"),
        _p(s.itl_ms, "p50"),
        _p(s.itl_ms, "p99"),
        _p(s.tpot_ms, "p50"),
        _p(s.e2e_ms, "p99"),
        goodput,
    ]
    return "| " + " | ".join(cells) + " |"


def format_sweep(rows: Sequence[tuple[float, Summary]]) -> str:
    """A markdown table with one row per request rate."""
    sep = "|" + "---|" * (SWEEP_HEADER.count("|") - 1)
    return "\n".join([SWEEP_HEADER, sep, *(sweep_row(r, s) for r, s in rows)])


def record_to_dict(rec: RequestRecord) -> dict[str, Any]:
    """A request record as JSON-ready data (times in seconds)."""
    out = asdict(rec)
    out["ttft"] = rec.ttft
    out["tpot"] = rec.tpot
    return out
