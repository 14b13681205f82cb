"""In-flight batches: keep every pipeline stage busy (docs/design.md §3 "Pipeline
parallelism").

With P stages and one batch at a time, each stage idles while the others run the batch
(the bubble: a step costs the sum of the stages). So the engine keeps up to P batches in
flight, as vLLM does: it submits batch k + 1 (stage 0 runs it) before batch k's logits
come back from the last stage, then finishes batch k (sampling, outputs) while the
stages run the later ones.

A request is in at most one batch in flight: its next tokens depend on what batch k
samples, so the scheduler skips requests in flight (``busy``) and never preempts them.
Each batch takes at most ``ceil(requests / P)`` requests, so the running requests spread
over the batches instead of all landing in the first. A request aborted while its batch
is in flight has its row dropped when the batch returns; the KV its batch writes goes to
blocks it no longer owns, which is harmless because every stage runs batches in order
(a later batch that reuses a block writes it after).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.core.scheduler import ScheduledRequest, Scheduler


class Pending(Protocol):
    def result(self) -> torch.Tensor: ...


class Submitter(Protocol):
    """What runs the batches: ``PipelineExecutor.submit``."""

    def submit(self, scheduled: list[ScheduledRequest]) -> Pending: ...


@dataclass(slots=True)
class InflightBatch:
    scheduled: list[ScheduledRequest]
    pending: Pending


class InflightBatches:
    """Up to ``depth`` batches in flight through ``executor``, oldest first."""

    def __init__(self, scheduler: Scheduler, executor: Submitter, depth: int) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.depth = depth
        self.batches: collections.deque[InflightBatch] = collections.deque()
        self.busy: set[str] = set()
        self.max_in_flight = 0  # the most batches ever in flight at once (tests, benchmarks)

    def __len__(self) -> int:
        return len(self.batches)

    def _seats(self) -> int:
        """Requests per batch: the running and waiting ones spread over ``depth`` batches."""
        s = self.scheduler
        return max(1, -(-(len(s.running) + len(s.waiting)) // self.depth))

    def launch(self) -> int:
        """Submit batches until ``depth`` are in flight or nothing more can run now;
        how many were submitted."""
        launched = 0
        while len(self.batches) < self.depth:
            out = self.scheduler.schedule(self.busy, self._seats())
            if not out.scheduled:
                break
            self.batches.append(InflightBatch(out.scheduled, self.executor.submit(out.scheduled)))
            self.busy.update(s.request.request_id for s in out.scheduled)
            launched += 1
        self.max_in_flight = max(self.max_in_flight, len(self.batches))
        return launched

    def finish_oldest(self) -> tuple[list[ScheduledRequest], torch.Tensor] | None:
        """The oldest batch and its logits (waiting for them), or None when none is in
        flight. Its requests may be scheduled again from here on."""
        if not self.batches:
            return None
        batch = self.batches.popleft()
        try:
            logits = batch.pending.result()
        finally:
            self.busy.difference_update(s.request.request_id for s in batch.scheduled)
        return batch.scheduled, logits
