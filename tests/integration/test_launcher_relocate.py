"""`pdserve up` keeps the healthy parts serving (docs/design.md §5, "Supervision"), with a
real process tree: a killed decode whose port another process then takes is restarted on
new ports and the router follows it; a decode in a crash loop is stopped alone while the
prefill serves whole requests; a port whose last connections sit in TIME-WAIT is free.

The two `pdserve up` tests share one run (module fixture), in file order.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from pdserve.launcher import _check_port_free
from pdserve.procs import free_ports
from tests.integration.up_support import (
    READY_TIMEOUT_S,
    SMALL,
    UpProcess,
    kill_and_take_port,
    read_status,
    workdir_of,
)

DEADLINE_S = 180.0
PROMPT = "The capital of France is"


@dataclass
class Run:
    up: UpProcess
    port: int
    workdir: Path

    def health(self) -> dict:  # type: ignore[type-arg]
        return httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=10).json()  # type: ignore[no-any-return]

    def complete(self) -> str:
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{self.port}/v1", api_key="x", timeout=60, max_retries=0
        )
        reply = client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=6,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        return str(reply.choices[0].text)

    def wait(self, what: str, done: object) -> dict:  # type: ignore[type-arg]
        deadline = time.monotonic() + DEADLINE_S
        while True:
            status = read_status(self.workdir)
            if done(status):  # type: ignore[operator]
                return status
            assert self.up.proc.poll() is None, self.up.output()
            assert time.monotonic() < deadline, f"{what}: {status}\n{self.up.output()}"
            time.sleep(0.2)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Run]:
    tmp = tmp_path_factory.mktemp("relocate")
    (port,) = free_ports(1)
    up = UpProcess(
        tmp,
        *("--model", str(tiny_model_dir), "--served-model-name", "tiny", "--port", str(port)),
        *("--prefill", "1", "--decode", "1", "--max-restarts", "2", *SMALL),
    )
    try:
        up.wait_for("pdserve is ready", READY_TIMEOUT_S)
        yield Run(up, port, workdir_of(up))
    finally:
        up.kill_tree()


class Load:
    """Requests back to back from a thread; every answer must be ``expected``."""

    def __init__(self, run: Run) -> None:
        self.run, self.expected = run, run.complete()
        self.texts: list[str] = []
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.texts.append(self.run.complete())
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                self.errors.append(exc)

    def finish(self) -> None:
        self._stop.set()
        self._thread.join(timeout=120)
        assert not self._thread.is_alive()
        assert not self.errors, self.errors[:3]
        assert self.texts and set(self.texts) == {self.expected}


def test_restart_on_a_taken_port_moves_the_child_and_the_router_follows(run: Run) -> None:
    before = read_status(run.workdir)["decode-0"]
    old = before["address"]
    load = Load(run)
    # A restart that beat the squatter would take the old port and die on it (2 restarts).
    squatter = kill_and_take_port(run.up.proc.pid, before["pid"], int(old.rsplit(":", 1)[1]))
    try:
        now = run.wait(
            "decode-0 back on new ports",
            lambda s: s["decode-0"]["state"] == "running" and s["decode-0"]["restarts"] == 1,
        )["decode-0"]
        assert now["address"] != old
        deadline = time.monotonic() + DEADLINE_S
        while True:
            decode = run.health()["decode"]["instances"]
            if old not in decode and decode.get(now["address"], {}).get("healthy"):
                break
            assert time.monotonic() < deadline, f"the router never followed: {decode}"
            time.sleep(0.3)
        load.finish()
    finally:
        squatter.close()
    assert f"decode-0's port is taken; moving it to {now['address']}" in run.up.output()


def test_crash_looping_decode_stops_alone(run: Run) -> None:
    """Killed again and again, decode-0 exceeds --max-restarts 2: it stays stopped, the
    run goes on, the router reports the instance down, and the prefill serves requests."""
    load = Load(run)
    deadline = time.monotonic() + DEADLINE_S
    killed: set[int] = set()
    while (child := read_status(run.workdir)["decode-0"])["state"] != "failed":
        if child["pid"] not in killed and child["state"] in ("running", "starting"):
            os.kill(child["pid"], signal.SIGKILL)
            killed.add(child["pid"])
        assert run.up.proc.poll() is None, run.up.output()
        assert time.monotonic() < deadline, f"decode-0 never given up: {child}"
        time.sleep(0.1)
    deadline = time.monotonic() + DEADLINE_S
    while (health := run.health())["decode"]["instances"][child["address"]]["healthy"]:
        assert time.monotonic() < deadline, "the router never took decode-0 out"
        time.sleep(0.2)
    assert health["status"] == "ok"
    metrics = httpx.get(f"http://127.0.0.1:{run.port}/metrics", timeout=10).text
    assert f'pdserve_instance_healthy{{instance="{child["address"]}",pool="decode"}} 0.0' in metrics
    load.finish()
    assert run.up.proc.poll() is None
    assert "decode-0 is crash-looping" in run.up.output()
    assert read_status(run.workdir)["prefill-0"]["state"] == "running"


def test_port_in_time_wait_is_free_for_the_next_run() -> None:
    """A server that closed its side of a connection first leaves it in TIME-WAIT for 60 s;
    the next `pdserve up` on that port must start at once (servers bind with SO_REUSEADDR)."""
    (port,) = free_ports(1)
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", port))
    server.listen()
    client = socket.create_connection(("127.0.0.1", port), timeout=5)
    conn, _ = server.accept()
    conn.close()  # the server closes first: its side goes to TIME-WAIT
    client.recv(1)
    client.close()
    server.close()
    _check_port_free("127.0.0.1", port)  # LaunchError before the fix
