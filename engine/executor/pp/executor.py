"""``PipelineExecutor``: pipeline parallelism (P stages) with tensor parallelism (N ranks
per stage) in a P × N grid of processes (docs/design.md §3 "Pipeline parallelism").

This process is global rank 0: stage 0's TP rank 0, with the scheduler and the sampler.
It starts the other P × N - 1 processes (``python -m engine.executor.pp.worker``) the way
the tensor-parallel executor starts its workers, and reuses that executor's start-up,
step wire, watch, deadlines and teardown (it is a ``MultiprocExecutor``).

A step is ``submit`` then ``PendingLogits.result``: ``submit`` writes the step's inputs on
every worker's pipe (every stage needs the positions, slots and block tables), runs stage
0's layers, starts the send of the hidden states to stage 1 and posts the receive of the
logits from the last stage, and returns without waiting; ``result`` waits for those
logits (at most ``distributed_timeout``). The engine may ``submit`` up to P steps before
it reads the first one's result (in-flight batches, ``engine/step/pp_batches.py``): stage 0
runs step k + 1 while stage 1 runs step k.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.core.scheduler import ScheduledRequest
from engine.distributed.pp_group import PPGroup, hidden_tag, logits_tag
from engine.distributed.tp_group import TPGroup
from engine.executor.model_runner import ModelRunner
from engine.executor.pp.stats import HandoffStats
from engine.executor.tp.executor import _FAILURES, MultiprocExecutor, TensorParallelError
from engine.executor.tp.step_wire import pack
from engine.models import ModelArgs

logger = logging.getLogger(__name__)


class PipelineParallelError(TensorParallelError):
    """The pipeline-parallel engine cannot run: a stage's process died, hung or failed."""


def stage_store(store: dist.Store, stage: int) -> dist.Store:
    """Stage ``stage``'s own keys in the grid's store (its tensor-parallel group)."""
    return dist.PrefixStore(f"pdserve-pp/stage{stage}", store)


@dataclass(slots=True)
class PendingLogits:
    """A submitted step whose logits are on their way from the last stage."""

    executor: PipelineExecutor
    seq: int
    logits: torch.Tensor
    work: Any

    def result(self) -> torch.Tensor:
        """The step's float32 logits (as ``ModelRunner.execute``); waits for them."""
        return self.executor.collect(self)


class PipelineExecutor(MultiprocExecutor):
    """Rank 0 of a ``pipeline_parallel_size`` × ``tensor_parallel_size`` grid."""

    WORKER_MODULE = "engine.executor.pp.worker"
    SIZE_NAME = "pipeline_parallel_size x tensor_parallel_size"
    error_cls = PipelineParallelError

    def __init__(self, config: EngineConfig, args: ModelArgs, max_model_len: int) -> None:
        self.pp_size = config.pipeline_parallel_size
        self.tp_size = config.tensor_parallel_size
        self.vocab_size = args.vocab_size
        self.handoff = HandoffStats()
        self._seq = 0
        # Hidden-state sends still running, oldest first: (step, work, the tensor it reads).
        self._sends: collections.deque[tuple[int, Any, torch.Tensor]] = collections.deque()
        super().__init__(config, args, max_model_len)

    def world_size(self, config: EngineConfig) -> int:
        return config.pipeline_parallel_size * config.tensor_parallel_size

    def describe_grid(self, when: str) -> str:
        return (
            f"pipeline-parallel {when} failed ({self.pp_size} stages x {self.tp_size} ranks; "
            f"rank r is stage r // {self.tp_size}, TP rank r % {self.tp_size})"
        )

    def _worker_spec(self, rank: int) -> dict[str, object]:
        return {
            "stage": rank // self.tp_size,
            "tp_rank": rank % self.tp_size,
            "pp_size": self.pp_size,
            "tp_size": self.tp_size,
        }

    def _build(self, config: EngineConfig, args: ModelArgs, max_model_len: int) -> None:
        # The same order on every rank: the stage's TP group, then the grid's group.
        device = torch.device(config.device)
        if self.tp_size > 1:
            store = stage_store(self._store, 0)
            self.tp = TPGroup.create(store, 0, self.tp_size, device, self.timeout_s)
        self.pp = PPGroup.create(
            self._store, 0, 0, self.pp_size, self.tp_size, device, self.timeout_s
        )
        self.runner = ModelRunner(config, args, max_model_len, self.tp, self.pp)

    def execute(
        self, scheduled: list[ScheduledRequest], input_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """One step through every stage (no other step in flight meanwhile)."""
        if input_ids is not None:
            raise ValueError("device input ids (async scheduling) are not used with stages")
        return self.submit(scheduled).result()

    def _usable(self) -> PPGroup:
        if self._failed is not None:
            raise self._failed
        if self._closed or self.pp is None:
            raise self.error_cls("the executor is shut down")
        return self.pp

    def submit(self, scheduled: list[ScheduledRequest]) -> PendingLogits:
        """Start one step (see the module docstring); its logits come from ``result``."""
        pp = self._usable()
        runner, seq = self.runner, self._seq
        host = runner.prepare_host(scheduled)
        header, buffer = pack(host, False, seq)
        try:
            self._check_workers()
            start = time.perf_counter()
            self._write(header.encode() + buffer.tobytes())
            self.stats.record(time.perf_counter() - start)
            out = runner.run_stage(runner.to_device(host), None).contiguous()
            self._sends.append((seq, pp.send(out, pp.peer(1), hidden_tag(seq)), out))
            logits = torch.empty(
                (int(host.logits_idx.size), self.vocab_size),
                dtype=torch.float32,
                device=runner.device,
            )
            last = pp.peer(self.pp_size - 1, 0)
            work = pp.recv(logits, last, logits_tag(seq), logits=True)
            while len(self._sends) > self.pp_size:  # bounded: at most P steps in flight
                pp.wait(self._sends.popleft()[1], "send of hidden states")
        except _FAILURES as e:
            raise self._fail(e) from e
        self._seq += 1
        return PendingLogits(self, seq, logits, work)

    def collect(self, pending: PendingLogits) -> torch.Tensor:
        """Wait for ``pending``'s logits (``PendingLogits.result``)."""
        pp = self._usable()
        start = time.perf_counter()
        try:
            pp.wait(pending.work, f"receive of step {pending.seq}'s logits")
            # The last stage had the step, so every send of it and before it has landed.
            while self._sends and self._sends[0][0] <= pending.seq:
                pp.wait(self._sends.popleft()[1], "send of hidden states")
        except _FAILURES as e:
            raise self._fail(e) from e
        self.handoff.record_wait(time.perf_counter() - start)
        return pending.logits

    def _fail(self, cause: BaseException) -> TensorParallelError:
        self._failed = self._error(cause, "step")
        logger.error("%s", self._failed)
        self._sends.clear()
        self._teardown(grace_s=0.0)
        return self._failed
