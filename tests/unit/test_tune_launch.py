"""`UpProcess`: readiness deadline and process-group cleanup, with real child processes.

The child is a small Python script standing in for the launcher's process shape (it
starts a grandchild, prints the ready line, waits for a signal); the real `pdserve up`
runs in tests/e2e/test_tune.py.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from pdserve.tune_launch import LaunchFailed, UpProcess

SCRIPT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
open(sys.argv[1], "w").write(str(child.pid))
print("starting...", flush=True)
time.sleep(float(sys.argv[2]))
if sys.argv[3] == "ready":
    print("pdserve is ready: http://127.0.0.1:1/v1", flush=True)
    time.sleep(120)
sys.exit(3)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) counts as gone
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    return False


def make(tmp_path: Path, delay: float, mode: str, timeout: float = 20.0) -> UpProcess:
    script = tmp_path / "fake_up.py"
    script.write_text(SCRIPT)
    argv = [sys.executable, str(script), str(tmp_path / "grandchild.pid"), str(delay), mode]
    return UpProcess(argv, tmp_path / "logs" / "up.log", ready_timeout_s=timeout, stop_grace_s=5)


def test_ready_then_whole_group_stopped(tmp_path: Path) -> None:
    up = make(tmp_path, 0.2, "ready")
    with up:
        assert up.proc is not None and up.proc.poll() is None
        grandchild = int((tmp_path / "grandchild.pid").read_text())
        assert alive(grandchild)
    assert up.proc.poll() is not None
    assert wait_gone(grandchild), "the grandchild outlived the stop"
    log = (tmp_path / "logs" / "up.log").read_text()
    assert "starting..." in log and "pdserve is ready" in log
    up.stop()  # idempotent


def test_exit_before_ready_is_an_error_with_log(tmp_path: Path) -> None:
    up = make(tmp_path, 0.1, "exit")
    with pytest.raises(LaunchFailed, match=r"exited with status 3(.|\n)*starting\.\.\."):
        up.start()
    grandchild = int((tmp_path / "grandchild.pid").read_text())
    assert wait_gone(grandchild)


def test_not_ready_in_time(tmp_path: Path) -> None:
    up = make(tmp_path, 60, "ready", timeout=1.5)
    with pytest.raises(LaunchFailed, match="not ready within 2 s"):
        up.start()
    assert up.proc is not None and up.proc.poll() is not None
    assert wait_gone(int((tmp_path / "grandchild.pid").read_text()))
