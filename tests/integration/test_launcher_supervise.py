"""`pdserve up` supervises: a child killed after startup is restarted on the same ports
while the router serves through the others; a crash loop ends the run with exit 1; a
`pdserve up` killed with SIGKILL takes its children along and the next run removes its
temporary directory."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from pdserve.procs import free_ports
from tests.integration.up_support import (
    READY_TIMEOUT_S,
    SMALL,
    UpProcess,
    alive,
    descendants,
    kill_and_take_port,
    read_status,
    workdir_of,
)
from tests.service_fixtures import REPO, child_env

RESTART_TIMEOUT_S = 180.0
PROMPT = "The capital of France is"


def _complete(client: object, model: str) -> str:
    reply = client.completions.create(  # type: ignore[attr-defined]
        model=model, prompt=PROMPT, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    assert reply.choices[0].finish_reason == "length"
    return str(reply.choices[0].text)


def test_killed_decode_is_restarted_while_requests_keep_succeeding(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    import openai

    (port,) = free_ports(1)
    model = str(tiny_model_dir)
    up = UpProcess(
        tmp_path, "--model", model, "--port", str(port), "--prefill", "1", "--decode", "2", *SMALL
    )
    try:
        up.wait_for("pdserve is ready", READY_TIMEOUT_S)
        workdir = workdir_of(up)
        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=60, max_retries=0
        )
        expected = _complete(client, model)
        before = read_status(workdir)["decode-0"]
        assert before["restarts"] == 0 and before["state"] == "running", before

        # Requests run back to back from another thread through the kill and the restart.
        texts: list[str] = []
        errors: list[BaseException] = []
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set():
                try:
                    texts.append(_complete(client, model))
                except BaseException as exc:  # noqa: BLE001 - reported by the test below
                    errors.append(exc)

        worker = threading.Thread(target=load, daemon=True)
        worker.start()
        os.kill(before["pid"], signal.SIGKILL)

        deadline = time.monotonic() + RESTART_TIMEOUT_S
        while True:
            now = read_status(workdir)["decode-0"]
            if now["state"] == "running" and now["restarts"] == 1:
                break
            assert up.proc.poll() is None, up.output()
            assert time.monotonic() < deadline, f"decode-0 not back: {now}\n{up.output()}"
            time.sleep(0.2)
        assert now["pid"] != before["pid"] and now["last_exit"] == -signal.SIGKILL
        # The router puts the instance back once its health check passes again.
        while True:
            health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).json()
            if health["decode"]["healthy"] == 2:
                break
            assert time.monotonic() < deadline, f"router never took decode-0 back: {health}"
            time.sleep(0.5)
        stop.set()
        worker.join(timeout=120)
        assert not worker.is_alive()
        assert not errors, errors
        assert texts and set(texts) == {expected}, "a greedy answer changed across the restart"
        out = up.output()
        assert "decode-0 exited with status -9; restarting it in 0.5 s" in out, out
        assert "decode-0 is healthy again (restarts: 1)" in out, out
        assert "restart 1 of decode-0" in (workdir / "logs" / "decode-0.log").read_text()

        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(timeout=90) == 0, up.output()
    finally:
        up.kill_tree()


def test_crash_loop_stops_everything_with_exit_1(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The private redis-server is killed and its port taken: every restart exits at once."""
    (port,) = free_ports(1)
    up = UpProcess(
        tmp_path,
        *("--model", str(tiny_model_dir), "--port", str(port), "--connector", "redis"),
        *("--max-restarts", "3", *SMALL),
    )
    holder: socket.socket | None = None
    try:
        up.wait_for("pdserve is ready", READY_TIMEOUT_S)
        children = descendants(up.proc.pid)
        redis = read_status(workdir_of(up))["redis"]
        # redis-server retitles itself "redis-server 127.0.0.1:PORT"
        title = Path(f"/proc/{redis['pid']}/cmdline").read_text()
        found = re.search(r"127\.0\.0\.1:(\d+)", title)
        assert found, title
        redis_port = int(found.group(1))
        holder = kill_and_take_port(up.proc.pid, redis["pid"], redis_port)

        status = up.proc.wait(timeout=RESTART_TIMEOUT_S)
        out = up.output()
        assert status == 1, out
        assert "redis is crash-looping" in out and "after 3 restarts within 60 s" in out, out
        assert "Address already in use" in out, "the log tail with the cause is missing"
        deadline = time.monotonic() + 30
        while any(alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in children if alive(pid)], "children outlived pdserve up"
    finally:
        if holder is not None:
            holder.close()
        up.kill_tree()


def test_sigkilled_up_takes_children_along_and_next_run_cleans(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    (port,) = free_ports(1)
    colocated = ("--mode", "colocated", "--prefill", "0", "--decode", "1")
    up = UpProcess(
        tmp_path,
        *("--model", str(tiny_model_dir), "--port", str(port), *colocated, *SMALL),
        env={"TMPDIR": str(tmp)},
    )
    try:
        up.wait_for("pdserve is ready", READY_TIMEOUT_S)
        workdir = workdir_of(up)
        assert workdir.parent == tmp
        children = descendants(up.proc.pid)
        up.proc.kill()
        up.proc.wait(timeout=10)
        deadline = time.monotonic() + 60  # the kernel sends SIGTERM; services drain quickly
        while any(alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in children if alive(pid)], "children outlived pdserve up"
        assert workdir.exists(), "SIGKILL cannot clean up; the next run must"

        # Any next `pdserve up` removes it first, even one that then refuses its flags.
        result = subprocess.run(
            [sys.executable, "-m", "pdserve", "up", "--mode", "colocated", "--prefill", "1"],
            cwd=REPO,
            env=child_env({"TMPDIR": str(tmp)}),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 1, result.stderr
        assert not workdir.exists(), "the stale directory of the killed run is still there"
    finally:
        up.kill_tree()
