"""Child processes of `pdserve up`: start each in its own process group with its output in
a log file, probe health (gRPC health check, HTTP, TCP), and stop them all
(SIGTERM to each group, SIGKILL after a grace period). The kernel also signals the children
if the launcher itself is killed (PR_SET_PDEATHSIG), so nothing is left behind.

Torch-free.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.parent_death import die_with_parent

logger = logging.getLogger(__name__)

Probe = Callable[[], bool]


class LaunchError(RuntimeError):
    """A part of the system could not be started (message names it)."""


class Interrupted(LaunchError):
    """Ctrl-C or SIGTERM arrived before the system was ready."""


@dataclass(slots=True)
class Child:
    """One child process: its own process group, output to ``log_path``, a health probe."""

    name: str
    argv: list[str]
    log_path: Path
    probe: Probe
    proc: subprocess.Popen[bytes] | None = None
    env_extra: dict[str, str] = field(default_factory=dict)  # e.g. this engine's GPU
    # Stricter than ``probe`` for the first start only (the router: it also sees every
    # service); later the supervisor asks ``probe``, as a given-up service may stay gone.
    startup_probe: Probe | None = None

    def start(self, env: dict[str, str]) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**env, **self.env_extra},
                start_new_session=True,
                preexec_fn=functools.partial(die_with_parent, os.getpid()),  # SIGTERM
            )

    def exited(self) -> int | None:
        """The exit status if the process has ended, else None."""
        return None if self.proc is None else self.proc.poll()

    def signal_group(self, signum: int) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signum)

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


# Ports are picked below the kernel's ephemeral range when there is room: a port picked
# here is released until its owner binds it, and meanwhile any bind(0) or outgoing
# connection (a tensor-parallel store, gloo, a client socket) could be handed the same
# ephemeral port. Below the range only another picker can collide.
_PICK_FLOOR = 10_000
_PICK_TRIES = 64


def _ephemeral_low(path: str = "/proc/sys/net/ipv4/ip_local_port_range") -> int:
    """The low end of the kernel's ephemeral port range (0 when unknown)."""
    try:
        return int(Path(path).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _bind_loopback(port: int) -> socket.socket | None:
    sock = socket.socket()
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        return None
    return sock


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports free right now (held open together so they
    differ), outside the ephemeral range when it leaves room (see above)."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    socks: list[socket.socket] = []
    try:
        for _ in range(_PICK_TRIES if low > _PICK_FLOOR + 1000 else 0):
            if len(socks) == count:
                break
            sock = _bind_loopback(rng.randrange(_PICK_FLOOR, low))
            if sock is not None:
                socks.append(sock)
        while len(socks) < count:  # no room below the range, or it is crowded
            sock = _bind_loopback(0)
            if sock is None:
                raise OSError("no free loopback port")
            socks.append(sock)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def grpc_probe(address: str, tls: Any = None, server_name: str = "") -> Probe:
    """True once the service at ``address`` answers the standard health check with SERVING.
    Each probe uses its own short-lived channel, so nothing stays connected afterwards.
    ``tls`` (a ``common.grpc_tls.TlsFiles``): probe over mTLS with these credentials."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    def channel_to() -> Any:
        if tls is None:
            return grpc.insecure_channel(address)
        from common.grpc_tls import channel_options

        creds = tls.channel_credentials()
        return grpc.secure_channel(address, creds, options=channel_options(server_name))

    def probe() -> bool:
        with channel_to() as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
            except grpc.RpcError:
                return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)

    return probe


def http_probe(url: str) -> Probe:
    def probe() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=1.0) as reply:  # noqa: S310 - loopback URL we built
                return bool(reply.status == 200)
        except OSError:
            return False

    return probe


def router_probe(url: str, expected: dict[str, int]) -> Probe:
    """The router's ``/health`` is 200 and it sees at least ``expected[pool]`` healthy
    instances in each pool. Its own health check of a service lags the service's start;
    without this wait, `up` said ready while the router still routed around a pool it had
    not yet probed (a request then ran in degraded mode, docs/design.md §5)."""

    def probe() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=1.0) as reply:  # noqa: S310 - loopback URL we built
                if reply.status != 200:
                    return False
                body = json.loads(reply.read())
        except (OSError, ValueError):
            return False
        return all(
            int(body.get(pool, {}).get("healthy", 0)) >= count for pool, count in expected.items()
        )

    return probe


def tcp_probe(port: int, send: bytes = b"", expect: bytes = b"") -> Probe:
    def probe() -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0) as s:
                if send:
                    s.sendall(send)
                    return s.recv(64).startswith(expect)
                return True
        except OSError:
            return False

    return probe


@dataclass(slots=True)
class Launcher:
    """Builds, starts and stops the children of one `pdserve up` (restarts after startup:
    ``pdserve/supervise.py``)."""

    args: argparse.Namespace
    workdir: Path
    log_dir: Path
    children: list[Child] = field(default_factory=list)
    stop_requested: threading.Event = field(default_factory=threading.Event)
    # The services' ports and the router's instances file (``pdserve.instances``).
    instances: Any = None

    def python(self, *argv: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "pdserve",
            "--log-level",
            getattr(self.args, "log_level", "INFO"),
            *argv,
        ]

    def child_env(self, threads: int) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            PYTHONUNBUFFERED="1",
            PYTHONHASHSEED="0",  # LMCache hashes token chunks with hash(); every process must agree
            LMCACHE_TRACK_USAGE="false",
            DO_NOT_TRACK="1",
            TOKENIZERS_PARALLELISM="false",
            OMP_NUM_THREADS=str(threads),
            MKL_NUM_THREADS=str(threads),
        )
        return env

    def add(self, name: str, argv: list[str], probe: Probe) -> Child:
        child = Child(name, argv, self.log_dir / f"{name}.log", probe)
        self.children.append(child)
        return child

    def start(self, children: list[Child], env: dict[str, str]) -> None:
        for child in children:
            logger.debug("starting %s: %s", child.name, " ".join(child.argv))
            child.start(env)

    def wait_healthy(self, children: list[Child], deadline: float) -> None:
        """Poll until every child is healthy; LaunchError if one exits or time runs out."""
        pending = list(children)
        while pending:
            if self.stop_requested.is_set():
                raise Interrupted("interrupted during startup")
            for child in list(pending):
                status = child.exited()
                if status is not None:
                    raise LaunchError(
                        f"{child.name} exited with status {status} during startup; "
                        f"last lines of {child.log_path}:\n{child.log_tail()}"
                    )
                if (child.startup_probe or child.probe)():
                    logger.info("%s is healthy", child.name)
                    pending.remove(child)
            if pending and time.monotonic() > deadline:
                names = ", ".join(c.name for c in pending)
                tails = "\n".join(
                    f"--- {c.name} ({c.log_path}):\n{c.log_tail(10)}" for c in pending
                )
                raise LaunchError(
                    f"not healthy within {self.args.startup_timeout:.0f} s: {names}\n{tails}"
                )
            self.stop_requested.wait(0.25)

    def stop_all(self, grace: float) -> None:
        """SIGTERM every process group (router first, store last), SIGKILL what outlives ``grace``."""
        for child in reversed(self.children):
            child.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for child in reversed(self.children):
            if child.proc is None:
                continue
            try:
                child.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop within %.0f s; killing it", child.name, grace)
            # Kill the whole group even after a clean exit: grandchildren must not linger.
            child.signal_group(signal.SIGKILL)
            child.proc.wait()
