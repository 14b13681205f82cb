"""The pipeline-parallel process group: point-to-point sends between stages.

One group spans the whole P × N grid (global rank ``stage * N + tp_rank``; rank 0 is the
engine's process). Stage s's TP rank r sends the hidden states it ends with to stage
s + 1's TP rank r (every TP rank of a stage holds them whole after its all-reduce), and
the last stage's TP rank 0 sends the logits to rank 0 (docs/design.md §3 "Pipeline
parallelism"). Sends and receives are asynchronous (``Work``); every wait on one has
the group's deadline, so no stage waits forever on a peer that died or hangs (a gloo
peer that dies closes its sockets, which fails the wait at once). On the CPU the group
is gloo; on CUDA the sends go over NCCL, with a gloo group beside it for host values.

Messages of one step carry the step's tag (``hidden_tag`` / ``logits_tag``: two per
step), so a receive can only match the step it was posted for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from common.process_groups import abort_group
from engine.distributed.tp_group import TPError, gloo_group, timedelta

# Tags wrap well inside gloo's 32-bit slot space; at most P steps are ever in flight.
_TAG_SPACE = 1 << 30


def hidden_tag(seq: int) -> int:
    """The tag of step ``seq``'s hidden states between two stages."""
    return (2 * seq) % _TAG_SPACE


def logits_tag(seq: int) -> int:
    """The tag of step ``seq``'s logits, last stage -> rank 0."""
    return (2 * seq + 1) % _TAG_SPACE


class PipelineError(TPError):
    """A send or receive between pipeline stages failed or timed out."""


@dataclass(slots=True)
class PPGroup:
    """This process's place in the grid and the group spanning it."""

    rank: int
    stage: int
    tp_rank: int
    pp_size: int
    tp_size: int
    pg: Any = None  # sends between stages: gloo (CPU) or NCCL (CUDA)
    # The logits (last stage -> rank 0). On CUDA a communicator of their own: NCCL runs a
    # communicator's operations in issue order, and rank 0 posts step k's logits receive
    # before step k + 1's hidden send, which must not wait behind it. On the CPU ``pg``.
    logits_pg: Any = None
    host_pg: Any = None  # gloo, for host values (the KV pool every rank can hold)
    timeout_s: float = 300.0
    nccl: bool = False

    @classmethod
    def create(
        cls,
        store: dist.Store,
        stage: int,
        tp_rank: int,
        pp_size: int,
        tp_size: int,
        device: torch.device,
        timeout_s: float,
    ) -> PPGroup:
        """Join the grid's group under ``store``; blocks until every rank joins."""
        rank, world = stage * tp_size + tp_rank, pp_size * tp_size
        try:
            host_pg = gloo_group(dist.PrefixStore("pdserve-pp/host", store), rank, world, timeout_s)
            pg = logits_pg = host_pg
            nccl = device.type == "cuda"
            if nccl:
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = timedelta(timeout_s)
                prefix = dist.PrefixStore("pdserve-pp/nccl", store)
                pg = dist.ProcessGroupNCCL(prefix, rank, world, opts)
                prefix = dist.PrefixStore("pdserve-pp/nccl-logits", store)
                logits_pg = dist.ProcessGroupNCCL(prefix, rank, world, opts)
        except Exception as e:  # store timeout, a rank that never came, NCCL init failure
            raise PipelineError(
                f"pipeline-parallel group (stage {stage}, rank {tp_rank}) not formed: {e}"
            ) from e
        return cls(rank, stage, tp_rank, pp_size, tp_size, pg, logits_pg, host_pg, timeout_s, nccl)

    def peer(self, stage: int, tp_rank: int | None = None) -> int:
        """The global rank of ``tp_rank`` (default: this one's) on ``stage``."""
        return stage * self.tp_size + (self.tp_rank if tp_rank is None else tp_rank)

    @property
    def is_last(self) -> bool:
        return self.stage == self.pp_size - 1

    def send(self, tensor: torch.Tensor, dst: int, tag: int, logits: bool = False) -> Any:
        """Start sending ``tensor`` (contiguous; keep it alive until ``wait``); ``logits``:
        on the logits' channel."""
        try:
            return (self.logits_pg if logits else self.pg).send([tensor], dst, tag)
        except Exception as e:
            msg = f"pipeline send to rank {dst} failed on rank {self.rank}: {e}"
            raise PipelineError(msg) from e

    def recv(self, tensor: torch.Tensor, src: int, tag: int, logits: bool = False) -> Any:
        """Start receiving into ``tensor`` (contiguous, the sender's shape and dtype)."""
        try:
            return (self.logits_pg if logits else self.pg).recv([tensor], src, tag)
        except Exception as e:
            msg = f"pipeline recv from rank {src} failed on rank {self.rank}: {e}"
            raise PipelineError(msg) from e

    def wait(self, work: Any, what: str) -> None:
        """Wait for a send or receive, at most the group's deadline (``PipelineError``).
        NCCL: orders the current stream after it; NCCL's watchdog bounds it."""
        try:
            if self.nccl:
                work.wait()
            else:
                work.wait(timedelta(self.timeout_s))
        except Exception as e:
            raise PipelineError(f"pipeline {what} failed on rank {self.rank}: {e}") from e

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the grid (the KV pool every stage can hold)."""
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]
        try:
            work = self.host_pg.allreduce([t], opts)
            work.wait(timedelta(self.timeout_s))
        except Exception as e:
            raise PipelineError(f"pipeline all-reduce failed on rank {self.rank}: {e}") from e
        return int(t.item())

    def abort(self) -> None:
        """Abort the NCCL group from any thread (kernels waiting on a lost peer return)."""
        for pg in (self.pg, self.logits_pg):
            if self.nccl and pg is not None:
                abort_group(pg, "pipeline-parallel group")

    def close(self) -> None:
        groups = {id(g): g for g in (self.pg, self.logits_pg, self.host_pg) if g is not None}
        self.pg = self.logits_pg = self.host_pg = None
        for g in groups.values():
            abort_group(g, "pipeline-parallel group")
