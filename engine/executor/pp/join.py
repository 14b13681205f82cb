"""Pipeline stages on other hosts (docs/design.md §3, "Pipeline parallelism across hosts";
docs/kubernetes.md, "Pipeline parallelism"): one pod per stage.

With ``pipeline_leader`` HOST:PORT the engine process (stage 0, TP rank 0: the leader)
starts only its own stage's processes and listens on PORT; every process of the other
stages is started on its own host (``join_stage``: ``pdserve prefill|decode`` with
``--pipeline-stage`` k > 0) and dials HOST:PORT until the leader answers (pods start in
any order). It sends one JSON line saying which process of the grid it is (``stage``,
``tp_rank``, ``pid``) and reads back the settings line a local worker reads on its stdin
(``MultiprocExecutor._spec``). From then on the connection *is* that process's stdin:
step headers, step inputs and KV messages, in order, and EOF when the leader stops. The
leader's store and every process's gloo groups bind on the address their peers reach them
at (the local end of the route to the leader), and hidden states then go between the
hosts as between local processes.

A joined stage's TP rank 0 (the pod's service process) starts the stage's other TP ranks
on its host, and each dials the leader itself. Failure is the local workers': a joined process whose connection closes has exited
(``RemoteWorker.poll``), which fails the leader's step with the grid's error; the leader
exits, and every joined process sees EOF (or a failed receive) and exits too, so the group
restarts as a whole. Every wait has a deadline: dialing and the rendezvous
``startup_timeout``, the steps ``distributed_timeout``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from engine.config import EngineConfig
from engine.config.pipeline import parse_leader
from engine.distributed.tp_group import startup_timeout, use_gloo_host
from engine.executor.pp.executor import PipelineExecutor
from engine.executor.tp.procs import device_for_rank, stop_workers
from engine.executor.tp.worker import _watch_parent, exit_with
from engine.models import ModelArgs

logger = logging.getLogger(__name__)

_DIAL_EVERY_S = 0.5


def local_address_towards(host: str, port: int) -> str:
    """This host's address on the route to ``host`` (no packet is sent): the one peers
    on that network reach it at."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.connect(addr)
        return str(probe.getsockname()[0])


class _SocketStdin:
    """The write end ``stop_workers`` and ``write_all`` use: ``fileno`` and ``close``."""

    def __init__(self, conn: socket.socket) -> None:
        self._conn = conn
        self.closed = False

    def fileno(self) -> int:
        return self._conn.fileno()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(OSError):  # already gone
                self._conn.shutdown(socket.SHUT_WR)  # EOF: the joined process exits


class RemoteWorker:
    """A joined process as the executor sees its local workers (a ``Popen``'s ``pid``,
    ``stdin``, ``poll``, ``wait``, ``kill``): it has exited once its connection closes
    (it never writes on it: its replies go through the store and the groups)."""

    def __init__(self, conn: socket.socket, pid: int) -> None:
        conn.setblocking(False)  # write_all bounds each wait for room; poll never waits
        self._conn = conn
        self.pid = pid  # on its own host
        self.returncode: int | None = None
        self.stdin = _SocketStdin(conn)

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                data = self._conn.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except (BlockingIOError, TimeoutError):  # nothing to read: still there
                return None
            except OSError:
                data = b""
            if not data:
                self.returncode = 1  # the connection is gone: so is the process
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"joined pid {self.pid}", timeout or 0.0)
            time.sleep(0.02)
        return code

    def kill(self) -> None:
        self._conn.close()
        if self.returncode is None:
            self.returncode = -9


class Rendezvous:
    """The leader's listening port: hands out the connection of each grid process that
    dialed it, in whatever order they came."""

    def __init__(self, port: int, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        if socket.has_dualstack_ipv6():
            self._sock = socket.create_server(
                ("", port), family=socket.AF_INET6, dualstack_ipv6=True
            )
        else:
            self._sock = socket.create_server(("", port))
        self._waiting: dict[tuple[int, int], tuple[socket.socket, dict[str, Any]]] = {}

    def take(self, stage: int, tp_rank: int) -> tuple[socket.socket, dict[str, Any]]:
        """The connection and hello of (``stage``, ``tp_rank``); ``TimeoutError`` when it
        has not dialed within the start-up deadline."""
        deadline = time.monotonic() + self.timeout_s
        while (stage, tp_rank) not in self._waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"pipeline stage {stage} (TP rank {tp_rank}) did not join within "
                    f"{self.timeout_s:g} s"
                )
            self._sock.settimeout(left)
            try:
                conn, peer = self._sock.accept()
            except TimeoutError:
                continue
            try:
                conn.settimeout(min(10.0, left))
                with conn.makefile("rb") as f:
                    hello = json.loads(f.readline())
                key = (int(hello["stage"]), int(hello["tp_rank"]))
            except (OSError, ValueError, KeyError, TypeError) as e:
                logger.warning("closed a pipeline connection from %s: bad hello (%s)", peer, e)
                conn.close()
                continue
            if key in self._waiting:
                logger.warning("stage %d rank %d dialed twice; keeping the first", *key)
                conn.close()
                continue
            self._waiting[key] = (conn, hello)
        return self._waiting.pop((stage, tp_rank))

    def close(self) -> None:
        self._sock.close()
        for conn, _ in self._waiting.values():
            conn.close()  # dialed, but not asked for (a wrong stage number)
        self._waiting.clear()


class LeaderPipelineExecutor(PipelineExecutor):
    """Stage 0 of a grid whose other stages join from other hosts."""

    def __init__(self, config: EngineConfig, args: ModelArgs, max_model_len: int) -> None:
        host, port = parse_leader(config.pipeline_leader)
        self._gloo_host = local_address_towards(host, port)
        use_gloo_host(self._gloo_host)  # stage 0's groups: where the other hosts reach it
        self._rendezvous = Rendezvous(port, startup_timeout(config.distributed_timeout))
        try:
            super().__init__(config, args, max_model_len)
        finally:
            self._rendezvous.close()  # the grid is complete (or failed): no later joins

    def local_size(self, config: EngineConfig) -> int:
        return config.tensor_parallel_size  # stage 0's processes only

    def _worker_spec(self, rank: int) -> dict[str, object]:
        return super()._worker_spec(rank) | {"gloo_host": self._gloo_host}

    def _spawn(
        self, config: EngineConfig, rank: int, max_model_len: int
    ) -> subprocess.Popen[bytes]:
        if rank < self.tp_size:  # stage 0's own TP ranks: processes on this host
            return super()._spawn(config, rank, max_model_len)
        conn, hello = self._rendezvous.take(rank // self.tp_size, rank % self.tp_size)
        spec = self._spec(config, rank, max_model_len)
        conn.settimeout(self.timeout_s)
        conn.sendall(json.dumps(spec).encode() + b"\n")
        logger.info("pipeline rank %d joined (pid %s)", rank, hello.get("pid"))
        return cast("subprocess.Popen[bytes]", RemoteWorker(conn, int(hello.get("pid", 0))))


def _dial(host: str, port: int, timeout_s: float) -> socket.socket:
    """Connect to the leader, retrying until ``timeout_s`` (its pod may not exist yet)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return socket.create_connection((host, port), timeout=_DIAL_EVERY_S * 4)
        except OSError as e:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"pipeline leader {host}:{port} not reachable within {timeout_s:g} s: {e}"
                ) from e
            time.sleep(_DIAL_EVERY_S)


def join_stage(
    config: EngineConfig, kv_host: str | None = None, on_ready: Callable[[], None] | None = None
) -> int:
    """Run stage ``config.pipeline_stage`` of the group led at ``config.pipeline_leader``
    until the leader ends it (returns 0) or it fails (raises): this process is the stage's
    TP rank 0 and starts ranks 1..N-1 here (``python -m engine.executor.pp.join``), each
    dialing the leader itself. ``kv_host``: where this host's p2p KV is pulled from (None:
    its address towards the leader). ``on_ready``: called once this process has joined
    the groups and built its part of the stage."""
    children = [_spawn_rank(config, r, kv_host) for r in range(1, config.tensor_parallel_size)]
    try:
        return _join(config, 0, kv_host, on_ready)
    finally:
        stop_workers(children, 5.0)


def _spawn_rank(config: EngineConfig, tp_rank: int, kv_host: str | None) -> subprocess.Popen[bytes]:
    spec = {
        "config": dataclasses.asdict(config),
        "tp_rank": tp_rank,
        "kv_host": kv_host,
        "parent_pid": os.getpid(),
    }
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[2])  # where `engine` imports from
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    proc = subprocess.Popen(
        [sys.executable, "-m", "engine.executor.pp.join"], stdin=subprocess.PIPE, env=env
    )
    assert proc.stdin is not None
    proc.stdin.write(json.dumps(spec).encode() + b"\n")
    proc.stdin.flush()
    return proc


def _join(
    config: EngineConfig, tp_rank: int, kv_host: str | None, on_ready: Callable[[], None] | None
) -> int:
    from engine.executor.pp.worker import run_worker

    host, port = parse_leader(config.pipeline_leader)
    conn = _dial(host, port, startup_timeout(config.distributed_timeout))
    hello = {"stage": config.pipeline_stage, "tp_rank": tp_rank, "pid": os.getpid()}
    conn.sendall(json.dumps(hello).encode() + b"\n")
    conn.settimeout(startup_timeout(config.distributed_timeout))  # the leader's start-up
    stream = conn.makefile("rb")
    line = stream.readline()
    if not line:
        raise ConnectionError(f"the pipeline leader {host}:{port} closed the connection")
    conn.settimeout(None)  # idle between steps, as a local worker on its stdin
    spec = json.loads(line)
    for name, mine in (
        ("pp_size", config.pipeline_parallel_size),
        ("tp_size", config.tensor_parallel_size),
    ):
        if int(spec[name]) != mine:
            raise ValueError(
                f"the leader's grid has {name} {spec[name]}, this stage {mine}: run every "
                "pod of the group with the same --pipeline-parallel-size and "
                "--tensor-parallel-size"
            )
    own = str(conn.getsockname()[0])
    spec["gloo_host"] = own  # this host's groups: where the others reach it
    spec["config"]["device"] = device_for_rank(config.device, tp_rank)  # this host's GPUs
    try:
        return run_worker(spec, stream, store_host=host, kv_host=kv_host or own, on_ready=on_ready)
    finally:
        stream.close()
        conn.close()


def main() -> int:
    """TP rank r > 0 of a joined stage, started by its rank 0 (``join_stage``)."""
    spec = json.loads(sys.stdin.buffer.readline())
    tp_rank = int(spec["tp_rank"])
    config = EngineConfig(**spec["config"])
    logging.basicConfig(
        level=logging.WARNING,
        format=f"[pp stage {config.pipeline_stage} rank {tp_rank}] %(levelname)s: %(message)s",
    )
    _watch_parent(int(spec["parent_pid"]))
    return _join(config, tp_rank, spec["kv_host"], None)


if __name__ == "__main__":
    exit_with(main, logger, "pipeline stage rank")
