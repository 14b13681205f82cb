"""A tensor-parallel decode service (N = 2, CPU, gloo) whose worker rank dies takes itself
down cleanly (and a pipeline-parallel one, P = 2, whose stage-1 process dies): the next request fails with UNAVAILABLE (so the router fails over), health
stops answering SERVING, and the process exits non-zero so its supervisor starts a fresh
one — never a hang, never a half-alive instance."""

from __future__ import annotations

import os
import signal
import socket
import sys
from pathlib import Path

import grpc
import pytest

from pdserve.procs import free_ports
from pdserve_api.v1 import pdserve_pb2 as pb
from pdserve_api.v1 import pdserve_pb2_grpc as pb_grpc
from tests.service_fixtures import spawn, start_service

GREEDY = pb.SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _workers(pid: int, module: bytes) -> list[int]:
    """Processes under ``pid`` (its engine process's children, by default) that run the
    worker ``module``."""
    children: dict[int, list[int]] = {}
    cmdlines: dict[int, bytes] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdlines[int(entry)] = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    found, todo = [], list(children.get(pid, []))
    while todo:
        child = todo.pop()
        if module in cmdlines.get(child, b""):
            found.append(child)
        todo += children.get(child, [])
    return found


def _decode(stub: pb_grpc.DecodeServiceStub, request_id: str) -> list[int]:
    request = pb.DecodeRequest(
        request_id=request_id, prompt_token_ids=[5, 6, 7, 8, 9], params=GREEDY
    )
    return [t for chunk in stub.Decode(request, timeout=60) for t in chunk.token_ids]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("flag", "module"),
    [
        ("--tensor-parallel-size", b"engine.executor.tp.worker"),
        ("--pipeline-parallel-size", b"engine.executor.pp.worker"),
    ],
    ids=["tp", "pp"],
)
def test_a_dead_rank_takes_the_service_down(
    tmp_path: Path, tiny_model_dir: Path, flag: str, module: bytes
) -> None:
    service = start_service("decode", tiny_model_dir, tmp_path / "logs", extra_args=[flag, "2"])
    try:
        workers = _workers(service.proc.pid, module)
        assert len(workers) == 1, f"expected one worker rank, found {workers}"
        with grpc.insecure_channel(service.address) as channel:
            stub = pb_grpc.DecodeServiceStub(channel)
            assert len(_decode(stub, "before")) == 6
            os.kill(workers[0], signal.SIGKILL)
            with pytest.raises(grpc.RpcError) as failed:
                _decode(stub, "after")
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()
        status = service.proc.wait(timeout=120)  # guarded by the test timeout too
        assert status == 1, f"service exited {status}:\n{service.log_tail()}"
        assert "engine died" in service.log_tail(80)
    finally:
        service.stop()


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("flag", "says"),
    [("--port", "cannot listen on"), ("--metrics-port", "cannot serve metrics on")],
)
def test_a_taken_port_fails_at_once_before_the_model_loads(
    tmp_path: Path, tiny_model_dir: Path, flag: str, says: str
) -> None:
    """The service claims its ports before the engine starts (the tensor-parallel store and
    gloo bind ephemeral loopback ports that could otherwise take the service's own port): a
    port already in use is one clear line and exit status 2, and no model is loaded first."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    (free,) = free_ports(1)
    ports = {"--port": free, "--metrics-port": free}
    ports[flag] = taken
    try:
        argv = [
            *(sys.executable, "-m", "service", "decode", "--host", "127.0.0.1"),
            *("--port", str(ports["--port"]), "--metrics-port", str(ports["--metrics-port"])),
            *("--model", str(tiny_model_dir), "--tensor-parallel-size", "2"),
        ]
        proc = spawn("taken-port", argv, tmp_path)
        try:
            status = proc.wait(timeout=90)
        finally:
            if proc.poll() is None:
                proc.kill()
        log = (tmp_path / "taken-port.log").read_text()
        assert status == 2, log
        assert f"{says} 127.0.0.1:{taken}" in log and "cannot start" in log, log
        assert "KV cache:" not in log and "tensor parallel" not in log, "the engine loaded first"
        assert "Traceback" not in log, log
    finally:
        holder.close()
