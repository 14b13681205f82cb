"""``benchmarks.system.system_overhead``'s arithmetic and report: per-path latency summaries, the
overhead of each system over the in-process engine, and the markdown. Pure functions."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from pdserve.bench.metrics import itls_from_chunk_times, percentile, stats_ms

TARGET_TTFT_MS, TARGET_ITL_MS = 5.0, 1.0


@dataclass(slots=True)
class Stream:
    """One streamed request as its client saw it (times in seconds from the call)."""

    token_times: list[float]
    tokens: int
    text: str
    timings: dict[str, float | str] | None = None


# -- pure helpers: summaries, overhead arithmetic, the report ---------------------------------
BURST_GAP_S = 0.0002  # gaps shorter than this: tokens that arrived in one burst


def latency_summary(streams: list[Stream]) -> dict[str, Any]:
    """Latency statistics (ms) of ``streams``: ``ttft_ms``; ``itl_ms`` over every gap;
    ``first_gap_ms`` (token 1 → 2: in P/D the prefill → decode hand-off); ``steady_itl_ms``
    (the gaps after it); ``tpot_ms``, each request's mean gap (last − first) / (n − 1), which
    bursty delivery cannot hide; ``e2e_ms`` (call → last token); and ``burst_fraction``, the
    share of gaps under 0.2 ms. ValueError on no streams or a stream without tokens."""
    if not streams or any(not s.token_times for s in streams):
        raise ValueError("every stream needs at least one token")
    gaps = [itls_from_chunk_times(s.token_times) for s in streams]
    every = [g for gs in gaps for g in gs]

    def stats(values: list[float]) -> dict[str, Any] | None:
        st = stats_ms(values)
        return None if st is None else asdict(st)

    return {
        "requests": len(streams),
        "tokens": sum(s.tokens for s in streams),
        "ttft_ms": stats([s.token_times[0] for s in streams]),
        "itl_ms": stats(every),
        "first_gap_ms": stats([gs[0] for gs in gaps if gs]),
        "steady_itl_ms": stats([g for gs in gaps for g in gs[1:]]),
        "tpot_ms": stats([sum(gs) / len(gs) for gs in gaps if gs]),
        "e2e_ms": stats([s.token_times[-1] for s in streams]),
        "burst_fraction": sum(g < BURST_GAP_S for g in every) / len(every) if every else 0.0,
    }


def overhead(
    base: dict[str, Any], other: dict[str, Any], ttft_target_ms: float, itl_target_ms: float
) -> dict[str, Any]:
    """``other`` minus ``base`` (two ``latency_summary`` results): ``added_{m}_{q}_ms`` and
    ``{m}_{q}_ratio`` (other / base) for m in ttft, itl, tpot, e2e and q in p50, p99. The
    TTFT target holds when the added TTFT p50 is within it; the ITL target when both the
    added ITL p50 and the added TPOT p50 are (a bursty stream has a near-zero median gap
    but not a smaller mean one)."""
    out: dict[str, Any] = {}
    for name in ("ttft", "itl", "tpot", "e2e"):
        for q in ("p50", "p99"):
            b, o = base[f"{name}_ms"][q], other[f"{name}_ms"][q]
            out[f"added_{name}_{q}_ms"] = o - b
            out[f"{name}_{q}_ratio"] = o / b if b > 0 else None
    out["ttft_target_met"] = out["added_ttft_p50_ms"] <= ttft_target_ms
    out["itl_target_met"] = max(out["added_itl_p50_ms"], out["added_tpot_p50_ms"]) <= itl_target_ms
    return out


def paired_added(base: list[Stream], other: list[Stream]) -> dict[str, float]:
    """Median over requests of (other − base) for the same prompt, in ms: TTFT, TPOT, e2e.
    Pairs requests that ran back to back, so it is less exposed to load drift than a
    difference of medians. ValueError when the lists differ in length or are empty."""
    if not base or len(base) != len(other):
        raise ValueError(f"need equally many streams, got {len(base)} and {len(other)}")

    def tpot(s: Stream) -> float:
        n = len(s.token_times)
        return (s.token_times[-1] - s.token_times[0]) / (n - 1) if n > 1 else 0.0

    metrics = {"ttft": lambda s: s.token_times[0], "tpot": tpot, "e2e": lambda s: s.token_times[-1]}
    return {
        name: percentile([f(o) - f(b) for b, o in zip(base, other, strict=True)], 50) * 1e3
        for name, f in metrics.items()
    }


def phase_medians(streams: list[Stream]) -> dict[str, float]:
    """Median (ms) of each router phase timing, plus ``outside_router`` = client TTFT minus
    the router's own TTFT (HTTP, SSE framing, the client). Empty without timings."""
    timed = [s for s in streams if s.timings]
    if not timed:
        return {}
    # The router's order; figures that are words (``prefill_path``) have no median.
    numbers = [
        {k: v for k, v in (s.timings or {}).items() if not isinstance(v, str)} for s in timed
    ]
    keys = list(dict.fromkeys(k for t in numbers for k in t))
    out = {k: percentile([t.get(k, 0.0) for t in numbers], 50) * 1e3 for k in keys}
    outside = [s.token_times[0] - t["ttft"] for s, t in zip(timed, numbers) if "ttft" in t]
    if outside:
        out["outside_router"] = percentile(outside, 50) * 1e3
    return out


def _f(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _p(summary: dict[str, Any], key: str, q: str) -> float | None:
    stats = summary.get(key)
    return None if stats is None else float(stats[q])


LOW_LOAD_COLUMNS = (
    ("TTFT p50", "ttft_ms", "p50"), ("TTFT p99", "ttft_ms", "p99"), ("ITL p50", "itl_ms", "p50"),
    ("ITL p99", "itl_ms", "p99"), ("token 1→2 p50", "first_gap_ms", "p50"),
    ("TPOT p50", "tpot_ms", "p50"), ("e2e p50", "e2e_ms", "p50"),
)  # fmt: skip
ADDED_ROWS = (
    ("added TTFT p50 (target ≤ {ttft:g})", "added_ttft_p50_ms", ""), ("TTFT p50 ratio", "ttft_p50_ratio", "×"),
    ("added ITL p50 (target ≤ {itl:g})", "added_itl_p50_ms", ""), ("ITL p50 ratio", "itl_p50_ratio", "×"),
    ("added TPOT p50", "added_tpot_p50_ms", ""), ("TPOT p50 ratio", "tpot_p50_ratio", "×"),
    ("added TTFT p99", "added_ttft_p99_ms", ""), ("added ITL p99", "added_itl_p99_ms", ""),
    ("added e2e p50", "added_e2e_p50_ms", ""),
)  # fmt: skip


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def render_markdown(result: dict[str, Any]) -> str:
    """The report as markdown tables (a hand-written reading may be appended to the file)."""
    host, work, systems = result["host"], result["workload"], result["systems"]
    load = "/".join(
        f"{host[k][0]:.1f}" for k in ("loadavg_start", "loadavg_systems_ready", "loadavg_end")
    )
    lines = [
        "# System overhead: the P/D path vs the engine in-process",
        "",
        f"Tiny random Llama (2 layers, hidden 64); {work['requests']} requests one at a time "
        f"after {work['warmup']} warm-ups; {work['prompt_len']}-token random prompts, "
        f"{work['output_len']} output tokens, greedy, EOS ignored, streamed; 1 torch thread per "
        "engine process. In-process = `AsyncLLMEngine` driven directly (the baseline); "
        '"engine alone" = a bare `LLMEngine` stepped in a loop (the floor); both run in a '
        "worker process set up like a service's and are timed inside it. Each "
        "prompt goes through every path back to back (order rotating), so all paths share the "
        "same load. TPOT = per request (last − first token) / (n − 1). Times in ms.",
        "",
        f"Host: {host['cpu_count']} cores shared with other engineers' test runs; 1-min load "
        f"average {load} (start / systems ready / end). Whole run: {result['wall_s']:.0f} s.",
        "",
        "    " + result["command"],
        "",
        "## Low load",
        "",
        _row(["path", *(c[0] for c in LOW_LOAD_COLUMNS), "gaps < 0.2 ms"]),
        "|---|" + "---:|" * (len(LOW_LOAD_COLUMNS) + 1),
    ]
    rows = [
        ("engine alone, sync steps", result["engine_sync"]),
        ("in-process", result["inprocess"]),
    ]
    rows += [(m, s["low_load"]) for m, s in systems.items()]
    for name, summ in rows:
        cells = [_f(_p(summ, key, q)) for _, key, q in LOW_LOAD_COLUMNS]
        lines.append(_row([name, *cells, f"{summ['burst_fraction']:.0%}"]))
    t = result["targets"]
    fmt = {"ttft": t["added_ttft_p50_ms"], "itl": t["added_itl_p50_ms"]}
    lines += ["", "## Added over in-process", "", _row(["", *systems])]
    lines.append("|---|" + "---:|" * len(systems))
    for label, key, unit in ADDED_ROWS:
        cells = [_f(s["overhead"][key]) + unit for s in systems.values()]
        lines.append(_row([label.format(**fmt), *cells]))
    for name in ("ttft", "tpot", "e2e"):
        cells = [_f(s["paired_added_ms"][name]) for s in systems.values()]
        lines.append(
            _row([f"added {name.upper() if name != 'e2e' else name}, median of pairs", *cells])
        )
    verdict = {True: "met", False: "missed"}
    for label, key in (
        ("TTFT target", "ttft_target_met"),
        ("ITL target (ITL and TPOT)", "itl_target_met"),
    ):
        lines.append(_row([label, *(verdict[s["overhead"][key]] for s in systems.values())]))
    same = [
        f"{s['outputs_equal_to_inprocess']}/{s['low_load']['requests']}" for s in systems.values()
    ]
    lines.append(_row(["greedy text = in-process", *same]))
    lines += _phase_table(systems) + _sweep_table(systems, work)
    return "\n".join(lines) + "\n"


def _phase_table(systems: dict[str, Any]) -> list[str]:
    phases = list(dict.fromkeys(k for s in systems.values() for k in s["phases_ms"]))
    if not phases:
        return []
    out = ["", "## The router's own timings (`pdserve_timings`, medians, ms)", ""]
    out += [_row(["phase", *systems]), "|---|" + "---:|" * len(systems)]
    for ph in phases:
        out.append(_row([ph, *(_f(s["phases_ms"].get(ph)) for s in systems.values())]))
    return out


def _sweep_table(systems: dict[str, Any], work: dict[str, Any]) -> list[str]:
    out = ["", f"## Requests/s, closed loop ({work['sweep_output_len']} output tokens each)", ""]
    out += [_row(["path", "streams", "requests", "errors", "req/s", "output tok/s", "TTFT p50"])]
    out += ["|---|" + "---:|" * 6]
    for mode, s in systems.items():
        for lv in s["sweep"]:
            cells = [lv["concurrency"], lv["requests"], sum(lv["errors"].values())]
            cells += [_f(lv["req_per_s"], 1), _f(lv["output_tok_per_s"], 0), _f(lv["ttft_p50_ms"])]
            out.append(_row([mode, *map(str, cells)]))
    out.append("")
    for mode, s in systems.items():
        best = _f(s["max_sustained_req_s"], 1)
        out.append(f"- {mode}: best {best} req/s with zero errors; `{s['command']}` was ready "
                   f"after {s['startup_s']:.0f} s")  # fmt: skip
    return out
