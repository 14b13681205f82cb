"""The tensor-parallel worker processes seen from rank 0: which device each rank takes,
whether the visible GPUs can hold the ranks (checked before any process starts), and
stopping them (``engine/executor/tp/executor.py`` starts them)."""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import subprocess
import time

# Rank 0's pipe to each worker: room for a large batch's step inputs (a 64-request step
# with 256-block tables is ~130 KiB), so handing them out rarely waits for the worker.
PIPE_BYTES = 1 << 20


def device_for_rank(device: str, rank: int) -> str:
    """``cpu`` for every rank; on CUDA rank r takes the r-th GPU from the configured one."""
    if device == "cpu":
        return device
    base = int(device.partition(":")[2] or 0)
    return f"cuda:{base + rank}"


def check_gpus(device: str, size: int, available: int, name: str = "tensor_parallel_size") -> None:
    """``ValueError`` unless GPUs ``base .. base + size - 1`` of ``device`` (``cuda`` or
    ``cuda:base``) are among the ``available`` visible ones: one GPU per rank, never two
    ranks on one GPU (NCCL refuses that, and the shards would not fit anyway). ``name``:
    what ``size`` is called in the message (pipeline parallelism: P x N)."""
    base = int(device.partition(":")[2] or 0)
    if base + size <= available:
        return
    if available == 0:
        raise ValueError(
            f"{name} {size} on {device} needs {size} GPUs, but no GPU is "
            "visible (check CUDA_VISIBLE_DEVICES and the driver), or use device='cpu'"
        )
    if base >= available:
        raise ValueError(
            f"{device} does not exist: {available} GPU(s) are visible (0..{available - 1})"
        )
    fits = available - base
    raise ValueError(
        f"{name} {size} on {device} needs GPUs {base}..{base + size - 1}, but "
        f"only {available} are visible (0..{available - 1}): use {name} <= "
        f"{fits} from {device}, a lower starting GPU, or make more GPUs visible "
        "(CUDA_VISIBLE_DEVICES)"
    )


def stop_workers(procs: list[subprocess.Popen[bytes]], grace_s: float) -> None:
    """Close every worker's stdin (a worker exits on EOF), then kill what is still there."""
    for p in procs:
        if p.stdin is not None and not p.stdin.closed:
            with contextlib.suppress(OSError):
                p.stdin.close()
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def open_pipe(fd: int, size: int = PIPE_BYTES) -> None:
    """Make rank 0's end of a worker's pipe non-blocking (``write_all`` bounds each wait)
    and ask for a ``size``-byte pipe, so a step's inputs usually fit without waiting for
    the worker to read (Linux; best effort: the default 64 KiB still works)."""
    os.set_blocking(fd, False)
    with contextlib.suppress(OSError, AttributeError):
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, size)  # type: ignore[attr-defined]


def write_all(fd: int, data: bytes, timeout_s: float) -> None:
    """Write all of ``data`` to the non-blocking pipe ``fd``, waiting at most ``timeout_s``
    for room. ``TimeoutError`` when the reader stopped reading (a hung worker),
    ``BrokenPipeError`` when it is gone; both are ``OSError``s the executor reports."""
    view = memoryview(data)
    deadline = time.monotonic() + timeout_s
    room = select.poll()  # not select(): a busy service's fds may pass FD_SETSIZE
    room.register(fd, select.POLLOUT)
    while view:
        try:
            view = view[os.write(fd, view) :]
            continue
        except BlockingIOError:
            pass
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"a worker read nothing from its pipe for {timeout_s:g} s")
        room.poll(1000 * min(left, 1.0))
