"""PNG plots for bench serve and tune (matplotlib's object API: no pyplot global state).

matplotlib is imported inside the functions: it is only needed when plots are asked for.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pdserve.bench.metrics import RequestRecord, Summary

_METRICS = ("TTFT", "ITL", "TPOT", "E2E")


def _latencies_ms(records: Sequence[RequestRecord]) -> dict[str, list[float]]:
    done = [r for r in records if r.ok]
    return {
        "TTFT": [r.ttft * 1e3 for r in done if r.ttft is not None],
        "ITL": [g * 1e3 for r in done for g in r.itls],
        "TPOT": [r.tpot * 1e3 for r in done if r.tpot is not None],
        "E2E": [r.e2e * 1e3 for r in done],
    }


def plot_cdfs(runs: Mapping[str, Sequence[RequestRecord]], path: Path) -> Path:
    """Latency CDFs (one panel per metric, one line per labelled run) written to `path`."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(11, 8), layout="constrained")
    axes = fig.subplots(2, 2).ravel()
    for ax, metric in zip(axes, _METRICS, strict=True):
        for label, records in runs.items():
            values = sorted(_latencies_ms(records)[metric])
            if not values:
                continue
            ys = [(i + 1) / len(values) for i in range(len(values))]
            ax.step(values, ys, where="post", label=label)
        ax.set_title(f"{metric} CDF")
        ax.set_xlabel("ms")
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def plot_sweep(rows: Sequence[tuple[float, Summary]], path: Path) -> Path:
    """Latency percentiles and goodput/throughput against request rate, written to `path`."""
    from matplotlib.figure import Figure

    rates = [r for r, _ in rows]
    fig = Figure(figsize=(12, 4), layout="constrained")
    ax_ttft, ax_itl, ax_tput = fig.subplots(1, 3)
    for ax, attr, name in ((ax_ttft, "ttft_ms", "TTFT"), (ax_itl, "itl_ms", "ITL")):
        for pct in ("p50", "p99"):
            ys = [
                getattr(getattr(s, attr), pct) if getattr(s, attr) else float("nan")
                for _, s in rows
            ]
            ax.plot(rates, ys, marker="o", label=f"{name} {pct}")
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel("ms")
        ax.set_title(f"{name} vs request rate")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    ax_tput.plot(rates, [s.request_throughput for _, s in rows], marker="o", label="throughput")
    if any(s.goodput is not None for _, s in rows):
        goodput = [s.goodput if s.goodput is not None else float("nan") for _, s in rows]
        ax_tput.plot(rates, goodput, marker="s", label="goodput (within SLO)")
    ax_tput.plot(rates, rates, linestyle=":", color="grey", label="offered load")
    ax_tput.set_xlabel("request rate (req/s)")
    ax_tput.set_ylabel("req/s")
    ax_tput.set_title("throughput and goodput")
    ax_tput.grid(alpha=0.3)
    ax_tput.legend(fontsize="small")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def plot_tune(series: Mapping[str, Sequence[tuple[float, Mapping[str, Any]]]], path: Path) -> Path:
    """Goodput, TTFT and ITL (p50 dashed, p99 solid) against request rate, one colour per
    configuration label; `series` maps a label to (rate, summary dict) pairs."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(15, 4.5), layout="constrained")
    ax_good, ax_ttft, ax_itl = fig.subplots(1, 3)
    for i, (label, points) in enumerate(series.items()):
        pts = sorted(points, key=lambda p: p[0])
        rates = [p[0] for p in pts]
        colour = f"C{i}"
        ax_good.plot(
            rates, [p[1].get("goodput") or 0.0 for p in pts], "o-", color=colour, label=label
        )
        for ax, key in ((ax_ttft, "ttft_ms"), (ax_itl, "itl_ms")):
            for pct, style in (("p50", "--"), ("p99", "-")):
                ys = [(p[1].get(key) or {}).get(pct, float("nan")) for p in pts]
                ax.plot(rates, ys, style, marker="o", color=colour, label=f"{label} {pct}")
    for ax, title, unit in (
        (ax_good, "goodput (requests within SLO)", "req/s"),
        (ax_ttft, "TTFT", "ms"),
        (ax_itl, "ITL", "ms"),
    ):
        ax.set_title(title)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(unit)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize="small")
    fig.suptitle("pdserve tune")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path
