"""``MultiprocExecutor``: tensor parallelism with one process per rank.

This process is rank 0: it keeps the scheduler, the sampler and everything else, and a
``ModelRunner`` of its own shard. It starts ranks 1..N-1 as fresh interpreters
(``python -m engine.executor.tp.worker``; a fresh interpreter, so nothing of this process, and not
its ``__main__``, is re-run) and hands each its settings on stdin. The group forms through
a private ``TCPStore`` on a free loopback port: no environment variables, no global
process group.

Per step rank 0 builds the host inputs and writes an 80-byte header followed by one packed
buffer (``engine/executor/tp/step_wire.py``) to every worker's stdin (a worker idles blocked on it,
with no collective and so no timeout running; rank 0 does not wait for it to wake: the
pipe has room for a step, and each write waits at most ``distributed_timeout`` for room,
``tp_procs.write_all``), with async scheduling then one device broadcast of the token ids;
then every rank runs the
forward pass and rank 0 gets the full logits.

Failure: a worker found dead before a step, a header that cannot be written, or a failed
or timed-out collective fail the step with ``TensorParallelError`` naming the ranks and how
they ended; the remaining workers are stopped and every later step raises the same error.
Workers exit when rank 0 does: stdin reaches EOF, their collectives fail, and a watchdog
thread polls the parent pid (PR_SET_PDEATHSIG is tied to the thread that started the
process, which may end long before the engine does).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import subprocess
import sys
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.core.scheduler import ScheduledRequest
from engine.distributed.pp_group import PPGroup
from engine.distributed.tp_group import TPError, TPGroup, startup_timeout, timedelta
from engine.executor.base import ExecutorFailure
from engine.executor.model_runner import ModelRunner
from engine.executor.tp.procs import check_gpus, device_for_rank, open_pipe, stop_workers, write_all
from engine.executor.tp.step_wire import OP_KV, OP_SHUTDOWN, Header, pack
from engine.executor.tp.watch import StepWatch, describe_exit
from engine.models import ModelArgs

logger = logging.getLogger(__name__)

UP_KEY = "pdserve-tp/up/{rank}"


class TensorParallelError(ExecutorFailure):
    """The tensor-parallel engine cannot run: a rank died, hung or failed to start."""


_FAILURES = (TPError, TensorParallelError, OSError)


@dataclass(slots=True)
class BroadcastStats:
    """Time rank 0 spends handing out step inputs (pipe writes + the device ids'
    broadcast under async scheduling), per step."""

    steps: int = 0
    seconds: float = 0.0
    max_seconds: float = 0.0

    def record(self, seconds: float) -> None:
        self.steps += 1
        self.seconds += seconds
        self.max_seconds = max(self.max_seconds, seconds)

    @property
    def mean_us(self) -> float:
        return 1e6 * self.seconds / self.steps if self.steps else 0.0


def _abort_group(ref: weakref.ref[MultiprocExecutor]) -> Callable[[str], None]:
    """``StepWatch``'s callback: abort the executor's group. Through a weak reference, so
    the watch thread does not keep a dropped executor (and its workers) alive."""

    def abort(reason: str) -> None:
        executor = ref()
        if executor is not None:
            executor.tp.abort()
            if executor.pp is not None:
                executor.pp.abort()

    return abort


def _release(watch: StepWatch, procs: list[subprocess.Popen[bytes]]) -> None:
    """A dropped executor (or the interpreter's exit): the watch first, so the workers'
    exits are not reported as a lost instance."""
    watch.stop()
    stop_workers(procs, 2.0)


class MultiprocExecutor:
    """Rank 0 of ``config.tensor_parallel_size`` ranks; see the module docstring.

    The pipeline-parallel executor (``engine/executor/pp/executor.py``) is this one with a
    P × N grid of processes: it overrides ``world_size``, ``_build`` (the groups and the
    runner), the worker module and ``_worker_spec``."""

    WORKER_MODULE = "engine.executor.tp.worker"
    SIZE_NAME = "tensor_parallel_size"  # what the process count is called in refusals
    error_cls: type[TensorParallelError] = TensorParallelError

    def world_size(self, config: EngineConfig) -> int:
        """How many processes run the model (this one included)."""
        return config.tensor_parallel_size

    def local_size(self, config: EngineConfig) -> int:
        """How many of them run on this host (one GPU each on CUDA)."""
        return self.world_size(config)

    def describe_grid(self, when: str) -> str:
        """What failed and what the processes are, for error messages."""
        return f"tensor-parallel {when} failed ({self.size} ranks)"

    def __init__(self, config: EngineConfig, args: ModelArgs, max_model_len: int) -> None:
        size = self.world_size(config)
        if config.device != "cpu":  # before any process starts
            check_gpus(
                config.device, self.local_size(config), torch.cuda.device_count(), self.SIZE_NAME
            )
        self.size = size
        self.timeout_s = config.distributed_timeout
        self.stats = BroadcastStats()
        self._failed: TensorParallelError | None = None
        self.pp: PPGroup | None = None  # the pipeline group (pp/executor.py), closed last
        self._closed = False
        self._store = dist.TCPStore(
            "127.0.0.1",
            0,
            None,
            True,
            timedelta(startup_timeout(self.timeout_s)),
            wait_for_workers=False,
            use_libuv=True,
        )
        self._procs = [self._spawn(config, r, max_model_len) for r in range(1, size)]
        self.tp = TPGroup.single()
        # Rank 0 watches the workers from start-up on (engine/executor/tp/watch.py), and on CUDA the
        # steps on the GPU too: a collective inside a CUDA graph has no deadline of its own.
        self._cuda = config.device != "cpu"
        self._watch: StepWatch | None = StepWatch(
            self._procs,
            self.timeout_s,
            _abort_group(weakref.ref(self)),
            device=device_for_rank(config.device, 0) if self._cuda else None,
        )
        self._finalizer = weakref.finalize(self, _release, self._watch, self._procs)
        try:
            self._await_workers()
            device = device_for_rank(config.device, 0)
            if device != "cpu":
                torch.cuda.set_device(device)
            self._build(dataclasses.replace(config, device=device), args, max_model_len)
        except Exception as e:
            # Say how the workers ended before stopping them; other errors (a bad
            # checkpoint on rank 0, ...) pass through unchanged.
            lost = self._watch is not None and self._watch.reason is not None
            error = self._error(e, "start-up") if lost or isinstance(e, _FAILURES) else None
            self.shutdown()
            if error is not None:
                raise error from e
            raise
        logger.info("tensor parallel: %d ranks up (workers %s)", size, self.worker_pids)

    def _build(self, config: EngineConfig, args: ModelArgs, max_model_len: int) -> None:
        """Join the group and build rank 0's runner (``config.device`` is rank 0's)."""
        device = torch.device(config.device)
        self.tp = TPGroup.create(self._store, 0, self.size, device, self.timeout_s)
        self.runner = ModelRunner(config, args, max_model_len, self.tp)

    def _worker_spec(self, rank: int) -> dict[str, object]:
        """What a worker needs besides the common settings (none for tensor parallelism)."""
        return {}

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    def _spawn(
        self, config: EngineConfig, rank: int, max_model_len: int
    ) -> subprocess.Popen[bytes]:
        spec = self._spec(config, rank, max_model_len)
        env = dict(os.environ)
        root = str(Path(__file__).resolve().parent.parent)  # where `engine` imports from
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        proc = subprocess.Popen(
            [sys.executable, "-m", self.WORKER_MODULE],
            stdin=subprocess.PIPE,
            bufsize=0,
            env=env,
        )
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(spec).encode() + b"\n")  # blocking: the pipe is empty
        open_pipe(proc.stdin.fileno())
        return proc

    def _spec(self, config: EngineConfig, rank: int, max_model_len: int) -> dict[str, object]:
        """The settings line worker ``rank`` reads first."""
        return {
            "config": dataclasses.asdict(
                dataclasses.replace(
                    config, device=device_for_rank(config.device, rank), speculative=None
                )
            ),
            "rank": rank,
            "size": self.size,
            "store_port": self._store.port,
            "parent_pid": os.getpid(),
            "torch_threads": torch.get_num_threads(),
            "max_model_len": max_model_len,
        } | self._worker_spec(rank)

    def _await_workers(self) -> None:
        """Until every worker has reached the store, or one has died, or the timeout."""
        keys = [UP_KEY.format(rank=r) for r in range(1, self.size)]
        limit = startup_timeout(self.timeout_s)
        deadline = time.monotonic() + limit
        while not self._store.check(keys):
            if any(p.poll() is not None for p in self._procs):
                raise self.error_cls("a worker exited before joining")
            if time.monotonic() > deadline:
                raise self.error_cls(f"workers did not start within {limit} s")
            time.sleep(0.02)

    def _error(self, cause: BaseException, when: str) -> TensorParallelError:
        """A ``TensorParallelError`` for ``cause`` that says how each worker ended."""
        deadline = time.monotonic() + 1.0  # a dead peer's exit status may lag its sockets
        for p in self._procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(max(0.0, deadline - time.monotonic()))
        dead = [describe_exit(p, r) for r, p in enumerate(self._procs, 1) if p.poll() is not None]
        ranks = "; ".join(dead) if dead else "no worker exited"
        return self.error_cls(f"{self.describe_grid(when)}: {ranks}. Cause: {cause}")

    def _check_workers(self) -> None:
        if any(p.poll() is not None for p in self._procs):
            raise self.error_cls("a worker is gone")
        if self._watch is not None and self._watch.reason is not None:
            raise self.error_cls(self._watch.reason)

    @property
    def lost(self) -> str | None:
        """Why the watch declared the instance lost (a worker exited, a GPU step passed
        its deadline), or None; ``check`` turns it into the step's failure."""
        return None if self._watch is None else self._watch.reason

    def check(self) -> None:
        """Raise ``TensorParallelError`` if the instance was lost since the last step
        launched (the watch fired: a worker exited or a GPU step passed its deadline). The
        engine calls it after reading a step's results and before handing them out: the
        logits of a step whose collectives were aborted are garbage."""
        if self._failed is not None:
            raise self._failed
        if self._watch is None or self._watch.reason is None:
            return
        self._failed = self._error(self.error_cls(self._watch.reason), "step")
        logger.error("%s", self._failed)
        self._teardown(grace_s=0.0)
        raise self._failed

    def execute(
        self, scheduled: list[ScheduledRequest], input_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Hand the step to every rank and run rank 0's part; the full logits."""
        if self._failed is not None:
            raise self._failed
        if self._closed:
            raise self.error_cls("the executor is shut down")
        runner = self.runner
        host = runner.prepare_host(scheduled, input_ids)
        header, buffer = pack(host, input_ids is not None)
        try:
            self._check_workers()
            start = time.perf_counter()
            self._write(header.encode() + buffer.tobytes())
            if input_ids is not None:
                self.tp.broadcast(input_ids.contiguous(), host=False)
            self.stats.record(time.perf_counter() - start)
            logits = runner.run(runner.to_device(host, input_ids))
            if self._watch is not None and self._cuda:
                done = torch.cuda.Event()
                done.record()
                self._watch.launched(done)
            return logits
        except _FAILURES as e:
            self._failed = self._error(e, "step")
            logger.error("%s", self._failed)
            self._teardown(grace_s=0.0)
            raise self._failed from e

    @property
    def store_port(self) -> int:
        """The private store's loopback port (the KV results of the workers: ``engine/kv/tp.py``)."""
        return int(self._store.port)

    def send_kv(self, payload: bytes) -> None:
        """Hand a KV-connector message to every worker, in order with the steps."""
        if self._failed is not None:
            raise self._failed
        if self._closed:
            raise self.error_cls("the executor is shut down")
        message = Header(OP_KV, num_ids=len(payload)).encode() + payload
        try:
            self._check_workers()
            self._write(message)
        except _FAILURES as e:
            self._failed = self._error(e, "KV message")
            self._teardown(grace_s=0.0)
            raise self._failed from e

    def _write(self, message: bytes) -> None:
        """``message`` to every worker's pipe, in order with everything written before."""
        for p in self._procs:
            assert p.stdin is not None
            write_all(p.stdin.fileno(), message, self.timeout_s)

    def _teardown(self, grace_s: float) -> None:
        if self._watch is not None:
            self._watch.stop()
        self._finalizer.detach()
        stop_workers(self._procs, grace_s)
        self.tp.close()
        if self.pp is not None:
            self.pp.close()

    def shutdown(self) -> None:
        """Stop every worker (a shutdown header, then EOF, then SIGKILL after a grace)."""
        if self._closed:
            return
        self._closed = True
        if self._watch is not None:
            self._watch.stop()  # the workers are about to exit on purpose
        bye = Header(OP_SHUTDOWN).encode()
        for p in self._procs:
            try:
                if p.stdin is not None and not p.stdin.closed:
                    write_all(p.stdin.fileno(), bye, 1.0)
            except OSError:
                pass  # already gone
        self._teardown(grace_s=5.0)
        if self.stats.steps:
            logger.info(
                "tensor parallel: %d steps, step inputs handed out in %.1f us mean, %.1f us max",
                self.stats.steps,
                self.stats.mean_us,
                1e6 * self.stats.max_seconds,
            )
