"""``kv_store.breaker.CircuitBreaker``: opens after N consecutive store failures, refuses
at once while open, lets one probe through per window. A fake clock: no sleeping."""

from __future__ import annotations

import pytest

from kv_store.base import KVStoreCircuitOpen, KVStoreError
from kv_store.breaker import CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _fail() -> None:
    raise KVStoreError("down")


def test_opens_after_threshold_and_refuses_without_calling() -> None:
    clock = Clock()
    br = CircuitBreaker("s", threshold=3, open_s=5.0, clock=clock)
    for _ in range(3):
        with pytest.raises(KVStoreError):
            br.call(_fail)
    assert br.is_open and br.opened == 1
    calls: list[int] = []
    with pytest.raises(KVStoreCircuitOpen) as info:
        br.call(lambda: calls.append(1))
    assert info.value.reason == "circuit_open"
    assert not calls and br.rejected == 1


def test_one_probe_per_window_and_success_closes() -> None:
    clock = Clock()
    br = CircuitBreaker("s", threshold=2, open_s=5.0, clock=clock)
    for _ in range(2):
        with pytest.raises(KVStoreError):
            br.call(_fail)
    clock.now += 5.0
    with pytest.raises(KVStoreError) as info:  # the probe runs and fails: a new window
        br.call(_fail)
    assert not isinstance(info.value, KVStoreCircuitOpen)
    with pytest.raises(KVStoreCircuitOpen):
        br.call(lambda: None)
    clock.now += 5.0
    assert br.call(lambda: 7) == 7  # the probe succeeds: closed
    assert not br.is_open
    assert br.call(lambda: 8) == 8


def test_success_resets_the_count_and_other_errors_do_not_count() -> None:
    br = CircuitBreaker("s", threshold=2, open_s=5.0, clock=Clock())
    with pytest.raises(KVStoreError):
        br.call(_fail)
    br.call(lambda: None)
    with pytest.raises(KVStoreError):
        br.call(_fail)
    with pytest.raises(ZeroDivisionError):
        br.call(lambda: 1 // 0)
    assert not br.is_open


def test_rejects_bad_settings() -> None:
    with pytest.raises(ValueError):
        CircuitBreaker("s", threshold=0)
    with pytest.raises(ValueError):
        CircuitBreaker("s", open_s=0)
