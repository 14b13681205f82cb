"""Per-phase numbers of ``benchmarks.system.chaos`` and its markdown tables (no I/O here)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class Outcome:
    """One request: ``error`` is empty on success; ``identical`` compares with the
    undisturbed greedy output of the same prompt. ``hung``: no answer within the client's
    deadline (a failure that must not happen); ``cancelled``: the client hung up mid-stream
    on purpose (the disconnect phase), neither a success nor a failure. ``started`` and
    ``ended`` are ``time.monotonic()`` readings."""

    ok: bool
    identical: bool
    latency_s: float
    error: str = ""
    hung: bool = False
    cancelled: bool = False
    started: float = 0.0
    ended: float = 0.0


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ranked = sorted(values)
    k = max(0, min(len(ranked) - 1, round(q / 100 * len(ranked) + 0.5) - 1))
    return ranked[k]


def first_ok_after(outcomes: list[Outcome], t: float) -> float | None:
    """Seconds from ``t`` until the first request started after ``t`` ended identical."""
    ends = [o.ended for o in outcomes if o.ok and o.identical and o.started >= t]
    return round(min(ends) - t, 2) if ends else None


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    """Counts, errors by kind and latency percentiles of the successful requests."""
    done = [o for o in outcomes if not o.cancelled]
    ok = [o for o in done if o.ok]
    lat = [o.latency_s for o in ok]
    p50, p99 = percentile(lat, 50), percentile(lat, 99)
    return {
        "sent": len(outcomes),
        "cancelled": len(outcomes) - len(done),
        "succeeded": len(ok),
        "identical": sum(o.identical for o in ok),
        "wrong": sum(not o.identical for o in ok),
        "failed": len(done) - len(ok),
        "failed_clear": sum(not o.ok and not o.hung for o in done),
        "hung": sum(o.hung for o in done),
        "errors": dict(Counter(o.error for o in done if not o.ok)),
        "p50_s": None if p50 is None else round(p50, 3),
        "p99_s": None if p99 is None else round(p99, 3),
    }


def _fmt(value: Any) -> str:
    return "–" if value is None else str(value)


def _moved(counters: dict[str, float]) -> str:
    return ", ".join(f"{k} +{v:g}" for k, v in sorted(counters.items()) if v) or "–"


def _injected(what: dict[str, Any] | None) -> str:
    if not what:
        return "–"
    return ", ".join(f"{k}: {v}" for k, v in what.items()).replace("|", "/")


def markdown_table(phases: list[dict[str, Any]]) -> str:
    """One row per phase (fault), then the counters that moved during it."""
    head = (
        "| fault | sent | identical | wrong | failed, clear error (by error) | hung "
        "| cancelled | p50 s | p99 s | recovered s | first ok s | router counters (delta) "
        "| service counters (delta) | unrelated stream: worst stall s "
        "| unrelated stream: first token p50 / worst s | injected |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for p in phases:
        s = p["summary"]
        watch = p.get("unrelated_stream") or {}
        errors = ", ".join(f"{k}: {v}" for k, v in sorted(s["errors"].items())) or "–"
        extra = f" ({p['poisoned']} poisoned" if p.get("poisoned") is not None else ""
        if p.get("special_files_left") is not None:
            extra += f", {p['special_files_left']} special left"
        extra += ")" if extra else ""
        rows.append(
            f"| {p['fault']}{extra} | {s['sent']} | {s['identical']} | {s['wrong']} "
            f"| {s['failed_clear']} ({errors}) | {s['hung']} | {s['cancelled']} "
            f"| {_fmt(s['p50_s'])} | {_fmt(s['p99_s'])} | {_fmt(p['recovered_s'])} "
            f"| {_fmt(p.get('first_ok_s'))} | {_moved(p['router_counters'])} "
            f"| {_moved(p.get('service_counters', {}))} "
            f"| {_fmt(watch.get('worst_stall_s'))} "
            f"| {_fmt(watch.get('first_token_p50_s'))} / {_fmt(watch.get('first_token_worst_s'))} "
            f"| {_injected(p.get('injected'))} |"
        )
    return head + "\n".join(rows) + "\n"


def settle_table(phases: list[dict[str, Any]]) -> str:
    """Each process's RSS at a phase's start and ``--settle-seconds`` after its end, and
    the change in %; empty without ``--settle-seconds``."""
    rows = []
    for p in phases:
        settled = p.get("rss_settled_mib") or {}
        for name, now in sorted(settled.items()):
            start = (p.get("rss_mib") or {}).get(name, [None])[0]
            change = f"{100 * (now - start) / start:+.1f}" if start and now else "–"
            rows.append(f"| {p['fault']} | {name} | {_fmt(start)} → {_fmt(now)} | {change} |")
    if not rows:
        return ""
    head = "| phase | process | RSS MiB at start → after settling | change % |\n|---|---|---|---|\n"
    return head + "\n".join(rows) + "\n"


def soak_table(before: dict[str, Any], after: dict[str, Any]) -> str:
    """The soak reading before and after the whole run, one row per process."""
    rows = [
        "| process | pid before → after | RSS MiB before → after | open fds before → after "
        "| KV usage / running / waiting after |",
        "|---|---|---|---|---|",
    ]
    for name, b in before["processes"].items():
        a = after["processes"].get(name, {})
        g = after["kv_gauges"].get(name, {})
        gauges = " / ".join(
            _fmt(g.get(f"pdserve_engine_{k}")) for k in ("kv_usage", "running", "waiting")
        )
        rows.append(
            f"| {name} | {b['pid']} → {_fmt(a.get('pid'))} | {_fmt(b['rss_mib'])} → "
            f"{_fmt(a.get('rss_mib'))} | {_fmt(b['open_fds'])} → {_fmt(a.get('open_fds'))} "
            f"| {gauges if g else '–'} |"
        )
    rows.append(
        f"\nRun directory and fs store: {before['run_dir_files']} → {after['run_dir_files']} files, "
        f"{before['run_dir_bytes']} → {after['run_dir_bytes']} bytes; temp files "
        f"{len(before['temp_files'])} → {len(after['temp_files'])}, FIFOs/links "
        f"{len(before['special_files'])} → {len(after['special_files'])}"
        + (f" ({', '.join(after['temp_files'][:5])})" if after["temp_files"] else "")
        + ".\n"
    )
    return "\n".join(rows)
