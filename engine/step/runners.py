"""How a step is launched and finished, chosen once when the engine is built (docs/design.md
§3 "The step"): one interface, three implementations.

- ``SyncSteps``: schedule, run the model, finish the step; one at a time.
- ``AsyncSteps``: asynchronous scheduling. A pure decode step is launched and its tokens
  are read while the next one runs (``engine/step/async_scheduling.py``); any other step
  is taken synchronously.
- ``BatchSteps``: pipeline parallelism with up to P batches in flight, one per stage
  (``engine/step/pp_batches.py``).

Each returns the outputs of what it finished (``StepOutputs``), or None when nothing could
run (the engine then idles briefly), and counts the model steps it launched.
"""

from __future__ import annotations

from typing import Protocol

from engine.core.outputs import RequestOutput
from engine.core.scheduler import Scheduler
from engine.executor import Executor
from engine.step.async_scheduling import StepPipeline, can_defer
from engine.step.outputs import StepOutputs
from engine.step.pp_batches import InflightBatches


class StepRunner(Protocol):
    num_steps: int  # model steps launched so far

    def step(self) -> list[RequestOutput] | None:
        """Launch what can run now and finish what is done: the finished outputs, or
        None when nothing ran."""
        ...

    def in_flight(self) -> bool:
        """A step was launched and is not finished yet."""
        ...


class SyncSteps:
    def __init__(self, scheduler: Scheduler, executor: Executor, post: StepOutputs) -> None:
        self.scheduler, self.executor, self.post = scheduler, executor, post
        self.num_steps = 0

    def step(self) -> list[RequestOutput] | None:
        scheduled = self.scheduler.schedule().scheduled
        if not scheduled:
            return None
        logits = self.executor.execute(scheduled)
        self.num_steps += 1
        return self.post.process(scheduled, logits)

    def in_flight(self) -> bool:
        return False


class AsyncSteps:
    def __init__(
        self, scheduler: Scheduler, executor: Executor, post: StepOutputs, pipeline: StepPipeline
    ) -> None:
        self.scheduler, self.executor, self.post = scheduler, executor, post
        self.pipeline = pipeline
        self.num_steps = 0

    def step(self) -> list[RequestOutput] | None:
        if self.pipeline.deferred is not None:
            return self._finish_deferred()
        scheduled = self.scheduler.schedule().scheduled
        if not scheduled:
            return None
        logits = self.executor.execute(scheduled)
        self.num_steps += 1
        if not can_defer(scheduled):
            return self.post.process(scheduled, logits)
        self.pipeline.defer(scheduled, logits)
        return self._finish_deferred()

    def _finish_deferred(self) -> list[RequestOutput]:
        """Launch the step after the deferred one when possible, then turn the deferred
        one's tokens into outputs while the GPU runs the next."""
        step, launched = self.pipeline.advance()
        self.num_steps += launched
        return self.post.deferred(step)

    def in_flight(self) -> bool:
        return self.pipeline.deferred is not None


class BatchSteps:
    def __init__(self, batches: InflightBatches, post: StepOutputs) -> None:
        self.batches, self.post = batches, post
        self.num_steps = 0

    def step(self) -> list[RequestOutput] | None:
        self.num_steps += self.batches.launch()
        done = self.batches.finish_oldest()
        return self.post.process(*done) if done else None

    def in_flight(self) -> bool:
        return bool(self.batches)


def step_runner(
    scheduler: Scheduler,
    executor: Executor,
    post: StepOutputs,
    pipeline: StepPipeline | None,
    batches: InflightBatches | None,
) -> StepRunner:
    """The runner for an engine with these step pipelines (at most one is used: batches in
    flight leave no step to defer)."""
    if batches is not None:
        return BatchSteps(batches, post)
    if pipeline is not None:
        return AsyncSteps(scheduler, executor, post, pipeline)
    return SyncSteps(scheduler, executor, post)
