"""The executor interface: where the model runs. The engine talks only to this.

Either executor's ``execute`` returns the full logits in this process, and ``runner`` is
this process's model runner (its KV cache is what a KV connector binds).
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.core.scheduler import ScheduledRequest
from engine.executor.model_runner import ModelRunner


class ExecutorFailure(RuntimeError):
    """The executor cannot run steps any more (e.g. a tensor-parallel rank died): the engine
    is dead for good, and the process serving it should stop so it is restarted."""


class Executor(Protocol):
    """Runs the model for the engine: ``execute`` one step, ``shutdown`` once at the end."""

    runner: ModelRunner

    def execute(
        self, scheduled: list[ScheduledRequest], input_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``ModelRunner.execute``'s contract: float32 logits of the step's rows."""
        ...

    def check(self) -> None:
        """Raise ``ExecutorFailure`` if a step launched since the last check may have
        computed wrong logits (a tensor-parallel rank was lost while it ran). The engine
        calls it after a step's results reached the host, before they leave the engine."""
        ...

    def shutdown(self) -> None:
        """Release what the executor holds (worker processes); idempotent."""
        ...
