"""Prefill → decode over ``--connector p2p`` with real services: the handle arrives at once,
the decode pulls the blocks GPU-style (here gloo), greedy tokens equal colocated ones, the
prefill's held blocks return to its pool, and an Abort or a dead prefill sends the decode
to its ``--kv-load-failure`` policy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc
import pytest

from pdserve_api.v1 import pdserve_pb2 as pb
from pdserve_api.v1 import pdserve_pb2_grpc as pb_grpc
from tests.e2e.router_support import metric, wait_for

if TYPE_CHECKING:
    from tests.service_fixtures import ProcessStack, ServiceProcess

pytestmark = pytest.mark.timeout(600)
GREEDY = pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
P2P = ("--connector", "p2p", "--p2p-timeout", "20")
PROMPT = [2000 + (i * 31) % 20000 for i in range(45)]  # 2 full blocks + a partial one


def prefill_handle(
    prefill: ServiceProcess, request_id: str, prompt: list[int]
) -> tuple[int, pb.KvHandle]:
    with grpc.insecure_channel(prefill.address) as ch:
        events = list(
            pb_grpc.PrefillServiceStub(ch).Prefill(
                pb.PrefillRequest(request_id=request_id, prompt_token_ids=prompt, params=GREEDY),
                timeout=120,
            )
        )
    return events[0].first_token.token_id, events[-1].kv_committed


def decode(
    target: ServiceProcess, prompt: list[int], first: int | None, handle: pb.KvHandle | None
) -> tuple[list[int], pb.PhaseTimings]:
    """All tokens (``first`` included) and the first chunk's timings."""
    req = pb.DecodeRequest(prompt_token_ids=prompt, params=GREEDY)
    if first is not None:
        req.generated_token_ids.append(first)
    if handle is not None:
        req.kv_handle.CopyFrom(handle)
    with grpc.insecure_channel(target.address) as ch:
        chunks = list(pb_grpc.DecodeServiceStub(ch).Decode(req, timeout=120))
    tokens = ([first] if first is not None else []) + [t for c in chunks for t in c.token_ids]
    return tokens, chunks[0].timings


def free_blocks(service: ServiceProcess) -> tuple[int, int]:
    with grpc.insecure_channel(service.address) as ch:
        info = pb_grpc.PrefillServiceStub(ch).GetLoad(pb.GetLoadRequest(), timeout=10)
    return info.free_kv_blocks, info.total_kv_blocks


def test_handoff_matches_colocated(process_stack: ProcessStack) -> None:
    prefill = process_stack.service("prefill", connector_args=P2P)
    dec = process_stack.service("decode", connector_args=P2P)
    first, handle = prefill_handle(prefill, "p1", PROMPT)
    assert handle.connector == "p2p" and handle.transfer_id.startswith("p1.")
    assert handle.source_address.startswith("127.0.0.1:") and handle.num_tokens == len(PROMPT)
    assert not handle.block_keys
    free, total = free_blocks(prefill)
    assert free < total  # held for the pull

    tokens, timings = decode(dec, PROMPT, first, handle)
    assert timings.kv_blocks_loaded == 3 and timings.kv_blocks_recomputed == 0
    colocated, _ = decode(dec, PROMPT, None, None)
    assert tokens == colocated

    wait_for(lambda: free_blocks(prefill)[0] == total, 10, "the prefill to free the pulled blocks")
    url = prefill.metrics_url
    assert metric(url, "pdserve_kv_p2p_blocks_held", role="prefill") == 0
    assert metric(url, "pdserve_kv_p2p_lease_ends_total", reason="pulled") == 1
    assert metric(url, "pdserve_kv_blocks_saved_total", connector="p2p") == 3
    assert metric(dec.metrics_url, "pdserve_kv_p2p_bytes_total", direction="recv") > 0
    assert metric(dec.metrics_url, "pdserve_kv_p2p_transfer_seconds_count", direction="recv") == 1


@pytest.mark.parametrize("policy", ["recompute", "fail"])
def test_prefill_abort_before_the_pull(process_stack: ProcessStack, policy: str) -> None:
    prefill = process_stack.service("prefill", connector_args=P2P)
    dec = process_stack.service(
        "decode", connector_args=P2P, extra_args=("--kv-load-failure", policy)
    )
    first, handle = prefill_handle(prefill, "gone", PROMPT)
    with grpc.insecure_channel(prefill.address) as ch:
        pb_grpc.PrefillServiceStub(ch).Abort(pb.AbortRequest(request_id="gone"), timeout=10)
    free, total = free_blocks(prefill)
    wait_for(lambda: free_blocks(prefill)[0] == total, 10, "the aborted hold to be freed")
    assert metric(prefill.metrics_url, "pdserve_kv_p2p_lease_ends_total", reason="aborted") == 1

    if policy == "fail":
        with pytest.raises(grpc.RpcError) as info:
            decode(dec, PROMPT, first, handle)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "KV load failed (missing)" in (info.value.details() or "")
        # The refused request is no longer in flight: a drain has nothing to wait for (it
        # waited its whole grace while the servicer left the request's stream unclosed).
        assert dec.stop() == 0
        assert "draining: 0 request(s) in flight" in dec.log_tail(), dec.log_tail()
        return
    tokens, timings = decode(dec, PROMPT, first, handle)
    assert timings.kv_blocks_loaded == 0 and timings.kv_blocks_recomputed == 3
    assert tokens == decode(dec, PROMPT, None, None)[0]
    assert metric(dec.metrics_url, "pdserve_kv_load_fallbacks_total", reason="missing") == 1


@pytest.mark.timeout(120)  # the guard: a pull that hung would outlive it
def test_dead_prefill_recomputes_within_the_deadline(process_stack: ProcessStack) -> None:
    prefill = process_stack.service("prefill", connector_args=P2P)
    dec = process_stack.service("decode", connector_args=P2P)
    first, handle = prefill_handle(prefill, "p", PROMPT)
    prefill.stop()  # gone with its cache: the pull cannot connect
    tokens, timings = decode(dec, PROMPT, first, handle)
    assert timings.kv_blocks_recomputed == 3
    assert tokens == decode(dec, PROMPT, None, None)[0]
    assert metric(dec.metrics_url, "pdserve_kv_load_fallbacks_total", reason="unreachable") == 1
