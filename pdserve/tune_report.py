"""The report of `pdserve tune`: a markdown table of every (configuration, rate), the best
configuration, its Helm values, and a goodput plot, written into the results directory."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pdserve.bench.metrics import Slo
from pdserve.tune_grid import GridPoint, best_row, helm_values

HEADER = (
    "| configuration | rate (req/s) | goodput (req/s) | req/s | out tok/s | TTFT p50 | TTFT p99 "
    "| ITL p50 | ITL p99 | TPOT p50 | E2E p99 | failed |"
)


@dataclass(slots=True)
class Report:
    """What was written: the markdown text and the best row (None when nothing finished)."""

    text: str
    best: dict[str, Any] | None


def _ms(summary: dict[str, Any], metric: str, pct: str) -> str:
    stats = summary.get(metric)
    return "-" if not stats else f"{stats[pct]:.1f}"


def table_row(row: dict[str, Any], best: bool = False) -> str:
    """One markdown row (latencies in ms); the best row is bold."""
    s = row["summary"]
    label = GridPoint(**row["point"]).label
    cells = [
        f"**{label}**" if best else label,
        f"{float(row['rate']):g}",
        f"{s['goodput'] or 0.0:.3f}",
        f"{s['request_throughput']:.3f}",
        f"{s['output_throughput']:.1f}",
        _ms(s, "ttft_ms", "p50"),
        _ms(s, "ttft_ms", "p99"),
        _ms(s, "itl_ms", "p50"),
        _ms(s, "itl_ms", "p99"),
        _ms(s, "tpot_ms", "p50"),
        _ms(s, "e2e_ms", "p99"),
        str(s["failed"]),
    ]
    return "| " + " | ".join(cells) + " |"


def format_table(rows: Sequence[dict[str, Any]], best: dict[str, Any] | None) -> str:
    sep = "|" + "---|" * (HEADER.count("|") - 1)
    return "\n".join([HEADER, sep, *(table_row(r, r is best) for r in rows)])


def _slo_text(slo: Slo) -> str:
    parts = [
        f"{name} <= {value:g} ms"
        for name, value in (("TTFT", slo.ttft_ms), ("TPOT", slo.tpot_ms), ("E2E", slo.e2e_ms))
        if value is not None
    ]
    return ", ".join(parts) or "none"


def render(rows: Sequence[dict[str, Any]], slo: Slo, command: str) -> Report:
    """The markdown report of finished rows."""
    ok = [r for r in rows if r.get("status") == "ok"]
    best = best_row(ok)
    lines = [
        "# pdserve tune",
        "",
        f"Command: `{command}`",
        "",
        f"SLOs (per request, all must hold): {_slo_text(slo)}. Goodput = requests within "
        "the SLOs per second. Latencies in ms.",
        "",
        format_table(ok, best),
        "",
    ]
    failed = [r for r in rows if r.get("status") != "ok"]
    if failed:
        lines += ["Not measured (the error's first line; full text in results.jsonl):", ""]
        for r in failed:
            first = str(r.get("error", "")).splitlines()[0:1] or [""]
            label = GridPoint(**r["point"]).label
            lines.append(f"- {label} @ {float(r['rate']):g} req/s: {r['status']}: {first[0]}")
        lines.append("")
    if best is None:
        lines.append("No configuration finished.")
    else:
        point = GridPoint(**best["point"])
        goodput = best["summary"]["goodput"] or 0.0
        lines += [
            f"Best: **{point.label}** at {float(best['rate']):g} req/s, "
            f"goodput {goodput:.3f} req/s.",
            "",
            "Helm values:",
            "",
            "```yaml",
            helm_values(point).rstrip(),
            "```",
        ]
    return Report("\n".join(lines) + "\n", best)


def write_report(out_dir: Path, rows: Sequence[dict[str, Any]], slo: Slo, command: str) -> Report:
    """Write report.md, summary.json, tune.png and (when found) values-best.yaml."""
    from pdserve.bench.plots import plot_tune

    report = render(rows, slo, command)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.md").write_text(report.text, encoding="utf-8")
    doc = {"slo": asdict(slo), "rows": list(rows), "best": report.best}
    (out_dir / "summary.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    series: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    for row in rows:
        if row.get("status") == "ok":
            label = GridPoint(**row["point"]).label
            series.setdefault(label, []).append((float(row["rate"]), row["summary"]))
    plot_tune(series, out_dir / "tune.png")
    if report.best is not None:
        point = GridPoint(**report.best["point"])
        (out_dir / "values-best.yaml").write_text(helm_values(point), encoding="utf-8")
    return report
