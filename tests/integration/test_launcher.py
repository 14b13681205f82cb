"""`pdserve up` as a real process tree: ready, serves over HTTP, leaves nothing behind."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest

from pdserve.procs import free_ports
from pdserve_api.v1 import pdserve_pb2 as pb
from pdserve_api.v1 import pdserve_pb2_grpc as pb_grpc
from tests.integration.up_support import READY_TIMEOUT_S, SMALL, UpProcess, alive, descendants
from tests.service_fixtures import REPO, child_env


def test_up_serves_a_completion_and_leaves_no_process(tmp_path: Path, tiny_model_dir: Path) -> None:
    import openai

    (port,) = free_ports(1)
    up = UpProcess(tmp_path, "--model", str(tiny_model_dir), "--port", str(port), *SMALL)
    try:
        up.wait_for("pdserve is ready", READY_TIMEOUT_S)
        children = descendants(up.proc.pid)
        assert len(children) >= 3, f"expected router + prefill + decode, got {children}"
        workdir = re.search(r"logs in (\S+)/logs", up.output())
        assert workdir, up.output()

        client = openai.OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", timeout=60, max_retries=0
        )
        reply = client.completions.create(
            model=str(tiny_model_dir),
            prompt="The capital of France is",
            max_tokens=5,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert reply.usage is not None and reply.usage.completion_tokens == 5
        assert reply.choices[0].finish_reason == "length" and reply.choices[0].text
        # The run's services take calls only from its router (a token per run).
        (decode_port,) = [
            argv[argv.index(b"--port") + 1].decode()
            for argv in (Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") for pid in children)
            if b"decode" in argv
        ]
        address = f"127.0.0.1:{decode_port}"
        with grpc.insecure_channel(address) as channel, pytest.raises(grpc.RpcError) as info:
            pb_grpc.DecodeServiceStub(channel).GetLoad(pb.GetLoadRequest(), timeout=30)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED

        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(timeout=90) == 0, up.output()
        deadline = time.monotonic() + 10  # reparented orphans would show up here
        while any(alive(pid) for pid in children) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [pid for pid in children if alive(pid)], "children outlived pdserve up"
        assert not Path(workdir.group(1)).exists(), "the temporary KV/log directory was not removed"
    finally:
        up.kill_tree()


def test_up_names_a_child_that_dies_at_startup(tmp_path: Path, tiny_model_dir: Path) -> None:
    """The engines read PDSERVE_BLOCK_SIZE (an env twin that ``pdserve up`` does not
    forward, so it cannot refuse it first); a block size that is not a power of two kills
    them at startup."""
    (port,) = free_ports(1)
    bad = {"PDSERVE_BLOCK_SIZE": "24"}
    up = UpProcess(tmp_path, "--model", str(tiny_model_dir), "--port", str(port), *SMALL, env=bad)
    try:
        status = up.proc.wait(timeout=READY_TIMEOUT_S)
        out = up.output()
        assert status == 1, out
        assert re.search(r"(prefill|decode)-0 exited with status \d+ during startup", out), out
        assert "block_size must be a power of two" in out, "the log tail with the cause is missing"
        assert "pdserve is ready" not in out
        assert not descendants(up.proc.pid)
    finally:
        up.kill_tree()


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (("--mode", "disaggregated", "--prefill", "0"), "needs --prefill >= 1"),
        (("--mode", "colocated", "--prefill", "1"), "--prefill 0"),
        (("--decode", "0"), "--decode"),
    ],
)
def test_up_rejects_impossible_layouts(tmp_path: Path, args: tuple[str, ...], needle: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "pdserve", "up", "--model", str(tmp_path), *args],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    assert needle in result.stderr


def test_up_colocated_replicas(tmp_path: Path, tiny_model_dir: Path) -> None:
    """`--mode colocated --prefill 0 --decode 2`: two decode replicas, no prefill, no
    store; `--api-key` reaches the router (by environment) and guards it."""
    import openai

    (port,) = free_ports(1)
    args = (
        "--model",
        str(tiny_model_dir),
        "--port",
        str(port),
        "--mode",
        "colocated",
        "--prefill",
        "0",
        "--decode",
        "2",
    )
    up = UpProcess(tmp_path, *args, "--api-key", "sesame", *SMALL)
    try:
        up.wait_for("pdserve is ready", READY_TIMEOUT_S)
        logs = Path(re.search(r"logs in (\S+)", up.output()).group(1))  # type: ignore[union-attr]
        assert sorted(p.name for p in logs.iterdir()) == [
            "decode-0.log",
            "decode-1.log",
            "router.log",
        ]
        base_url = f"http://127.0.0.1:{port}/v1"
        # The key reaches the router by environment, never on a command line.
        for pid in descendants(up.proc.pid):
            assert b"sesame" not in Path(f"/proc/{pid}/cmdline").read_bytes()
        wrong = openai.OpenAI(base_url=base_url, api_key="wrong", timeout=60, max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        assert httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).status_code == 401
        assert "instances" not in httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).text
        client = openai.OpenAI(base_url=base_url, api_key="sesame", timeout=60, max_retries=0)
        texts = {
            client.completions.create(
                model=str(tiny_model_dir),
                prompt="Hello",
                max_tokens=4,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .text
            for _ in range(3)
        }
        assert len(texts) == 1 and texts.pop(), "greedy replies differ between replicas"
        up.proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert up.proc.wait(timeout=90) == 0, up.output()
        assert not descendants(up.proc.pid)
    finally:
        up.kill_tree()
