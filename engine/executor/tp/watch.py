"""``StepWatch``: rank 0's watch over the tensor-parallel workers, and on CUDA a deadline
for the steps on the GPU.

A collective on the CPU (gloo) fails by itself when a peer dies, and times out when one
hangs. On CUDA an NCCL kernel waiting on a dead or stopped peer spins on the GPU; NCCL's
watchdog bounds eager collectives, but a collective inside a replayed CUDA graph is not
watched by anyone, and rank 0's host would wait on the step's logits forever. So rank 0
runs this thread next to its steps: it polls the worker processes and the oldest step
still running on the GPU (a CUDA event recorded after its launch), and when a worker has
exited, or a step has run longer than the deadline, it records why and calls
``on_failure`` (which aborts the NCCL communicator, so the waiting kernels return).
The executor then fails the step in the engine's thread (``MultiprocExecutor.check``):
the logits of an aborted step are never used (docs/design.md §3, tensor parallelism).
On the CPU it watches the workers only (steps record no events; gloo fails by itself),
so a worker lost between steps is reported by ``check`` the same way.
"""

from __future__ import annotations

import collections
import logging
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

logger = logging.getLogger(__name__)


class StepEvent(Protocol):
    """What a step leaves to watch: ``torch.cuda.Event`` (``query``: done on the GPU)."""

    def query(self) -> bool: ...


@dataclass(slots=True)
class _Launched:
    event: StepEvent
    at: float  # time.monotonic() at launch


def describe_exit(proc: subprocess.Popen[bytes], rank: int) -> str:
    """``rank 1 (pid 42) exited with signal SIGKILL`` (or ``... is running``)."""
    code = proc.poll()
    if code is None:
        return f"rank {rank} (pid {proc.pid}) is running"
    how = f"signal {signal.Signals(-code).name}" if code < 0 else f"code {code}"
    return f"rank {rank} (pid {proc.pid}) exited with {how}"


class StepWatch:
    """Watches ``procs`` (ranks 1..N-1) and the steps ``launched`` on the GPU; see the
    module docstring. ``reason`` is None until it fires (once); ``stop`` ends it."""

    def __init__(
        self,
        procs: Sequence[subprocess.Popen[bytes]],
        timeout_s: float,
        on_failure: Callable[[str], None],
        interval_s: float = 0.05,
        device: str | None = None,
    ) -> None:
        """``device``: the CUDA device of the steps' events, made current in the thread
        before its first query (not at start: rank 0 may be capturing CUDA graphs then)."""
        if not timeout_s > 0:
            raise ValueError(f"step deadline must be > 0 s, got {timeout_s}")
        self._procs = list(procs)
        self.timeout_s = timeout_s
        self._on_failure = on_failure
        self._interval_s = interval_s
        self._device = device
        self._pending: collections.deque[_Launched] = collections.deque()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.reason: str | None = None
        self._thread = threading.Thread(target=self._run, name="tp-step-watch", daemon=True)
        self._thread.start()

    def launched(self, event: StepEvent) -> None:
        """A step was launched; ``event`` completes when the GPU has finished it."""
        with self._lock:
            self._pending.append(_Launched(event, time.monotonic()))

    def poll(self) -> str | None:
        """Why the instance is lost, or None: a worker exited, or the oldest unfinished
        step is past the deadline. Finished steps are forgotten."""
        for rank, proc in enumerate(self._procs, 1):
            if proc.poll() is not None:
                return describe_exit(proc, rank)
        with self._lock:
            if self._pending and self._device is not None:
                import torch  # only a CUDA watch gets here

                torch.cuda.set_device(self._device)
                self._device = None
            while self._pending and self._pending[0].event.query():
                self._pending.popleft()
            oldest = self._pending[0].at if self._pending else None
        if oldest is not None and time.monotonic() - oldest > self.timeout_s:
            return (
                f"a step did not finish on the GPU within {self.timeout_s:g} s "
                "(distributed_timeout): a rank hangs"
            )
        return None

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            reason = self.poll()
            if reason is None:
                continue
            self.reason = reason
            logger.error("tensor parallel: %s; aborting the group", reason)
            try:
                self._on_failure(reason)
            except Exception:  # noqa: BLE001 - the engine's thread reports the failure
                logger.exception("tensor parallel: abort after '%s' failed", reason)
            return

    def stop(self) -> None:
        """End the thread (before workers are stopped on purpose); idempotent."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout=2 * self._interval_s + 1.0)
