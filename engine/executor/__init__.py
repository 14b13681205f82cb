"""Executors: where the model runs. The engine talks only to the interface (``base``).

``UniprocExecutor`` (``uniproc``) is the single-process engine: the model runner in this
process. ``MultiprocExecutor`` (``tp/executor.py``) is tensor parallelism: this process is
rank 0 and holds a runner of its own shard; ranks 1..N-1 are worker processes it starts,
and each step it hands them the step's inputs before all ranks run the forward pass.
``PipelineExecutor`` (``pp/executor.py``) splits the layers into stages over a grid of
such processes. ``model_runner`` (with ``step_inputs``, ``cuda_graphs`` and ``mixed_graphs``) runs one rank's
shard.
"""

from __future__ import annotations

from engine.config import EngineConfig
from engine.executor.base import Executor, ExecutorFailure
from engine.executor.model_runner import ModelRunner
from engine.executor.uniproc import UniprocExecutor
from engine.models import ModelArgs

__all__ = ["Executor", "ExecutorFailure", "UniprocExecutor", "make_executor"]


def make_executor(config: EngineConfig, args: ModelArgs, max_model_len: int) -> Executor:
    """The executor ``config.tensor_parallel_size`` and ``pipeline_parallel_size`` ask
    for (it builds the model)."""
    if config.pipeline_leader:  # stages on other hosts join this one (pp/join.py)
        if config.pipeline_stage:
            raise ValueError("an engine runs stage 0; the other stages run join_stage")
        from engine.executor.pp.join import LeaderPipelineExecutor

        return LeaderPipelineExecutor(config, args, max_model_len)
    if config.pipeline_parallel_size > 1:
        from engine.executor.pp.executor import PipelineExecutor

        return PipelineExecutor(config, args, max_model_len)
    if config.tensor_parallel_size == 1:
        return UniprocExecutor(ModelRunner(config, args, max_model_len))
    from engine.executor.tp.executor import MultiprocExecutor

    return MultiprocExecutor(config, args, max_model_len)
