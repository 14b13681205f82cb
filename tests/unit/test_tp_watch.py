"""``StepWatch`` (engine/executor/tp/watch.py) with real processes: it fires once when a worker
exits or when the oldest unfinished step passes the deadline, names why, and stays quiet
for finished steps and after ``stop``. A GPU step's CUDA event is stood in for by an object
with the same ``query`` (there is no GPU here); the CUDA path is in tests/gpu/test_tp_gpu.py.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from engine.executor.tp.watch import StepWatch


@dataclass
class Step:
    done: bool = False

    def query(self) -> bool:
        return self.done


@pytest.fixture
def worker() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield proc
    proc.kill()
    proc.wait()


class Fired:
    def __init__(self) -> None:
        self.reasons: list[str] = []
        self.event = threading.Event()

    def __call__(self, reason: str) -> None:
        self.reasons.append(reason)
        self.event.set()


@pytest.mark.timeout(60)
def test_a_worker_that_exits_fires_once_with_its_rank(worker: subprocess.Popen[bytes]) -> None:
    fired = Fired()
    watch = StepWatch([worker], timeout_s=300, on_failure=fired, interval_s=0.01)
    try:
        assert watch.poll() is None
        worker.send_signal(signal.SIGKILL)
        assert fired.event.wait(30)
        assert fired.reasons == [f"rank 1 (pid {worker.pid}) exited with signal SIGKILL"]
        assert watch.reason == fired.reasons[0]
    finally:
        watch.stop()
    assert len(fired.reasons) == 1


@pytest.mark.timeout(60)
def test_a_step_past_the_deadline_fires_and_finished_steps_do_not(
    worker: subprocess.Popen[bytes],
) -> None:
    fired = Fired()
    watch = StepWatch([worker], timeout_s=0.2, on_failure=fired, interval_s=0.01)
    try:
        finished = Step(done=True)
        watch.launched(finished)
        assert watch.poll() is None  # forgotten once done
        hung = Step()
        watch.launched(hung)
        assert fired.event.wait(30)
        assert fired.reasons == [
            "a step did not finish on the GPU within 0.2 s (distributed_timeout): a rank hangs"
        ]
    finally:
        watch.stop()


@pytest.mark.timeout(60)
def test_stopped_watch_ignores_workers_stopped_on_purpose(
    worker: subprocess.Popen[bytes],
) -> None:
    fired = Fired()
    watch = StepWatch([worker], timeout_s=300, on_failure=fired, interval_s=0.01)
    watch.stop()  # joins the thread
    worker.kill()
    worker.wait()
    assert watch.poll() is not None  # a running watch would fire now ...
    assert fired.reasons == [] and watch.reason is None  # ... this one has ended


def test_bad_deadline_is_refused() -> None:
    with pytest.raises(ValueError, match="step deadline must be > 0 s"):
        StepWatch([], timeout_s=0, on_failure=lambda reason: None)
