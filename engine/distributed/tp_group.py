"""The tensor-parallel process group: the collectives a sharded model and the executor need.

Built without ``torch.distributed.init_process_group``: that makes one world per process,
and one process may hold several engines (tests do) next to other groups (the p2p KV
connector's). Each tensor-parallel engine instead gets its own ``ProcessGroup`` objects
made from a private ``TCPStore`` (rank 0 hosts it on a free loopback port): the model's
group (gloo on the CPU, NCCL on CUDA) and, on CUDA, a gloo group on the host for host
tensors (the KV pool size every rank can hold). Step inputs do not go through a group:
rank 0 writes them on each worker's pipe (``engine/executor/tp/step_wire.py``).

Every collective has a deadline: a gloo operation waits at most ``timeout`` (a peer that
dies closes its sockets, which fails the operation at once); NCCL operations are bounded by
NCCL's own watchdog with the same timeout. A failure raises ``TPError`` and leaves the
group unusable: the executor reports it and the engine's next step fails the same way.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from common.process_groups import abort_group


class TPError(RuntimeError):
    """A tensor-parallel collective failed or timed out (a rank died or hung)."""


def timedelta(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(0.001, seconds))


def startup_timeout(timeout_s: float) -> float:
    """How long ranks may take to meet: model loading on a busy host takes a while, so at
    least two minutes whatever the per-operation timeout (a rank that dies meanwhile is
    noticed at once by rank 0, which watches the processes)."""
    return max(timeout_s, 120.0)


# The address this process's gloo groups bind and advertise: loopback while every rank is
# on this host (the hostname may not resolve in a container); a pipeline group spanning
# hosts sets the address its peers reach it at (engine/executor/pp/join.py).
_gloo_host = "127.0.0.1"


def use_gloo_host(host: str) -> None:
    """Bind this process's later gloo groups to ``host`` (an address of this host)."""
    global _gloo_host
    _gloo_host = host


def gloo_group(store: dist.Store, rank: int, size: int, timeout_s: float) -> Any:
    opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=_gloo_host)]
    # Gloo applies this to connecting; each operation's wait has ``TPGroup.timeout_s``.
    opts._timeout = timedelta(startup_timeout(timeout_s))
    return dist.ProcessGroupGloo(store, rank, size, opts)


@dataclass(slots=True)
class TPGroup:
    """Rank ``rank`` of ``size``. ``size == 1`` is the single-process engine: no groups,
    and the model never calls the collectives (``TPGroup.single()``)."""

    rank: int = 0
    size: int = 1
    pg: Any = None  # the model's group: gloo (CPU) or NCCL (CUDA)
    host_pg: Any = None  # gloo group for host tensors (the same object as ``pg`` on CPU)
    timeout_s: float = 300.0
    nccl: bool = False

    @classmethod
    def single(cls) -> TPGroup:
        return cls()

    @classmethod
    def create(
        cls, store: dist.Store, rank: int, size: int, device: torch.device, timeout_s: float
    ) -> TPGroup:
        """Join the group under ``store``; blocks until every rank joins (or the timeout).
        On CUDA the caller has made ``device`` current."""
        try:
            host_pg = gloo_group(dist.PrefixStore("pdserve-tp/host", store), rank, size, timeout_s)
            if device.type != "cuda":
                return cls(rank, size, host_pg, host_pg, timeout_s)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timedelta(timeout_s)
            pg = dist.ProcessGroupNCCL(dist.PrefixStore("pdserve-tp/nccl", store), rank, size, opts)
        except Exception as e:  # store timeout, a rank that never came, NCCL init failure
            raise TPError(f"tensor-parallel group (rank {rank} of {size}) not formed: {e}") from e
        return cls(rank, size, pg, host_pg, timeout_s, nccl=True)

    def _wait(self, work: Any, what: str, nccl: bool = False) -> None:
        try:
            if nccl:
                work.wait()  # orders the current stream after it; NCCL's watchdog bounds it
            else:
                work.wait(timedelta(self.timeout_s))
        except Exception as e:
            raise TPError(f"tensor-parallel {what} failed on rank {self.rank}: {e}") from e

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` (contiguous) over the ranks, in place; returns it."""
        try:
            work = self.pg.allreduce([tensor])
        except Exception as e:
            raise TPError(f"tensor-parallel all-reduce failed on rank {self.rank}: {e}") from e
        self._wait(work, "all-reduce", self.nccl)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` (equal shapes) concatenated along the last dim, in rank order."""
        tensor = tensor.contiguous()
        parts = [torch.empty_like(tensor) for _ in range(self.size)]
        try:
            work = self.pg.allgather([parts], [tensor])
        except Exception as e:
            raise TPError(f"tensor-parallel all-gather failed on rank {self.rank}: {e}") from e
        self._wait(work, "all-gather", self.nccl)
        return torch.cat(parts, dim=-1)

    def broadcast(self, tensor: torch.Tensor, *, host: bool) -> torch.Tensor:
        """Rank 0's ``tensor`` into every rank's (in place). ``host``: a CPU tensor over
        the host group; else one on the model's device over the model's group."""
        pg = self.host_pg if host else self.pg
        try:
            work = pg.broadcast([tensor])
        except Exception as e:
            raise TPError(f"tensor-parallel broadcast failed on rank {self.rank}: {e}") from e
        self._wait(work, "broadcast", self.nccl and not host)
        return tensor

    def min_int(self, value: int) -> int:
        """The smallest ``value`` over the ranks (the KV pool every rank can hold)."""
        t = torch.tensor([value], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN  # type: ignore[assignment]
        try:
            work = self.host_pg.allreduce([t], opts)
        except Exception as e:
            raise TPError(f"tensor-parallel all-reduce failed on rank {self.rank}: {e}") from e
        self._wait(work, "all-reduce (min)")
        return int(t.item())

    def warm_up(self, device: torch.device) -> None:
        """One all-reduce and one all-gather on the model's group, waited for: NCCL makes
        its communicator at the first collective, which must happen before a CUDA graph
        capture records collectives (docs/design.md §3, tensor parallelism). Every rank
        calls it at the same point. ``TPError`` if the sum is wrong (a broken group)."""
        ones = torch.ones(1, dtype=torch.float32, device=device)
        total = self.all_reduce(ones.clone())
        ranks = self.all_gather(torch.full((1,), float(self.rank), device=device))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        expected = [float(r) for r in range(self.size)]
        if total.item() != self.size or ranks.tolist() != expected:
            raise TPError(
                f"tensor-parallel warm-up on rank {self.rank}: all-reduce gave {total.item()} "
                f"(expected {self.size}), all-gather {ranks.tolist()} (expected {expected})"
            )

    def abort(self) -> None:
        """Abort the model's group from any thread, keeping the objects: NCCL kernels
        waiting on a dead or hung peer return (inside a replayed CUDA graph too, which no
        watchdog times out), and later collectives fail with ``TPError``. ``close`` still
        runs afterwards."""
        pg = self.pg  # ``close`` may clear it meanwhile
        if self.nccl and pg is not None:
            abort_group(pg, "tensor-parallel group")

    def close(self) -> None:
        """Abort the groups (NCCL: its communicators) so nothing waits on a dead peer."""
        groups = {id(g): g for g in (self.pg, self.host_pg) if g is not None}
        self.pg = self.host_pg = None
        for g in groups.values():
            abort_group(g, "tensor-parallel group")
