"""Latency and throughput math for `pdserve bench serve`: pure functions over request records.

Definitions (the ones `vllm bench serve` uses, so numbers compare):
- TTFT: request sent -> first content chunk received.
- ITL: the gap between two consecutive content chunks of one request (one value per chunk
  gap, so a chunk carrying several tokens counts once, as the client saw it).
- TPOT: (E2E - TTFT) / (output_tokens - 1), the mean time per output token after the first;
  undefined (skipped) for single-token outputs.
- E2E: request sent -> stream finished.
- Goodput: completed requests meeting every given SLO, per second of benchmark duration.
Percentiles interpolate linearly between closest ranks (numpy's default "linear" method).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

PERCENTILES = (50.0, 90.0, 99.0)
SLO_KEYS = ("ttft", "tpot", "e2e")


@dataclass(slots=True)
class RequestRecord:
    """What one request did. Times are seconds; `chunk_times` are offsets from `start`."""

    prompt_tokens: int
    start: float = 0.0
    ok: bool = False
    error: str | None = None  # error kind when not ok: "timeout", "connect", "http_503", ...
    error_detail: str = ""
    output_tokens: int = 0
    chunk_times: list[float] = field(default_factory=list)
    e2e: float = 0.0
    timings: dict[str, float] | None = None  # router's per-phase timings, when asked
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens: prefix-cache hits

    @property
    def ttft(self) -> float | None:
        return self.chunk_times[0] if self.chunk_times else None

    @property
    def itls(self) -> list[float]:
        return itls_from_chunk_times(self.chunk_times)

    @property
    def tpot(self) -> float | None:
        return tpot(self.e2e, self.ttft, self.output_tokens)


@dataclass(slots=True)
class Slo:
    """Service-level objectives in milliseconds; None means "not constrained"."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None
    e2e_ms: float | None = None

    def is_empty(self) -> bool:
        return self.ttft_ms is None and self.tpot_ms is None and self.e2e_ms is None


@dataclass(slots=True)
class Stats:
    """Mean and percentiles of one latency, in milliseconds."""

    mean: float
    p50: float
    p90: float
    p99: float
    count: int


@dataclass(slots=True)
class Summary:
    """Aggregate result of one benchmark run."""

    duration_s: float
    completed: int
    failed: int
    errors: dict[str, int]
    input_tokens: int
    output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    goodput: float | None
    good_requests: int | None
    ttft_ms: Stats | None
    tpot_ms: Stats | None
    itl_ms: Stats | None
    e2e_ms: Stats | None
    phase_ms: dict[str, Stats]
    cached_tokens: int = 0  # prompt tokens the servers' prefix caches served

    @property
    def prefix_hit_rate(self) -> float:
        """Share of the prompt tokens served from a prefix cache (what the server reports)."""
        return self.cached_tokens / self.input_tokens if self.input_tokens else 0.0

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "prefix_hit_rate": self.prefix_hit_rate}


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) of `values` with linear interpolation between ranks.

    Raises ValueError on an empty sequence or q outside [0, 100].
    """
    if not values:
        raise ValueError("percentile of an empty sequence")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    frac = rank - low
    return ordered[low] + (ordered[high] - ordered[low]) * frac


def itls_from_chunk_times(chunk_times: Sequence[float]) -> list[float]:
    """Gaps between consecutive chunk arrival times (seconds). Times must not decrease."""
    gaps = [b - a for a, b in zip(chunk_times, chunk_times[1:], strict=False)]
    if any(g < 0 for g in gaps):
        raise ValueError("chunk times must be non-decreasing")
    return gaps


def tpot(e2e: float, ttft: float | None, output_tokens: int) -> float | None:
    """Mean time per output token after the first, or None when it is undefined."""
    if ttft is None or output_tokens < 2:
        return None
    return (e2e - ttft) / (output_tokens - 1)


def stats_ms(values_s: Sequence[float]) -> Stats | None:
    """Mean/p50/p90/p99 in milliseconds of values given in seconds; None when empty."""
    if not values_s:
        return None
    ms = [v * 1000.0 for v in values_s]
    p50, p90, p99 = (percentile(ms, q) for q in PERCENTILES)
    return Stats(mean=sum(ms) / len(ms), p50=p50, p90=p90, p99=p99, count=len(ms))


def parse_slo(items: Iterable[str]) -> Slo:
    """Parse `["ttft:500", "tpot:50", "e2e:2000"]` (milliseconds) into an Slo.

    Raises ValueError naming the bad item on an unknown key, a malformed item, a repeated
    key or a non-positive value.
    """
    values: dict[str, float] = {}
    for item in items:
        key, sep, raw = item.partition(":")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"bad --goodput item {item!r}: expected KEY:MS with KEY in {SLO_KEYS}")
        if key in values:
            raise ValueError(f"--goodput key {key!r} given twice")
        try:
            ms = float(raw)
        except ValueError:
            raise ValueError(f"bad --goodput value in {item!r}: not a number") from None
        if not ms > 0 or math.isinf(ms):
            raise ValueError(f"bad --goodput value in {item!r}: must be a positive number")
        values[key] = ms
    return Slo(ttft_ms=values.get("ttft"), tpot_ms=values.get("tpot"), e2e_ms=values.get("e2e"))


def meets_slo(record: RequestRecord, slo: Slo) -> bool:
    """True when a completed request is within every SLO bound (undefined TPOT passes)."""
    if not record.ok:
        return False
    ttft = record.ttft
    if slo.ttft_ms is not None and (ttft is None or ttft * 1000.0 > slo.ttft_ms):
        return False
    rec_tpot = record.tpot
    if slo.tpot_ms is not None and rec_tpot is not None and rec_tpot * 1000.0 > slo.tpot_ms:
        return False
    return not (slo.e2e_ms is not None and record.e2e * 1000.0 > slo.e2e_ms)


def summarize(records: Sequence[RequestRecord], duration_s: float, slo: Slo | None) -> Summary:
    """Aggregate records of one run lasting `duration_s` seconds (must be > 0)."""
    if duration_s <= 0:
        raise ValueError(f"duration must be positive, got {duration_s}")
    done = [r for r in records if r.ok]
    errors = Counter(r.error or "unknown" for r in records if not r.ok)
    in_tok = sum(r.prompt_tokens for r in done)
    out_tok = sum(r.output_tokens for r in done)
    good: int | None = None
    if slo is not None and not slo.is_empty():
        good = sum(1 for r in done if meets_slo(r, slo))
    ttfts = [t for r in done if (t := r.ttft) is not None]
    tpots = [t for r in done if (t := r.tpot) is not None]
    itls = [g for r in done for g in r.itls]
    return Summary(
        duration_s=duration_s,
        completed=len(done),
        failed=len(records) - len(done),
        errors=dict(sorted(errors.items())),
        input_tokens=in_tok,
        output_tokens=out_tok,
        request_throughput=len(done) / duration_s,
        output_throughput=out_tok / duration_s,
        total_token_throughput=(in_tok + out_tok) / duration_s,
        goodput=None if good is None else good / duration_s,
        good_requests=good,
        ttft_ms=stats_ms(ttfts),
        tpot_ms=stats_ms(tpots),
        itl_ms=stats_ms(itls),
        e2e_ms=stats_ms([r.e2e for r in done]),
        phase_ms=summarize_phases(done),
        cached_tokens=sum(r.cached_tokens for r in done),
    )


def summarize_phases(records: Iterable[RequestRecord]) -> dict[str, Stats]:
    """Per-phase stats over the records that carry router timings (phase -> seconds)."""
    by_phase: dict[str, list[float]] = {}
    for rec in records:
        for phase, seconds in (rec.timings or {}).items():
            by_phase.setdefault(phase, []).append(seconds)
    out: dict[str, Stats] = {}
    for phase, values in sorted(by_phase.items()):
        stats = stats_ms(values)
        if stats is not None:
            out[phase] = stats
    return out
