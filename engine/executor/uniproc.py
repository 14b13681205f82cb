"""``UniprocExecutor``: the single-process engine, the model runner in this process."""

from __future__ import annotations

import torch

from engine.core.scheduler import ScheduledRequest
from engine.executor.model_runner import ModelRunner


class UniprocExecutor:
    """The whole model in this process."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def execute(
        self, scheduled: list[ScheduledRequest], input_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        return self.runner.execute(scheduled, input_ids)

    def check(self) -> None:
        pass  # one process: nothing can be lost behind its back

    def shutdown(self) -> None:
        self.runner.release()
