"""A pipeline group whose stage 1 runs in a process the leader did not start, joined by
address as a pod of another node does (docs/kubernetes.md, "Pipeline parallelism";
``engine/executor/pp/join.py``): real decode services on 127.0.0.1, the leader with
``--pipeline-leader`` and the stage with ``--pipeline-stage 1``, started independently
(the stage first: it dials until the leader listens). Greedy tokens equal the offline
engine's; the stage's health port says SERVING once it has joined; a lost stage takes the
leader down (UNAVAILABLE, exit 1) and a stopped leader ends the stage. With N = 2 the
joined stage's service starts its second TP rank, which joins by itself."""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from engine.core.sampling_params import SamplingParams
from pdserve.procs import free_ports, grpc_probe
from tests.e2e.router_support import wait_for
from tests.integration.test_p2p_services import decode
from tests.service_fixtures import (
    SMALL_ENGINE_ARGS,
    ServiceProcess,
    spawn,
    start_service,
    wait_healthy,
)

pytestmark = pytest.mark.timeout(600)
PROMPT = [2000 + (i * 31) % 20000 for i in range(45)]


@dataclass(slots=True)
class Group:
    leader: ServiceProcess
    stage: ServiceProcess


def _group(model: Path, logs: Path, tp: int) -> Group:
    rendezvous, port = free_ports(2)
    leader_at = (
        *("--pipeline-parallel-size", "2", "--tensor-parallel-size", str(tp)),
        *("--pipeline-leader", f"127.0.0.1:{rendezvous}"),
    )
    name = f"stage1-{port}"
    argv = [
        sys.executable,
        *("-m", "service", "decode", "--host", "127.0.0.1", "--port", str(port)),
        *("--metrics-port", "0", "--model", str(model), *SMALL_ENGINE_ARGS),
        *leader_at,
        *("--pipeline-stage", "1"),
    ]
    stage = ServiceProcess(name, spawn(name, argv, logs), logs / f"{name}.log", port)
    try:
        leader = start_service("decode", model, logs, extra_args=leader_at)
    except BaseException:
        stage.stop()
        raise
    return Group(leader, stage)


@pytest.fixture(params=[1, 2], ids=["P2", "P2xN2"])
def group(request: pytest.FixtureRequest, tmp_path: Path, tiny_model_dir: Path) -> Iterator[Group]:
    g = _group(tiny_model_dir, tmp_path / "logs", request.param)
    try:
        yield g
    finally:
        g.leader.stop()
        g.stage.stop()


def test_a_joined_stage_serves_the_group(group: Group, tiny_model_dir: Path) -> None:
    from engine.llm import LLM

    wait_healthy(group.stage, grpc_probe(group.stage.address), 30)  # SERVING: it has joined
    tokens, _ = decode(group.leader, PROMPT, None, None)
    with LLM(str(tiny_model_dir), num_kv_blocks=64) as llm:  # P = 1, in this process
        params = SamplingParams(max_tokens=len(tokens), temperature=0.0, ignore_eos=True)
        assert tokens == list(llm.generate(PROMPT, params)[0].token_ids)
    again, _ = decode(group.leader, PROMPT, None, None)  # the prefix cache, across stages
    assert again == tokens

    group.leader.stop()  # the leader ends the group: the stage exits on its own, cleanly
    assert group.stage.proc.wait(timeout=30) == 0, group.stage.log_tail()


@pytest.mark.parametrize("group", [1], ids=["P2"], indirect=True)
def test_a_lost_stage_takes_the_leader_down(group: Group) -> None:
    group.stage.signal(signal.SIGKILL)
    group.stage.proc.wait(timeout=10)

    def refused() -> bool:
        try:
            decode(group.leader, PROMPT, None, None)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.UNAVAILABLE, e.details()
            return True
        return False

    wait_for(refused, 60, "the leader to refuse requests")
    assert group.leader.proc.wait(timeout=60) == 1, group.leader.log_tail()
