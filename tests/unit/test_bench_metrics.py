"""Metric math of bench serve against hand-computed values."""

from __future__ import annotations

import pytest

from pdserve.bench.metrics import (
    RequestRecord,
    Slo,
    itls_from_chunk_times,
    meets_slo,
    parse_slo,
    percentile,
    stats_ms,
    summarize,
    tpot,
)


def rec(
    chunks: list[float],
    e2e: float,
    out: int,
    prompt: int = 10,
    timings: dict[str, float] | None = None,
) -> RequestRecord:
    return RequestRecord(
        prompt_tokens=prompt,
        ok=True,
        output_tokens=out,
        chunk_times=chunks,
        e2e=e2e,
        timings=timings,
    )


def test_percentile_linear_interpolation_by_hand() -> None:
    # ranks 0..3 over [1, 2, 3, 4]: q50 -> rank 1.5 -> 2.5; q90 -> rank 2.7 -> 3.7; q99 -> 3.97
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile(values, 99) == pytest.approx(3.97)
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    # 11 values 0..100 step 10: q90 is exactly 90, q99 -> rank 9.9 -> 99
    tens = [float(x) for x in range(0, 101, 10)]
    assert percentile(tens, 90) == pytest.approx(90.0)
    assert percentile(tens, 99) == pytest.approx(99.0)


def test_percentile_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="empty"):
        percentile([], 50)
    with pytest.raises(ValueError, match=r"\[0, 100\]"):
        percentile([1.0], 101)


def test_itl_from_token_timestamps() -> None:
    # first chunk at 0.1 s (TTFT), then gaps 0.02, 0.03, 0.05
    times = [0.1, 0.12, 0.15, 0.2]
    assert itls_from_chunk_times(times) == pytest.approx([0.02, 0.03, 0.05])
    assert itls_from_chunk_times([0.1]) == []
    assert itls_from_chunk_times([]) == []
    with pytest.raises(ValueError, match="non-decreasing"):
        itls_from_chunk_times([0.2, 0.1])


def test_tpot_by_hand() -> None:
    # e2e 1.0 s, ttft 0.1 s, 10 tokens -> (1.0 - 0.1) / 9 = 0.1 s
    assert tpot(1.0, 0.1, 10) == pytest.approx(0.1)
    assert tpot(1.0, 0.1, 1) is None
    assert tpot(1.0, None, 10) is None
    r = rec([0.1, 0.2, 0.3], e2e=0.5, out=5)
    assert r.ttft == pytest.approx(0.1)
    assert r.tpot == pytest.approx((0.5 - 0.1) / 4)


def test_stats_ms_by_hand() -> None:
    s = stats_ms([0.001, 0.002, 0.003, 0.004])
    assert s is not None
    assert (s.mean, s.p50, s.p90, s.p99, s.count) == pytest.approx((2.5, 2.5, 3.7, 3.97, 4))
    assert stats_ms([]) is None


def test_parse_slo() -> None:
    slo = parse_slo(["ttft:500", "TPOT:50", "e2e:2000.5"])
    assert (slo.ttft_ms, slo.tpot_ms, slo.e2e_ms) == (500.0, 50.0, 2000.5)
    assert parse_slo(["e2e:10"]) == Slo(e2e_ms=10.0)
    for bad, msg in (
        (["ttft"], "KEY:MS"),
        (["itl:5"], "KEY:MS"),
        (["ttft:x"], "not a number"),
        (["ttft:-1"], "positive"),
        (["ttft:0"], "positive"),
        (["ttft:1", "ttft:2"], "twice"),
    ):
        with pytest.raises(ValueError, match=msg):
            parse_slo(bad)


def test_goodput_by_hand() -> None:
    slo = Slo(ttft_ms=200, tpot_ms=50, e2e_ms=1000)
    good = rec([0.1, 0.14], e2e=0.5, out=10)  # ttft 100, tpot (500-100)/9=44.4, e2e 500
    slow_first = rec([0.3, 0.31], e2e=0.6, out=10)  # ttft 300 > 200
    slow_tokens = rec([0.1, 0.2], e2e=0.9, out=10)  # tpot 800/9 = 88.9 > 50
    slow_total = rec([0.1, 0.11], e2e=1.2, out=100)  # e2e 1200 > 1000, tpot 11.1
    single = rec([0.15], e2e=0.15, out=1)  # tpot undefined: passes that bound
    failed = RequestRecord(prompt_tokens=10, error="timeout", e2e=5.0)
    records = [good, slow_first, slow_tokens, slow_total, single, failed]
    assert [meets_slo(r, slo) for r in records] == [True, False, False, False, True, False]
    s = summarize(records, duration_s=2.0, slo=slo)
    assert s.good_requests == 2
    assert s.goodput == pytest.approx(1.0)
    assert s.completed == 5 and s.failed == 1
    assert s.errors == {"timeout": 1}
    # only the e2e bound: everything but slow_total passes
    assert summarize(records, 2.0, Slo(e2e_ms=1000)).good_requests == 4
    assert summarize(records, 2.0, None).goodput is None


def test_summarize_throughput_and_latencies_by_hand() -> None:
    a = rec([0.1, 0.2, 0.4], e2e=0.4, out=3, prompt=100)
    b = rec([0.3, 0.35], e2e=0.5, out=4, prompt=50)
    bad = RequestRecord(prompt_tokens=70, error="http_503")
    s = summarize([a, b, bad], duration_s=4.0, slo=None)
    assert s.input_tokens == 150 and s.output_tokens == 7
    assert s.request_throughput == pytest.approx(0.5)
    assert s.output_throughput == pytest.approx(7 / 4)
    assert s.total_token_throughput == pytest.approx(157 / 4)
    assert s.ttft_ms is not None and s.ttft_ms.mean == pytest.approx(200.0)
    # ITLs: a -> 100, 200 ms; b -> 50 ms
    assert s.itl_ms is not None and s.itl_ms.count == 3
    assert s.itl_ms.mean == pytest.approx(350 / 3)
    assert s.itl_ms.p50 == pytest.approx(100.0)
    # TPOT: a (0.4-0.1)/2 = 150 ms; b (0.5-0.3)/3 = 66.67 ms
    assert s.tpot_ms is not None and s.tpot_ms.mean == pytest.approx((150 + 200 / 3) / 2)
    assert s.e2e_ms is not None and s.e2e_ms.p50 == pytest.approx(450.0)
    with pytest.raises(ValueError, match="duration"):
        summarize([a], 0.0, None)


def test_phase_timings_summarised() -> None:
    a = rec([0.1], e2e=0.2, out=1, timings={"prefill": 0.05, "kv_load": 0.01})
    b = rec([0.1], e2e=0.2, out=1, timings={"prefill": 0.07})
    c = rec([0.1], e2e=0.2, out=1)
    s = summarize([a, b, c], 1.0, None)
    assert set(s.phase_ms) == {"prefill", "kv_load"}
    assert s.phase_ms["prefill"].mean == pytest.approx(60.0)
    assert s.phase_ms["prefill"].count == 2
    assert s.phase_ms["kv_load"].p99 == pytest.approx(10.0)
