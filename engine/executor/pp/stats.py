"""Rank 0's pipeline counters (benchmarks/engine/pipeline_parallel.py reads them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class HandoffStats:
    """How long the engine waited for steps' logits from the last stage: with in-flight
    batches much of a step runs while stage 0 works on the next one, so this is the part
    of the pipeline the engine did not hide."""

    steps: int = 0
    wait_seconds: float = 0.0

    def record_wait(self, seconds: float) -> None:
        self.steps += 1
        self.wait_seconds += seconds

    @property
    def mean_wait_us(self) -> float:
        return 1e6 * self.wait_seconds / self.steps if self.steps else 0.0
