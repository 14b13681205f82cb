"""The autoscaler's pure parts: metric windows, percentiles and scaling decisions."""

from __future__ import annotations

import math

import pytest

from autoscaler.config import env_name, parse_config
from autoscaler.policy import PoolLimits, PoolState, SloTargets, decide
from autoscaler.signals import Signals, bucket_delta, parse_metrics, quantile, window_signals

TARGETS = SloTargets(ttft_p90=1.0, itl_p90=0.05, prefill_queue=8, decode_queue=4, min_samples=10)
LIMITS = PoolLimits(
    min_replicas=1,
    max_replicas=6,
    max_step_up=2,
    scale_up_cooldown=60,
    scale_down_cooldown=120,
    down_stable_windows=3,
)


def sig(ttft=None, ttft_n=0.0, itl=None, itl_n=0.0, pw=0.0, dw=0.0) -> Signals:
    return Signals(
        ttft_p90=ttft,
        ttft_count=ttft_n,
        itl_p90=itl,
        itl_count=itl_n,
        prefill_waiting=pw,
        decode_waiting=dw,
    )


def page(ttft: dict[str, int], waiting: dict[tuple[str, str], float]) -> str:
    lines = ["# HELP pdserve_ttft_seconds TTFT", "# TYPE pdserve_ttft_seconds histogram"]
    for le, n in ttft.items():
        lines.append(f'pdserve_ttft_seconds_bucket{{le="{le}",model="m"}} {n}')
    lines.append(f'pdserve_ttft_seconds_count{{model="m"}} {ttft["+Inf"]}')
    lines.append('pdserve_ttft_seconds_sum{model="m"} 1.0')
    lines += ["# HELP pdserve_instance_waiting w", "# TYPE pdserve_instance_waiting gauge"]
    for (pool, inst), v in waiting.items():
        lines.append(f'pdserve_instance_waiting{{pool="{pool}",instance="{inst}"}} {v}')
    return "\n".join(lines) + "\n"


def test_quantile_interpolates_like_prometheus() -> None:
    buckets = {0.1: 0.0, 0.5: 50.0, 1.0: 90.0, 2.0: 100.0, math.inf: 100.0}
    assert quantile(0.9, buckets) == pytest.approx(1.0)
    assert quantile(0.5, buckets) == pytest.approx(0.5)
    assert quantile(0.95, buckets) == pytest.approx(1.5)
    assert quantile(0.9, {0.1: 0.0, math.inf: 10.0}) == pytest.approx(0.1)  # rank in +Inf
    assert quantile(0.9, {0.1: 0.0, math.inf: 0.0}) is None
    with pytest.raises(ValueError):
        quantile(1.5, buckets)


def test_windows_use_deltas_and_survive_counter_resets() -> None:
    before = {0.5: 10.0, math.inf: 10.0}
    assert bucket_delta(before, {0.5: 10.0, math.inf: 30.0}) == {0.5: 0.0, math.inf: 20.0}
    assert bucket_delta(before, {0.5: 2.0, math.inf: 3.0}) == {0.5: 2.0, math.inf: 3.0}

    a1 = parse_metrics(page({"0.5": 10, "2.0": 10, "+Inf": 10}, {("decode", "d1"): 3}))
    a2 = parse_metrics(
        page({"0.5": 10, "2.0": 30, "+Inf": 30}, {("decode", "d1"): 5, ("prefill", "p1"): 2})
    )
    b2 = parse_metrics(
        page({"0.5": 4, "2.0": 4, "+Inf": 4}, {("decode", "d1"): 4, ("decode", "d2"): 1})
    )
    s = window_signals({"r1": a1}, {"r1": a2, "r2": b2})
    # Only r1 has a window: its 20 new requests all landed in (0.5, 2.0].
    assert s.ttft_count == 20
    assert s.ttft_p90 == pytest.approx(0.5 + 1.5 * 0.9)
    # Gauges: the largest report per instance, summed per pool.
    assert s.decode_waiting == 6 and s.prefill_waiting == 2
    assert s.itl_p90 is None and s.itl_count == 0
    with pytest.raises(ValueError):
        parse_metrics("pdserve_ttft_seconds_bucket{le=}} nonsense")


def test_ttft_breach_scales_prefill_proportionally_with_a_step_cap() -> None:
    d, st = decide("prefill", sig(ttft=1.5, ttft_n=50), 2, PoolState(), TARGETS, LIMITS, now=1000)
    assert (d.action, d.desired) == ("up", 3) and "ttft_p90=1.50x" in d.reason
    assert st == PoolState(last_scale_at=1000, calm_windows=0)
    d, _ = decide("prefill", sig(ttft=9.0, ttft_n=50), 2, PoolState(), TARGETS, LIMITS, now=1000)
    assert d.desired == 4  # ceil(2 x 9) capped at +2
    d, _ = decide("prefill", sig(ttft=9.0, ttft_n=50), 5, PoolState(), TARGETS, LIMITS, now=1000)
    assert d.desired == 6  # capped at max
    # ITL does not drive prefill; TTFT does not drive decode.
    d, _ = decide(
        "prefill",
        sig(ttft=0.8, ttft_n=50, itl=1.0, itl_n=50),
        2,
        PoolState(),
        TARGETS,
        LIMITS,
        now=0,
    )
    assert d.action == "hold" and "within band" in d.reason


def test_decode_scales_on_itl_or_queue() -> None:
    d, _ = decide("decode", sig(itl=0.08, itl_n=100), 2, PoolState(), TARGETS, LIMITS, now=0)
    assert (d.action, d.desired) == ("up", 4)
    d, _ = decide("decode", sig(itl=0.04, itl_n=100, dw=20), 2, PoolState(), TARGETS, LIMITS, now=0)
    assert (d.action, d.desired) == ("up", 4) and "queue=2.50x" in d.reason
    d, _ = decide(
        "decode",
        sig(ttft=5.0, ttft_n=100, itl=0.04, itl_n=100),
        2,
        PoolState(),
        TARGETS,
        LIMITS,
        now=0,
    )
    assert d.action == "hold"


def test_hysteresis_band_and_tolerance_hold() -> None:
    for ttft in (0.6, 1.05):  # between scale_down_ratio and 1 + tolerance
        d, st = decide(
            "prefill",
            sig(ttft=ttft, ttft_n=50),
            3,
            PoolState(calm_windows=2),
            TARGETS,
            LIMITS,
            now=0,
        )
        assert d.action == "hold" and st.calm_windows == 0


def test_scale_down_needs_stable_calm_windows_and_cooldown() -> None:
    state = PoolState(last_scale_at=0.0)
    idle = sig()
    actions = []
    for now in (200.0, 215.0, 230.0):
        d, state = decide("decode", idle, 3, state, TARGETS, LIMITS, now=now)
        actions.append(d.action)
    assert actions == ["hold", "hold", "down"] and d.desired == 2
    # Calm long enough but scaled 100 s ago: the 120 s down cooldown holds it.
    d, _ = decide(
        "decode", idle, 3, PoolState(last_scale_at=0.0, calm_windows=5), TARGETS, LIMITS, now=100
    )
    assert d.action == "hold" and "cooldown" in d.reason
    d, _ = decide("decode", idle, 1, PoolState(calm_windows=5), TARGETS, LIMITS, now=100)
    assert d.action == "hold" and "min_replicas" in d.reason


def test_cooldown_and_bounds() -> None:
    d, _ = decide(
        "prefill",
        sig(ttft=3.0, ttft_n=50),
        2,
        PoolState(last_scale_at=950),
        TARGETS,
        LIMITS,
        now=1000,
    )
    assert d.action == "hold" and "cooldown 10s left" in d.reason
    d, _ = decide("prefill", sig(ttft=3.0, ttft_n=50), 6, PoolState(), TARGETS, LIMITS, now=1000)
    assert d.action == "hold" and "max_replicas=6" in d.reason
    d, _ = decide("prefill", sig(), 9, PoolState(last_scale_at=999), TARGETS, LIMITS, now=1000)
    assert (d.action, d.desired) == ("down", 6)
    d, _ = decide("decode", sig(), 0, PoolState(), TARGETS, LIMITS, now=1000)
    assert (d.action, d.desired) == ("up", 1)


def test_too_few_samples_neither_scales_up_nor_down() -> None:
    d, _ = decide(
        "prefill", sig(ttft=50.0, ttft_n=3), 2, PoolState(calm_windows=9), TARGETS, LIMITS, now=0
    )
    assert d.action == "hold" and "too few samples" in d.reason and d.pressures["ttft_p90"] is None


def test_bad_settings_are_rejected() -> None:
    with pytest.raises(ValueError):
        PoolLimits(min_replicas=3, max_replicas=2)
    with pytest.raises(ValueError):
        SloTargets(ttft_p90=0)
    with pytest.raises(ValueError):
        decide("router", sig(), 1, PoolState(), TARGETS, LIMITS, now=0)


def test_config_flags_have_env_twins() -> None:
    env = {
        env_name("--namespace"): "serving",
        "PDSERVE_AUTOSCALER_PREFILL_DEPLOYMENT": "p",
        "PDSERVE_AUTOSCALER_DECODE_DEPLOYMENT": "d",
        "PDSERVE_AUTOSCALER_METRICS_URLS": "http://a:8000/metrics, http://b:8000/metrics",
        "PDSERVE_AUTOSCALER_TTFT_P90_TARGET": "0.5",
        "PDSERVE_AUTOSCALER_DRY_RUN": "true",
        "PDSERVE_AUTOSCALER_DECODE_MAX": "12",
    }
    cfg, level = parse_config([], env)
    assert cfg.metrics_urls == ("http://a:8000/metrics", "http://b:8000/metrics")
    assert (
        cfg.targets.ttft_p90 == 0.5
        and cfg.dry_run
        and cfg.decode.max_replicas == 12
        and level == "INFO"
    )
    cfg, _ = parse_config(["--ttft-p90-target", "2", "--dry-run", "false"], env)  # flags win
    assert cfg.targets.ttft_p90 == 2.0 and not cfg.dry_run
    with pytest.raises(ValueError, match="exactly one"):
        parse_config(["--metrics-dns", "router"], env)
    with pytest.raises(ValueError, match="PDSERVE_AUTOSCALER_DRY_RUN"):
        parse_config([], {**env, "PDSERVE_AUTOSCALER_DRY_RUN": "maybe"})
    with pytest.raises(ValueError, match="http"):
        parse_config([], {**env, "PDSERVE_AUTOSCALER_METRICS_URLS": "router:8000"})
