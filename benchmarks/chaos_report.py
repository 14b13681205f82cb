"""Per-phase numbers of ``benchmarks/chaos.py`` and its markdown table (no I/O here)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Outcome:
    """One request: ``error`` is empty on success; ``identical`` compares with the
    undisturbed greedy output of the same prompt."""

    ok: bool
    identical: bool
    latency_s: float
    error: str = ""


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ranked = sorted(values)
    k = max(0, min(len(ranked) - 1, round(q / 100 * len(ranked) + 0.5) - 1))
    return ranked[k]


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    """Counts, errors by kind and latency percentiles of the successful requests."""
    ok = [o for o in outcomes if o.ok]
    lat = [o.latency_s for o in ok]
    p50, p99 = percentile(lat, 50), percentile(lat, 99)
    return {
        "sent": len(outcomes),
        "succeeded": len(ok),
        "identical": sum(o.identical for o in ok),
        "wrong": sum(not o.identical for o in ok),
        "failed": len(outcomes) - len(ok),
        "errors": dict(Counter(o.error for o in outcomes if not o.ok)),
        "p50_s": None if p50 is None else round(p50, 3),
        "p99_s": None if p99 is None else round(p99, 3),
    }


def _fmt(value: Any) -> str:
    return "–" if value is None else str(value)


def markdown_table(phases: list[dict[str, Any]]) -> str:
    """One row per phase (fault), then the router's counters that moved during it."""
    head = (
        "| fault | sent | ok | identical | wrong | failed (by error) | p50 s | p99 s "
        "| recovered s | router counters (delta) |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for p in phases:
        s = p["summary"]
        errors = ", ".join(f"{k}: {v}" for k, v in sorted(s["errors"].items())) or "–"
        moved = ", ".join(f"{k} +{v:g}" for k, v in sorted(p["router_counters"].items()) if v)
        rows.append(
            f"| {p['fault']} | {s['sent']} | {s['succeeded']} | {s['identical']} | {s['wrong']} "
            f"| {s['failed']} ({errors}) | {_fmt(s['p50_s'])} | {_fmt(s['p99_s'])} "
            f"| {_fmt(p['recovered_s'])} | {moved or '–'} |"
        )
    return head + "\n".join(rows) + "\n"
