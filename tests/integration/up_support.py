"""`pdserve up` as a real process tree in tests: start it, wait for its output, find its
children, and kill whatever is left at the end."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from tests.service_fixtures import REPO, child_env

READY_TIMEOUT_S = 300.0
SMALL = ("--kv-cache-memory", "32Mi", "--max-num-seqs", "8", "--torch-threads", "1")


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (through /proc; children may be in other groups)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # the comm field may contain spaces: ppid is the 2nd field after the closing ')'
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


class UpProcess:
    """`python -m pdserve up ...` in its own session, output captured to a file."""

    def __init__(self, tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.out_path = tmp_path / "up.out"
        self.err_path = tmp_path / "up.err"
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pdserve", "up", *args],
                cwd=REPO,
                env=child_env(env),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,
            )

    def output(self) -> str:
        return self.out_path.read_text(errors="replace") + self.err_path.read_text(errors="replace")

    def wait_for(self, needle: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.output():
            status = self.proc.poll()
            assert status is None, (
                f"pdserve up exited ({status}) before {needle!r}:\n{self.output()}"
            )
            assert time.monotonic() < deadline, (
                f"no {needle!r} within {timeout} s:\n{self.output()}"
            )
            time.sleep(0.2)

    def kill_tree(self) -> None:
        """Test cleanup only: SIGKILL anything still running."""
        for pid in descendants(self.proc.pid) | {self.proc.pid}:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


def workdir_of(up: UpProcess) -> Path:
    """The run's temporary directory, from the ``status in .../status.json`` line."""
    for line in up.output().splitlines():
        if "status.json" in line:
            return Path(line.split()[-1]).parent
    raise AssertionError(f"no status.json line in:\n{up.output()}")


def read_status(workdir: Path) -> dict[str, dict[str, Any]]:
    """``status.json`` of a running `pdserve up`, by child name."""
    data = json.loads((workdir / "status.json").read_text())
    return {child["name"]: child for child in data["children"]}


def kill_and_take_port(supervisor_pid: int, child_pid: int, port: int) -> socket.socket:
    """SIGKILL ``child_pid`` and bind a listening socket to its ``port`` before the
    supervisor can restart it there: the supervisor (``pdserve up``) restarts a child 0.5 s
    after its exit, which a loaded machine can let win, so it is paused (itself only, its
    children run on) until the port is taken. The caller closes the socket."""
    holder = socket.socket()
    os.kill(supervisor_pid, signal.SIGSTOP)
    try:
        os.kill(child_pid, signal.SIGKILL)
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        deadline = time.monotonic() + 10
        while True:  # the killed server's socket is gone once it exits
            try:
                holder.bind(("127.0.0.1", port))
                break
            except OSError:
                if time.monotonic() > deadline:
                    holder.close()
                    raise AssertionError(f"port {port} never came free") from None
                time.sleep(0.01)
        holder.listen()
        return holder
    finally:
        os.kill(supervisor_pid, signal.SIGCONT)
