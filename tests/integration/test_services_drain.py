"""Graceful drain on SIGTERM, against a real decode service process.

Health goes SERVING → NOT_SERVING, new requests get UNAVAILABLE, the stream already in
flight completes with every token, and the process then exits 0 on its own.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pdserve_api.v1 import pdserve_pb2 as pb
from pdserve_api.v1 import pdserve_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from tests.service_fixtures import ProcessStack


SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def _status(stub: health_pb2_grpc.HealthStub, service: str = "") -> int:
    return int(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=10).status)


@pytest.mark.parametrize("engine_process", ["off", "on"], ids=["engine-thread", "engine-process"])
def test_sigterm_drains_in_flight_stream_and_refuses_new(
    process_stack: ProcessStack, engine_process: str
) -> None:
    """SIGTERM goes to the whole process group, as `pdserve up` and a terminal send it: an
    engine in a process of its own ignores it and finishes the drain with the service."""
    svc = process_stack.service(
        "decode", extra_args=("--drain-grace", "60", "--engine-process", engine_process)
    )
    max_tokens = 300
    params = pb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    with grpc.insecure_channel(svc.address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        decode = pb_grpc.DecodeServiceStub(channel)
        assert _status(health) == SERVING
        assert _status(health, "pdserve.v1.DecodeService") == SERVING

        call = decode.Decode(
            pb.DecodeRequest(request_id="inflight", prompt_token_ids=[5, 6, 7, 8], params=params),
            timeout=120,
        )
        stream = iter(call)
        received = list(next(stream).token_ids)
        svc.signal(signal.SIGTERM)

        deadline = time.monotonic() + 20
        while _status(health) != NOT_SERVING:
            assert time.monotonic() < deadline, "health never turned NOT_SERVING after SIGTERM"
            time.sleep(0.05)
        assert _status(health, "pdserve.v1.DecodeService") == NOT_SERVING
        load = decode.GetLoad(pb.GetLoadRequest(), timeout=10)
        assert load.draining

        try:
            list(
                decode.Decode(pb.DecodeRequest(prompt_token_ids=[5, 6], params=params), timeout=10)
            )
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE
            assert "draining" in exc.details()
        else:
            raise AssertionError("a new request was accepted while draining")

        chunks = list(stream)
        received += [t for c in chunks for t in c.token_ids]
        assert len(received) == max_tokens
        assert chunks[-1].finished and chunks[-1].finish_reason == "length"
    assert svc.proc.wait(timeout=60) == 0, svc.log_tail()


def test_full_queue_is_refused_with_resource_exhausted(process_stack: ProcessStack) -> None:
    """--max-num-seqs 1 --max-waiting 1: one running, one waiting, the next is refused."""
    svc = process_stack.service("decode", extra_args=("--max-num-seqs", "1", "--max-waiting", "1"))
    long = pb.SamplingParams(max_tokens=1000, temperature=0.0, ignore_eos=True)
    with grpc.insecure_channel(svc.address) as channel:
        decode = pb_grpc.DecodeServiceStub(channel)
        calls = [
            decode.Decode(
                pb.DecodeRequest(request_id=f"q{i}", prompt_token_ids=[5, 6, 7], params=long),
                timeout=120,
            )
            for i in range(2)
        ]
        try:
            deadline = time.monotonic() + 30
            while decode.GetLoad(pb.GetLoadRequest(), timeout=10).waiting < 1:
                assert time.monotonic() < deadline, "the second request never showed up as waiting"
                time.sleep(0.05)
            try:
                list(
                    decode.Decode(
                        pb.DecodeRequest(prompt_token_ids=[5, 6], params=long), timeout=30
                    )
                )
            except grpc.RpcError as exc:
                assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "queue is full" in exc.details()
            else:
                raise AssertionError("a request beyond --max-waiting was accepted")
        finally:
            for call in calls:
                call.cancel()


def test_engine_process_dies_with_its_service(process_stack: ProcessStack) -> None:
    """A service killed outright (SIGKILL to it alone) leaves no engine process behind
    holding the device: the engine process gets the parent-death signal."""
    svc = process_stack.service("decode", extra_args=("--engine-process", "on"))
    children = [
        int(p.name)
        for p in Path("/proc").iterdir()
        if p.name.isdigit() and _parent_of(p) == svc.proc.pid
    ]
    engines = [pid for pid in children if b"spawn_main" in _cmdline(pid)]
    assert len(engines) == 1, f"want one engine process under the service, got {children}"
    os.kill(svc.proc.pid, signal.SIGKILL)
    svc.proc.wait(timeout=30)
    deadline = time.monotonic() + 30
    while Path(f"/proc/{engines[0]}").exists() and _state(engines[0]) != "Z":
        assert time.monotonic() < deadline, "the engine process outlived its service"
        time.sleep(0.1)


def _parent_of(proc_dir: Path) -> int:
    try:
        return int((proc_dir / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "gone"


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""
