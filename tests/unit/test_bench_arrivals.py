"""Arrival generators: rate and burstiness statistically right over many seeded samples.

Tolerances come from the sample size: a sample mean of N gaps has standard error
sigma/sqrt(N); a sample variance of gamma(k) gaps has variance ~ sigma^4 (2 + 6/k) / N
(excess kurtosis 6/k). Bounds are 5 standard errors, so a correct generator fails with
probability < 1e-6, while a wrong rate (or a wrong shape) lies far outside.
"""

from __future__ import annotations

import math
import random
import statistics

import pytest

from pdserve.bench.arrivals import arrival_offsets, iter_gaps, iter_offsets

N = 20_000


def gaps(rate: float, burstiness: float, seed: int, n: int = N) -> list[float]:
    it = iter_gaps(rate, burstiness, random.Random(seed))
    return [next(it) for _ in range(n)]


@pytest.mark.parametrize("rate", [0.5, 4.0, 50.0])
@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_mean_gap_is_one_over_rate(rate: float, burstiness: float) -> None:
    for seed in range(3):
        g = gaps(rate, burstiness, seed)
        sigma = math.sqrt(1.0 / (rate * rate * burstiness))
        tol = 5 * sigma / math.sqrt(N)
        assert abs(statistics.fmean(g) - 1.0 / rate) < tol


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_variance_matches_burstiness(burstiness: float) -> None:
    # gamma(k, theta = 1/(rate k)): variance = k theta^2 = 1 / (rate^2 k); CV = 1/sqrt(k)
    rate = 2.0
    var = 1.0 / (rate * rate * burstiness)
    tol = 5 * var * math.sqrt((2 + 6 / burstiness) / N)
    for seed in range(3):
        g = gaps(rate, burstiness, seed)
        assert abs(statistics.variance(g) - var) < tol


def test_poisson_counts_in_windows() -> None:
    # Poisson process at rate r: arrivals in [0, T) ~ Poisson(rT), sd sqrt(rT).
    rate, horizon = 10.0, 500.0
    offs = arrival_offsets(int(rate * horizon * 1.5), rate, 1.0, seed=7)
    count = sum(1 for t in offs if t < horizon)
    assert abs(count - rate * horizon) < 5 * math.sqrt(rate * horizon)
    # counts in 1 s windows: index of dispersion (var/mean) of a Poisson process is 1;
    # its sampling sd over W windows is about sqrt(2 / (W - 1)).
    windows = [0] * int(horizon)
    for t in offs:
        if t < horizon:
            windows[int(t)] += 1
    dispersion = statistics.variance(windows) / statistics.fmean(windows)
    assert abs(dispersion - 1.0) < 5 * math.sqrt(2 / (len(windows) - 1))


def test_bursty_arrivals_are_overdispersed() -> None:
    # burstiness 0.1 -> CV of gaps sqrt(10): 1 s window counts far more variable than Poisson
    offs = arrival_offsets(6000, 10.0, 0.1, seed=3)
    horizon = int(offs[-1])
    windows = [0] * horizon
    for t in offs:
        if t < horizon:
            windows[int(t)] += 1
    assert statistics.variance(windows) / statistics.fmean(windows) > 3.0


def test_offsets_start_at_zero_seeded_and_increasing() -> None:
    a = arrival_offsets(100, 3.0, 0.5, seed=1)
    assert a == arrival_offsets(100, 3.0, 0.5, seed=1)
    assert a != arrival_offsets(100, 3.0, 0.5, seed=2)
    assert a[0] == 0.0
    assert all(x <= y for x, y in zip(a, a[1:], strict=False))
    it = iter_offsets(3.0, 0.5, seed=1)
    assert [next(it) for _ in range(100)] == a
    assert arrival_offsets(0, 3.0, 1.0, seed=0) == []


def test_infinite_rate_sends_at_once() -> None:
    assert arrival_offsets(5, math.inf, 1.0, seed=0) == [0.0] * 5


@pytest.mark.parametrize(
    ("rate", "burstiness"), [(0.0, 1.0), (-1.0, 1.0), (math.nan, 1.0), (1.0, 0.0), (1.0, math.inf)]
)
def test_bad_parameters_rejected_eagerly(rate: float, burstiness: float) -> None:
    with pytest.raises(ValueError):
        iter_gaps(rate, burstiness, random.Random(0))
    with pytest.raises(ValueError):
        iter_offsets(rate, burstiness, 0)
