"""``--connector p2p`` services with the control-plane token (``PDSERVE_GRPC_TOKEN``): the
p2p control server takes the services' token, so a decode instance of another deployment
(another token) is refused its pull with reason ``auth`` and recomputes, while the
rightful decode instance pulls the same lease and gets the colocated greedy tokens."""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc
import pytest

from common.grpc_token import call_metadata
from pdserve_api.v1 import pdserve_pb2 as pb
from pdserve_api.v1 import pdserve_pb2_grpc as pb_grpc
from tests.e2e.router_support import metric

if TYPE_CHECKING:
    from tests.service_fixtures import ProcessStack, ServiceProcess

pytestmark = pytest.mark.timeout(600)
GREEDY = pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
P2P = ("--connector", "p2p", "--p2p-timeout", "20")
PROMPT = [2000 + (i * 37) % 20000 for i in range(45)]  # 2 full blocks + a partial one
TOKEN, OTHER = "deployment-token", "another-deployment"


def decode(
    target: ServiceProcess, token: str, first: int | None, handle: pb.KvHandle | None
) -> tuple[list[int], pb.PhaseTimings]:
    req = pb.DecodeRequest(prompt_token_ids=PROMPT, params=GREEDY)
    if first is not None:
        req.generated_token_ids.append(first)
    if handle is not None:
        req.kv_handle.CopyFrom(handle)
    with grpc.insecure_channel(target.address) as ch:
        stub = pb_grpc.DecodeServiceStub(ch)
        chunks = list(stub.Decode(req, timeout=120, metadata=call_metadata(token)))
    tokens = ([first] if first is not None else []) + [t for c in chunks for t in c.token_ids]
    return tokens, chunks[0].timings


def test_pull_from_another_deployment_is_refused_and_recomputed(
    process_stack: ProcessStack,
) -> None:
    prefill = process_stack.service(
        "prefill", connector_args=P2P, env={"PDSERVE_GRPC_TOKEN": TOKEN}
    )
    ours = process_stack.service("decode", connector_args=P2P, env={"PDSERVE_GRPC_TOKEN": TOKEN})
    theirs = process_stack.service("decode", connector_args=P2P, env={"PDSERVE_GRPC_TOKEN": OTHER})
    with grpc.insecure_channel(prefill.address) as ch:
        events = list(
            pb_grpc.PrefillServiceStub(ch).Prefill(
                pb.PrefillRequest(request_id="p1", prompt_token_ids=PROMPT, params=GREEDY),
                timeout=120,
                metadata=call_metadata(TOKEN),
            )
        )
    first, handle = events[0].first_token.token_id, events[-1].kv_committed
    assert handle.connector == "p2p" and handle.transfer_id

    refused, timings = decode(theirs, OTHER, first, handle)
    assert timings.kv_blocks_loaded == 0 and timings.kv_blocks_recomputed == 3
    assert metric(prefill.metrics_url, "pdserve_kv_failures_total", reason="auth") == 1
    assert metric(theirs.metrics_url, "pdserve_kv_failures_total", reason="auth") >= 1
    assert metric(prefill.metrics_url, "pdserve_kv_p2p_pairs_total", event="made") == 0

    pulled, timings = decode(ours, TOKEN, first, handle)  # the lease waited for us
    assert timings.kv_blocks_loaded == 3 and timings.kv_blocks_recomputed == 0
    colocated, _ = decode(ours, TOKEN, None, None)
    assert pulled == refused == colocated
