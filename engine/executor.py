"""Executors: where the model runs. The engine talks only to this interface.

``UniprocExecutor`` is the single-process engine: the model runner in this process.
``MultiprocExecutor`` (``engine/tp_executor.py``) is tensor parallelism: this process is
rank 0 and holds a runner of its own shard; ranks 1..N-1 are worker processes it starts,
and each step it hands them the step's inputs before all ranks run the forward pass.
Either way ``execute`` returns the full logits in this process, and ``runner`` is this
process's model runner (its KV cache is what a KV connector binds).
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.config import EngineConfig
from engine.model_runner import ModelRunner
from engine.models import ModelArgs
from engine.scheduler import ScheduledRequest


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
        pass


def make_executor(config: EngineConfig, args: ModelArgs, max_model_len: int) -> Executor:
    """The executor ``config.tensor_parallel_size`` asks for (it builds the model)."""
    if config.tensor_parallel_size == 1:
        return UniprocExecutor(ModelRunner(config, args, max_model_len))
    from engine.tp_executor import MultiprocExecutor

    return MultiprocExecutor(config, args, max_model_len)
