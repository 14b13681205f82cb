"""Request arrival processes for `pdserve bench serve`.

Inter-arrival gaps are gamma distributed with shape `burstiness` and mean `1 / rate`:
burstiness 1 is a Poisson process (exponential gaps), below 1 is burstier (coefficient of
variation 1/sqrt(burstiness) > 1), above 1 is more regular. An infinite rate sends every
request at once (the caller may still cap concurrency). Generators are seeded and so
reproducible.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator


def validate(rate: float, burstiness: float) -> None:
    """Raise ValueError unless rate > 0 (inf allowed) and burstiness is finite and > 0."""
    if math.isnan(rate) or rate <= 0:
        raise ValueError(f"request rate must be > 0 (or inf), got {rate}")
    if not (burstiness > 0 and math.isfinite(burstiness)):
        raise ValueError(f"burstiness must be a finite number > 0, got {burstiness}")


def iter_gaps(rate: float, burstiness: float, rng: random.Random) -> Iterator[float]:
    """Endless inter-arrival gaps in seconds for the given rate (req/s) and burstiness.

    Validates eagerly (ValueError at the call, not at the first gap)."""
    validate(rate, burstiness)
    return _gaps(rate, burstiness, rng)


def _gaps(rate: float, burstiness: float, rng: random.Random) -> Iterator[float]:
    if math.isinf(rate):
        while True:
            yield 0.0
    # Gamma(shape=k, scale=theta) has mean k*theta; theta = 1/(rate*k) keeps the mean 1/rate.
    scale = 1.0 / (rate * burstiness)
    while True:
        yield rng.gammavariate(burstiness, scale)


def arrival_offsets(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Send times (seconds from the start) of `n` requests; the first is sent at 0."""
    if n < 0:
        raise ValueError(f"number of requests must be >= 0, got {n}")
    out: list[float] = []
    t = 0.0
    gaps = iter_gaps(rate, burstiness, random.Random(seed))
    for i in range(n):
        if i:
            t += next(gaps)
        out.append(t)
    return out


def iter_offsets(rate: float, burstiness: float, seed: int) -> Iterator[float]:
    """Endless send times (seconds from the start); the first is 0. Validates eagerly."""
    return _offsets(iter_gaps(rate, burstiness, random.Random(seed)))


def _offsets(gaps: Iterator[float]) -> Iterator[float]:
    t = 0.0
    yield t
    for gap in gaps:
        t += gap
        yield t
