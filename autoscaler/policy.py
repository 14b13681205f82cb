"""The scaling decision, pure: signals + current replicas + pool state in, decision out.

Each pool has *pressure* signals, each a ratio observed/target (1.0 = exactly on target):

* prefill: TTFT p90 / ``ttft_p90`` and waiting-per-replica / ``prefill_queue``;
* decode: ITL p90 / ``itl_p90`` and waiting-per-replica / ``decode_queue``.

Rules, in order:

1. Replicas outside [min, max] go to the nearest bound (no cooldown: the bounds are
   configuration, not load).
2. Any pressure above ``1 + tolerance`` scales up at once, HPA-style to
   ``ceil(current x worst pressure)``, at most ``max_step_up`` more and never above max,
   unless the pool scaled less than ``scale_up_cooldown`` seconds ago.
3. When every pressure is below ``scale_down_ratio`` (a latency with no traffic in the
   window counts as low) for ``down_stable_windows`` consecutive windows, remove one
   replica, unless the pool scaled less than ``scale_down_cooldown`` seconds ago.
4. Otherwise hold; the band between rules 2 and 3 is the hysteresis that stops flapping.

A latency with too few samples (``min_samples``) is unknown: it neither scales up nor
lets the pool scale down.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from autoscaler.signals import Signals


@dataclass(frozen=True, slots=True)
class SloTargets:
    ttft_p90: float = 1.0
    itl_p90: float = 0.05
    prefill_queue: float = 8.0
    decode_queue: float = 4.0
    tolerance: float = 0.1
    scale_down_ratio: float = 0.5
    min_samples: int = 20

    def __post_init__(self) -> None:
        if min(self.ttft_p90, self.itl_p90, self.prefill_queue, self.decode_queue) <= 0:
            raise ValueError("SLO targets must be positive")
        if self.tolerance < 0 or not 0 < self.scale_down_ratio < 1:
            raise ValueError("tolerance must be >= 0 and scale_down_ratio in (0, 1)")
        if self.min_samples < 1:
            raise ValueError("min_samples must be >= 1")


@dataclass(frozen=True, slots=True)
class PoolLimits:
    min_replicas: int = 1
    max_replicas: int = 8
    max_step_up: int = 2
    scale_up_cooldown: float = 60.0
    scale_down_cooldown: float = 300.0
    down_stable_windows: int = 3

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 0 <= min ({self.min_replicas}) <= max ({self.max_replicas})")
        if self.max_step_up < 1 or self.down_stable_windows < 1:
            raise ValueError("max_step_up and down_stable_windows must be >= 1")
        if self.scale_up_cooldown < 0 or self.scale_down_cooldown < 0:
            raise ValueError("cooldowns must be >= 0")


@dataclass(frozen=True, slots=True)
class PoolState:
    """What the policy remembers about a pool between windows."""

    last_scale_at: float | None = None
    calm_windows: int = 0


@dataclass(frozen=True, slots=True)
class Decision:
    pool: str
    current: int
    desired: int
    action: str  # "up" | "down" | "hold"
    reason: str
    pressures: dict[str, float | None]


def _latency_pressure(
    p90: float | None, count: float, target: float, t: SloTargets
) -> float | None:
    if count <= 0:
        return 0.0  # no traffic: no latency pressure
    if count < t.min_samples or p90 is None:
        return None
    return p90 / target


def pool_pressures(pool: str, s: Signals, current: int, t: SloTargets) -> dict[str, float | None]:
    """The named pressures of one pool (None = not enough samples to judge)."""
    replicas = max(current, 1)
    if pool == "prefill":
        return {
            "ttft_p90": _latency_pressure(s.ttft_p90, s.ttft_count, t.ttft_p90, t),
            "queue": s.prefill_waiting / replicas / t.prefill_queue,
        }
    if pool == "decode":
        return {
            "itl_p90": _latency_pressure(s.itl_p90, s.itl_count, t.itl_p90, t),
            "queue": s.decode_waiting / replicas / t.decode_queue,
        }
    raise ValueError(f"unknown pool {pool!r} (expected 'prefill' or 'decode')")


def _describe(pressures: dict[str, float | None]) -> str:
    parts = [f"{k}={'n/a' if v is None else f'{v:.2f}x'}" for k, v in pressures.items()]
    return ", ".join(parts)


def decide(
    pool: str,
    signals: Signals,
    current: int,
    state: PoolState,
    targets: SloTargets,
    limits: PoolLimits,
    now: float,
) -> tuple[Decision, PoolState]:
    """One window's decision for ``pool`` and the state to remember for the next one.

    The returned state assumes the decision is carried out (the caller keeps the old
    state if patching the Deployment fails).
    """
    pressures = pool_pressures(pool, signals, current, targets)
    seen = _describe(pressures)

    def result(desired: int, action: str, why: str, new: PoolState) -> tuple[Decision, PoolState]:
        return Decision(pool, current, desired, action, f"{why} [{seen}]", pressures), new

    if current < limits.min_replicas or current > limits.max_replicas:
        bound = min(max(current, limits.min_replicas), limits.max_replicas)
        action = "up" if bound > current else "down"
        return result(
            bound,
            action,
            f"outside [{limits.min_replicas}, {limits.max_replicas}]",
            PoolState(now, 0),
        )
    since = math.inf if state.last_scale_at is None else now - state.last_scale_at
    known = [v for v in pressures.values() if v is not None]
    worst = max(known) if known else None
    if worst is not None and worst > 1.0 + targets.tolerance:
        calm = replace(state, calm_windows=0)
        if current >= limits.max_replicas:
            return result(
                current, "hold", f"over target but at max_replicas={limits.max_replicas}", calm
            )
        if since < limits.scale_up_cooldown:
            left = limits.scale_up_cooldown - since
            return result(current, "hold", f"over target, scale-up cooldown {left:.0f}s left", calm)
        wanted = max(current + 1, math.ceil(current * worst))
        desired = min(wanted, current + limits.max_step_up, limits.max_replicas)
        return result(desired, "up", f"over target (worst {worst:.2f}x)", PoolState(now, 0))
    if len(known) == len(pressures) and worst is not None and worst < targets.scale_down_ratio:
        calm_windows = state.calm_windows + 1
        calm = replace(state, calm_windows=calm_windows)
        if current <= limits.min_replicas:
            return result(
                current, "hold", f"under target, at min_replicas={limits.min_replicas}", calm
            )
        if calm_windows < limits.down_stable_windows:
            return result(
                current,
                "hold",
                f"under target {calm_windows}/{limits.down_stable_windows} windows",
                calm,
            )
        if since < limits.scale_down_cooldown:
            left = limits.scale_down_cooldown - since
            return result(
                current, "hold", f"under target, scale-down cooldown {left:.0f}s left", calm
            )
        return result(
            current - 1, "down", f"under target for {calm_windows} windows", PoolState(now, 0)
        )
    why = (
        "too few samples to judge"
        if worst is None or len(known) < len(pressures)
        else "within band"
    )
    return result(current, "hold", why, replace(state, calm_windows=0))
