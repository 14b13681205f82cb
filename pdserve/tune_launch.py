"""Run one `pdserve up` for `pdserve tune`: start it in its own process group, wait (with a
deadline) for its `pdserve is ready` line, and stop the whole group afterwards.

Its output goes to a log file; a reader thread scans it for the ready line, so a chatty
child can never block on a full pipe.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from pdserve.procs import free_ports

log = logging.getLogger(__name__)
READY_MARKER = "pdserve is ready"


class LaunchFailed(RuntimeError):
    """`pdserve up` exited or did not become ready in time (the message has its log tail)."""


def free_port() -> int:
    """A loopback TCP port free right now (``pdserve.procs.free_ports``)."""
    return free_ports(1)[0]


@dataclass(slots=True)
class UpProcess:
    """One `pdserve up` child. Use as a context manager: start on enter, stop on exit."""

    argv: list[str]
    log_path: Path
    ready_timeout_s: float = 600.0
    stop_grace_s: float = 30.0
    env: dict[str, str] | None = None
    proc: subprocess.Popen[bytes] | None = None
    _ready: threading.Event = field(default_factory=threading.Event)
    _reader: threading.Thread | None = None

    def __enter__(self) -> UpProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        """Start and wait until ready; LaunchFailed (after stopping it) if it exits or the
        deadline passes first."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("starting: %s", " ".join(self.argv))
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: we stop everything it starts
            env=self.env,
        )
        assert self.proc.stdout is not None
        self._reader = threading.Thread(target=self._pump, args=(self.proc.stdout,), daemon=True)
        self._reader.start()
        try:
            self._wait_ready(self.proc)
        except BaseException:
            # Not ready, or interrupted (Ctrl-C/SIGTERM) while waiting: `with` will not
            # call __exit__ for a failed __enter__, so stop the group here.
            self.stop()
            raise

    def _wait_ready(self, proc: subprocess.Popen[bytes]) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while not self._ready.wait(0.2):
            if proc.poll() is not None:
                if self._reader is not None:
                    self._reader.join(timeout=5.0)
                if self._ready.is_set():
                    break
                raise LaunchFailed(
                    f"pdserve up exited with status {proc.returncode} before it was "
                    f"ready; last lines of {self.log_path}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                raise LaunchFailed(
                    f"pdserve up not ready within {self.ready_timeout_s:.0f} s; last lines of "
                    f"{self.log_path}:\n{self.log_tail()}"
                )
        if proc.poll() is not None:
            raise LaunchFailed(f"pdserve up exited right after becoming ready:\n{self.log_tail()}")

    def _pump(self, stream: IO[bytes]) -> None:
        with self.log_path.open("ab") as out:
            for raw in iter(stream.readline, b""):
                out.write(raw)
                out.flush()
                if READY_MARKER in raw.decode("utf-8", "replace"):
                    self._ready.set()

    def stop(self) -> None:
        """SIGTERM the process group, SIGKILL it after the grace period. Idempotent."""
        proc = self.proc
        if proc is None:
            return
        self._signal(signal.SIGTERM)
        try:
            proc.wait(timeout=self.stop_grace_s)
        except subprocess.TimeoutExpired:
            log.warning("pdserve up did not stop within %.0f s; killing it", self.stop_grace_s)
        # Kill the group even after a clean exit, so no grandchild outlives the point.
        self._signal(signal.SIGKILL)
        proc.wait()
        if self._reader is not None:
            self._reader.join(timeout=5.0)

    def _signal(self, signum: int) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signum)

    def log_tail(self, lines: int = 30) -> str:
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])
