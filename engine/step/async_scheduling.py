"""Async scheduling: launch decode step n+1 before step n's sampled tokens reach the host.

In a synchronous step loop the GPU idles while the host turns step n's tokens into outputs
and builds step n+1's inputs, so that host time (scheduling, input building, stop checks,
detokenizing: a few tenths of a millisecond) adds to every token. A decode step needs step
n's tokens only as its input ids, and those can be read on the device from step n's
sampler output; so step n+1 is scheduled and launched first, and the host finishes step n
while the GPU runs n+1 (vLLM's async scheduling does the same).

The pipeline is one step deep and runs only while nothing else needs the scheduler: every
running request is in the deferred decode step, none is waiting, and none needs host-side
state of its newest token to be sampled (penalties, grammar masks, drafts) or saves its KV.
Otherwise the engine finishes the deferred step and takes a normal synchronous one (which
may admit, chunk or preempt). A request that finishes at step n wastes its row of step n+1,
whose token is dropped; the KV that row wrote is the real token's, into the request's own
(then freed) blocks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.core.request import Request, RequestStatus
from engine.core.scheduler import ScheduledRequest, Scheduler
from engine.executor import Executor
from engine.sampling.sampler import PendingTokens, Sampler


@dataclass(slots=True)
class DeferredStep:
    """A launched decode step whose sampled tokens have not been read on the host."""

    scheduled: list[ScheduledRequest]
    tokens: PendingTokens


def _deferrable(request: Request) -> bool:
    """The next token can be sampled without the host knowing the newest one."""
    return (
        not request.params.has_penalties
        and not request.logits_processors
        and not request.save_kv
        # the mask depends on how many tokens exist, and one is still in flight
        and not request.below_min_tokens
    )


def can_defer(scheduled: list[ScheduledRequest]) -> bool:
    """A pure decode step (one new token per request, each sampling) of deferrable requests.

    Call before the step's ``num_computed_tokens`` bookkeeping."""
    return all(
        s.num_new_tokens == 1
        and not s.spec_token_ids
        and s.request.num_computed_tokens + 1 == s.request.num_tokens
        and _deferrable(s.request)
        for s in scheduled
    )


def _finishes_by_length(request: Request, max_model_len: int) -> bool:
    """The in-flight token is certainly the request's last (max_tokens or model length)."""
    return request.tokens_left(max_model_len) <= 1


def next_rows(
    step: DeferredStep,
    *,
    num_running: int,
    num_waiting: int,
    max_model_len: int,
    token_budget: int,
) -> list[int]:
    """Rows of ``step`` whose requests go on into the next step launched ahead, or [] when
    a synchronous step must come next (a request waits, or one runs outside ``step``)."""
    if num_waiting:
        return []
    alive = [i for i, s in enumerate(step.scheduled) if s.request.status is RequestStatus.RUNNING]
    if len(alive) != num_running:
        return []
    rows = [i for i in alive if not _finishes_by_length(step.scheduled[i].request, max_model_len)]
    return rows if len(rows) <= token_budget else []


class StepPipeline:
    """Holds the one deferred step and launches the next ahead of it.

    The engine calls ``defer`` right after launching a step ``can_defer`` accepts, and then
    ``advance``, which launches the following step when ``next_rows`` allows and hands back
    the deferred one for the engine to finish (``tokens.result()`` waits for its copy)."""

    def __init__(
        self, scheduler: Scheduler, runner: Executor, sampler: Sampler, max_model_len: int
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.sampler = sampler
        self.max_model_len = max_model_len
        self.deferred: DeferredStep | None = None
        self.num_launched_ahead = 0

    def defer(self, scheduled: list[ScheduledRequest], logits: torch.Tensor) -> None:
        """Count a launched decode step's tokens as computed and start sampling them."""
        requests = [s.request for s in scheduled]
        for request in requests:
            request.num_computed_tokens += 1
        positions = [r.num_computed_tokens for r in requests]  # num_tokens lags in flight
        self.deferred = DeferredStep(scheduled, self.sampler.launch(logits, requests, positions))

    def advance(self) -> tuple[DeferredStep, bool]:
        """Launch the step after the deferred one if possible; return the deferred one and
        whether a step was launched."""
        step, self.deferred = self.deferred, None
        if step is None:
            raise RuntimeError("no deferred step to advance")
        sched = self.scheduler
        rows = next_rows(
            step,
            num_running=len(sched.running),
            num_waiting=len(sched.waiting),
            max_model_len=self.max_model_len,
            token_budget=sched.config.max_num_batched_tokens,
        )
        batch = sched.schedule_ahead([step.scheduled[i].request for i in rows]) if rows else None
        if batch:
            ids = step.tokens.tokens
            if len(rows) < len(step.scheduled):
                # Pinned and non-blocking: a plain host->device copy would wait for the GPU.
                index = torch.tensor(rows, pin_memory=ids.is_cuda)
                ids = ids[index.to(ids.device, non_blocking=True)]
            self.defer(batch, self.runner.execute(batch, input_ids=ids))
            self.num_launched_ahead += 1
        return step, bool(batch)
