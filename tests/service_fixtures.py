"""Start pdserve services and routers as real subprocesses for tests, and stop them after.

Plain helpers (usable from any fixture) plus a few fixtures:

- ``start_service(role, model_dir, log_dir, connector_args=..., extra_args=...)`` → ``ServiceProcess``
  (a prefill or decode gRPC service on free loopback ports, healthy when returned);
- ``start_router(model_dir, log_dir, prefill=[...], decode=[...], mode=..., extra_args=...)``
  → ``ServiceProcess`` with ``.url`` (``http://127.0.0.1:PORT``), healthy when returned;
- ``ServiceProcess.stop()`` sends SIGTERM to its process group and SIGKILL after a deadline;
- fixture ``process_stack``: a ``ProcessStack`` whose ``service(...)``/``router(...)`` start
  processes that are all stopped at the end of the test;
- fixture ``fs_kv_dir``: an empty directory for the fs connector;
- fixture ``pd_services`` (module scope): one prefill + one decode service sharing an fs
  store, on the tiny model (``tiny_model_dir``);
- ``check_engine_flag(...)``: an engine flag of a service reaches ``EngineConfig`` and is
  forwarded by ``pdserve up``.

Every wait has a deadline; a process that dies while starting fails the test with the tail
of its log. Processes get one torch thread each (the test machines are small and shared).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pdserve.procs import free_ports, grpc_probe, http_probe

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT_S = 180.0
STOP_TIMEOUT_S = 30.0
# Small engines: few sequences, a small KV pool, one thread.
SMALL_ENGINE_ARGS = ("--max-num-seqs", "8", "--kv-cache-memory", "32Mi", "--torch-threads", "1")


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a test child: repo importable, one thread, no telemetry."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
    env.update(
        PYTHONPATH=str(REPO) + os.pathsep + env.get("PYTHONPATH", ""),
        PYTHONUNBUFFERED="1",
        PYTHONHASHSEED="0",
        OMP_NUM_THREADS="1",
        TOKENIZERS_PARALLELISM="false",
        LMCACHE_TRACK_USAGE="false",
        DO_NOT_TRACK="1",
    )
    env.update(extra or {})
    return env


@dataclass(slots=True)
class ServiceProcess:
    """A started child: ``address`` is host:port (gRPC) or ``url`` the router's base URL."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    port: int
    metrics_port: int = 0
    argv: tuple[str, ...] = ()  # what started it (``restart`` runs it again)
    env: dict[str, str] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def metrics_url(self) -> str:
        return f"http://127.0.0.1:{self.metrics_port}/metrics"

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def signal(self, signum: int) -> None:
        """Signal the whole process group (the process and anything it started)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signum)

    def restart(self, timeout: float = START_TIMEOUT_S) -> None:
        """Stop it if it runs, then start the same command again (same ports) and wait
        until its gRPC health check passes (a service; not a router)."""
        self.stop()
        self.proc = spawn(self.name, self.argv, self.log_path.parent, self.env)
        wait_healthy(self, grpc_probe(self.address), timeout)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM, wait up to ``timeout``, then SIGKILL; returns the exit status."""
        self.terminate()
        return self.reap(timeout)

    def terminate(self) -> None:
        """Ask it to stop (SIGTERM), without waiting."""
        if self.proc.poll() is None:
            self.signal(signal.SIGCONT)  # a paused child would hold SIGTERM until the kill
            self.signal(signal.SIGTERM)

    def reap(self, timeout: float) -> int | None:
        """Wait up to ``timeout`` for it to exit, then SIGKILL the group (anything it
        started goes too); returns the exit status."""
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=max(0.0, timeout))
        self.signal(signal.SIGKILL)
        return self.proc.wait(timeout=10)


def spawn(
    name: str, argv: Sequence[str], log_dir: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in its own process group, output to ``log_dir/name.log``."""
    log_dir.mkdir(parents=True, exist_ok=True)
    with open(log_dir / f"{name}.log", "ab") as log:
        return subprocess.Popen(
            list(argv),
            cwd=REPO,
            env=child_env(env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def wait_healthy(child: ServiceProcess, probe: object, timeout: float = START_TIMEOUT_S) -> None:
    """Poll ``probe()`` until True; fail with the log tail if the child exits or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        status = child.proc.poll()
        if status is not None:
            raise RuntimeError(
                f"{child.name} exited with status {status} while starting:\n{child.log_tail()}"
            )
        if probe():  # type: ignore[operator]
            return
        if time.monotonic() > deadline:
            child.stop()
            raise TimeoutError(
                f"{child.name} not healthy within {timeout:.0f} s:\n{child.log_tail()}"
            )
        time.sleep(0.2)


# A child that lost its port to another process between ``free_ports`` and its own bind
# (the ports are free when picked, then released) is started again on new ports.
PORT_RACE_MARKS = ("cannot listen on", "Address already in use", "address already in use")
PORT_RACE_ATTEMPTS = 3


def _retry_port_race(start: Callable[[], ServiceProcess]) -> ServiceProcess:
    """``start()`` again (new ports) when it failed only because its port was taken."""
    for attempt in range(PORT_RACE_ATTEMPTS):
        try:
            return start()
        except RuntimeError as exc:
            lost_port = any(mark in str(exc) for mark in PORT_RACE_MARKS)
            if not lost_port or attempt == PORT_RACE_ATTEMPTS - 1:
                raise
    raise AssertionError("unreachable")


def start_service(
    role: str,
    model_dir: str | Path,
    log_dir: Path,
    *,
    connector_args: Sequence[str] = (),
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    name: str | None = None,
    timeout: float = START_TIMEOUT_S,
) -> ServiceProcess:
    """A ``prefill`` or ``decode`` service on free ports, SERVING when this returns."""
    assert role in ("prefill", "decode"), role
    return _retry_port_race(
        lambda: _start_service_once(
            role, model_dir, log_dir, connector_args, extra_args, env, name, timeout
        )
    )


def _start_service_once(
    role: str,
    model_dir: str | Path,
    log_dir: Path,
    connector_args: Sequence[str],
    extra_args: Sequence[str],
    env: dict[str, str] | None,
    name: str | None,
    timeout: float,
) -> ServiceProcess:
    port, metrics_port = free_ports(2)
    name = name or f"{role}-{port}"
    argv = [
        sys.executable,
        "-m",
        "service",
        role,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--metrics-port",
        str(metrics_port),
        "--model",
        str(model_dir),
        *SMALL_ENGINE_ARGS,
        *connector_args,
        *extra_args,
    ]
    child = ServiceProcess(
        name,
        spawn(name, argv, log_dir, env),
        log_dir / f"{name}.log",
        port,
        metrics_port,
        tuple(argv),
        env,
    )
    try:
        wait_healthy(child, grpc_probe(child.address), timeout)
    except BaseException:
        child.stop()
        raise
    return child


def start_router(
    model_dir: str | Path,
    log_dir: Path,
    *,
    prefill: Sequence[ServiceProcess] = (),
    decode: Sequence[ServiceProcess] = (),
    mode: str = "disaggregated",
    extra_args: Sequence[str] = (),
    env: dict[str, str] | None = None,
    timeout: float = START_TIMEOUT_S,
) -> ServiceProcess:
    """The router (``pdserve router``) on a free port over the given services, healthy when returned."""
    return _retry_port_race(
        lambda: _start_router_once(
            model_dir, log_dir, prefill, decode, mode, extra_args, env, timeout
        )
    )


def _start_router_once(
    model_dir: str | Path,
    log_dir: Path,
    prefill: Sequence[ServiceProcess],
    decode: Sequence[ServiceProcess],
    mode: str,
    extra_args: Sequence[str],
    env: dict[str, str] | None,
    timeout: float,
) -> ServiceProcess:
    (port,) = free_ports(1)
    name = f"router-{port}"
    if not any(arg.startswith("--max-local-prefill-tokens") for arg in extra_args):
        # Tests of the remote path send prompts that share a prefix with earlier ones;
        # the router's default would let the decode compute their short rest itself. A
        # test of that path (tests/e2e/test_router_local_suffix.py) passes its own value.
        extra_args = [*extra_args, "--max-local-prefill-tokens", "0"]
    argv = [
        sys.executable,
        "-m",
        "pdserve",
        "router",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--model",
        str(model_dir),
        "--mode",
        mode,
        "--prefill-urls",
        ",".join(p.address for p in prefill),
        "--decode-urls",
        ",".join(d.address for d in decode),
        *extra_args,
    ]
    child = ServiceProcess(name, spawn(name, argv, log_dir, env), log_dir / f"{name}.log", port)
    try:
        wait_healthy(child, http_probe(f"{child.url}/health"), timeout)
    except BaseException:
        child.stop()
        raise
    return child


@dataclass(slots=True)
class ProcessStack:
    """Processes started through it are stopped (all at once) by ``close()``."""

    log_dir: Path
    model_dir: Path
    children: list[ServiceProcess] = field(default_factory=list)

    def service(self, role: str, **kwargs: object) -> ServiceProcess:
        child = start_service(role, self.model_dir, self.log_dir, **kwargs)  # type: ignore[arg-type]
        self.children.append(child)
        return child

    def router(self, **kwargs: object) -> ServiceProcess:
        child = start_router(self.model_dir, self.log_dir, **kwargs)  # type: ignore[arg-type]
        self.children.append(child)
        return child

    def together(self, *starts: Callable[[], ServiceProcess]) -> list[ServiceProcess]:
        """Run several ``service``/``router`` starts at once and wait for all of them: a
        process's start is mostly its own imports and model load, which overlap. Every
        started process is in ``children`` (so ``close()`` stops it) even if another failed;
        the first failure is raised once all have finished."""
        with ThreadPoolExecutor(len(starts)) as pool:
            futures = [pool.submit(start) for start in starts]
        return [f.result() for f in futures]

    def close(self) -> None:
        """Stop every child at once: SIGTERM to all, then wait for each (a drain is mostly
        waiting, and one after the other cost seconds per test teardown)."""
        children, self.children = self.children, []
        for child in children:
            child.terminate()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in children:
            child.reap(deadline - time.monotonic())


@pytest.fixture
def fs_kv_dir(tmp_path: Path) -> Path:
    path = tmp_path / "kv"
    path.mkdir()
    return path


@pytest.fixture
def process_stack(tmp_path: Path, tiny_model_dir: Path) -> Iterator[ProcessStack]:
    stack = ProcessStack(tmp_path / "logs", tiny_model_dir)
    try:
        yield stack
    finally:
        stack.close()


@dataclass(slots=True)
class PDServices:
    prefill: ServiceProcess
    decode: ServiceProcess
    kv_dir: Path


@pytest.fixture(scope="module")
def pd_services(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[PDServices]:
    """One prefill and one decode service on the tiny model, sharing an fs store."""
    root = tmp_path_factory.mktemp("pd_services")
    kv_dir = root / "kv"
    kv_dir.mkdir()
    stack = ProcessStack(root / "logs", tiny_model_dir)
    connector = ("--connector", "fs", "--kv-path", str(kv_dir))
    try:
        prefill = stack.service("prefill", connector_args=connector)
        decode = stack.service("decode", connector_args=connector)
        yield PDServices(prefill, decode, kv_dir)
    finally:
        stack.close()
