"""Real servers for tests and benchmarks: ``redis-server`` and ``lmcache_server`` on free
127.0.0.1 ports, each started with a readiness deadline and always stopped (terminate,
then kill). A missing binary raises ``RuntimeError`` with the install hint — a failing
test, never a silent skip."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from pdserve.procs import free_ports


def free_port() -> int:
    """A loopback TCP port free right now (``pdserve.procs.free_ports``)."""
    return free_ports(1)[0]


def _find(binary: str, hint: str) -> str:
    here = Path(sys.executable).parent / binary
    path = str(here) if here.exists() else shutil.which(binary)
    if not path:
        raise RuntimeError(f"{binary} not found on PATH or next to {sys.executable}; {hint}")
    return path


def _wait_ready(
    proc: subprocess.Popen[bytes], port: int, deadline_s: float, ping: bytes | None
) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"server on port {port} exited early with code {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
                if ping is None:
                    return
                s.settimeout(0.5)
                s.sendall(ping)
                if s.recv(16).startswith(b"+PONG"):
                    return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"server on port {port} not ready within {deadline_s:.0f} s")


class ManagedServer:
    """One child server process; ``stop()`` is idempotent, ``restart()`` reuses the port."""

    def __init__(
        self,
        argv: list[str],
        port: int,
        ready_s: float,
        ping: bytes | None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.argv, self.port, self.ready_s, self.ping, self.env = argv, port, ready_s, ping, env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=self.env,
        )
        try:
            _wait_ready(self.proc, self.port, self.ready_s, self.ping)
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGCONT)  # in case a test paused it
        self.proc.terminate()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)

    def restart(self) -> None:
        self.stop()
        self.start()


def start_redis(port: int | None = None) -> tuple[ManagedServer, str]:
    """A started ``redis-server`` (no persistence) and its URL."""
    binary = _find(
        "redis-server", "install it: apt-get install -y --no-install-recommends redis-server"
    )
    port = port or free_port()
    workdir = tempfile.mkdtemp(prefix="pdserve-redis-")
    argv = [
        binary,
        "--port",
        str(port),
        "--bind",
        "127.0.0.1",
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        workdir,
        "--protected-mode",
        "yes",
        "--loglevel",
        "warning",
    ]
    srv = ManagedServer(argv, port, 15.0, b"*1\r\n$4\r\nPING\r\n")
    srv.start()
    return srv, f"redis://127.0.0.1:{port}"


def start_lmcache(port: int | None = None) -> tuple[ManagedServer, str]:
    """A started ``lmcache_server`` and its ``lm://`` URL."""
    binary = _find("lmcache_server", "install the lmcache extra: pip install 'pdserve[lmcache]'")
    port = port or free_port()
    env = dict(os.environ, LMCACHE_TRACK_USAGE="false", DO_NOT_TRACK="1", PYTHONHASHSEED="0")
    # Importing lmcache takes several seconds, more on a loaded 2-core machine.
    srv = ManagedServer([binary, "127.0.0.1", str(port)], port, 90.0, None, env)
    srv.start()
    return srv, f"lm://127.0.0.1:{port}"


@contextlib.contextmanager
def running(kind: str) -> Iterator[tuple[ManagedServer, str]]:
    """``with running("redis") as (server, url): ...`` — stopped on exit."""
    srv, url = start_redis() if kind == "redis" else start_lmcache()
    try:
        yield srv, url
    finally:
        srv.stop()
