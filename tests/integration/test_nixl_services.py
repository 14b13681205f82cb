"""Prefill → decode over ``--connector nixl`` with the real services (two processes, the
KV pools registered as DRAM with NIXL's UCX backend): the handle carries the prefill's card
and descriptors, the decode READs exactly the blocks, greedy tokens equal colocated ones,
the held blocks return to the prefill's pool, and an abort, a dead prefill or a forged or
stale handle send the decode to its ``--kv-load-failure`` policy.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import grpc
import pytest

from kv_store.nixl.card import parse_transfer_id, transfer_id
from pdserve_api.v1 import pdserve_pb2 as pb
from pdserve_api.v1 import pdserve_pb2_grpc as pb_grpc
from tests.e2e.router_support import metric, wait_for
from tests.integration.test_p2p_services import PROMPT, decode, free_blocks, prefill_handle

if TYPE_CHECKING:
    from tests.service_fixtures import ProcessStack, ServiceProcess

pytestmark = [
    pytest.mark.timeout(600),
]
NIXL = ("--connector", "nixl", "--p2p-timeout", "10")


def decode_free(service: ServiceProcess) -> tuple[int, int]:
    """(free, total) KV blocks of a decode instance."""
    with grpc.insecure_channel(service.address) as ch:
        info = pb_grpc.DecodeServiceStub(ch).GetLoad(pb.GetLoadRequest(), timeout=10)
    return info.free_kv_blocks, info.total_kv_blocks


def all_free(service: ServiceProcess) -> bool:
    free, total = decode_free(service)
    return free == total


def test_handoff_matches_colocated(process_stack: ProcessStack) -> None:
    prefill = process_stack.service("prefill", connector_args=NIXL)
    dec = process_stack.service("decode", connector_args=NIXL)
    first, handle = prefill_handle(prefill, "n1", PROMPT)
    assert handle.connector == "nixl" and handle.source_address.startswith("nixl:")
    lease, ids = parse_transfer_id(handle.transfer_id)
    assert lease.startswith("n1.") and len(ids) == 3 and not handle.block_keys
    free, total = free_blocks(prefill)
    assert free <= total - 3  # held for the READ

    tokens, timings = decode(dec, PROMPT, first, handle)
    assert timings.kv_blocks_loaded == 3 and timings.kv_blocks_recomputed == 0
    colocated, _ = decode(dec, PROMPT, None, None)
    assert tokens == colocated

    wait_for(lambda: free_blocks(prefill)[0] == total, 10, "the prefill to free the read blocks")
    assert all_free(dec)
    url = prefill.metrics_url
    assert metric(url, "pdserve_kv_p2p_blocks_held", role="prefill") == 0
    assert metric(url, "pdserve_kv_p2p_lease_ends_total", reason="pulled") == 1
    assert metric(dec.metrics_url, "pdserve_kv_p2p_bytes_total", direction="recv") > 0

    # The same handle again, at a decode without the prompt cached: its lease ended, so the
    # descriptors are stale → refused, and the decode recomputes (same tokens).
    dec2 = process_stack.service("decode", connector_args=NIXL)
    tokens, timings = decode(dec2, PROMPT, first, handle)
    assert timings.kv_blocks_loaded == 0 and timings.kv_blocks_recomputed == 3
    assert tokens == colocated
    assert metric(dec2.metrics_url, "pdserve_kv_load_fallbacks_total", reason="missing") == 1


def test_forged_descriptors_are_refused(process_stack: ProcessStack) -> None:
    prefill = process_stack.service("prefill", connector_args=NIXL)
    dec = process_stack.service(
        "decode", connector_args=NIXL, extra_args=("--kv-load-failure", "fail")
    )
    ok = process_stack.service("decode", connector_args=NIXL)  # started before the lease
    first, handle = prefill_handle(prefill, "f1", PROMPT)
    lease, ids = parse_transfer_id(handle.transfer_id)
    forged = pb.KvHandle()
    forged.CopyFrom(handle)
    forged.transfer_id = transfer_id(lease, [ids[0], ids[1], ids[2] + 1])  # another block
    with pytest.raises(grpc.RpcError) as info:
        decode(dec, PROMPT, first, forged)
    assert "KV load failed (forged)" in (info.value.details() or "")
    # Nothing was pinned by the forgery: the genuine handle still reads.
    tokens, timings = decode(ok, PROMPT, first, handle)
    assert timings.kv_blocks_loaded == 3
    assert tokens == decode(ok, PROMPT, None, None)[0]


def test_abort_frees_and_decode_recomputes(process_stack: ProcessStack) -> None:
    prefill = process_stack.service("prefill", connector_args=NIXL)
    dec = process_stack.service("decode", connector_args=NIXL)
    first, handle = prefill_handle(prefill, "gone", PROMPT)
    with grpc.insecure_channel(prefill.address) as ch:
        pb_grpc.PrefillServiceStub(ch).Abort(pb.AbortRequest(request_id="gone"), timeout=10)
    total = free_blocks(prefill)[1]
    wait_for(lambda: free_blocks(prefill)[0] == total, 10, "the aborted hold to be freed")
    assert metric(prefill.metrics_url, "pdserve_kv_p2p_lease_ends_total", reason="aborted") == 1
    tokens, timings = decode(dec, PROMPT, first, handle)
    assert timings.kv_blocks_loaded == 0 and timings.kv_blocks_recomputed == 3
    assert tokens == decode(dec, PROMPT, None, None)[0]


@pytest.mark.timeout(120)  # the guard: a pull that hung would outlive it
def test_dead_prefill_recomputes_within_the_deadline(process_stack: ProcessStack) -> None:
    prefill = process_stack.service("prefill", connector_args=NIXL)
    dec = process_stack.service("decode", connector_args=NIXL)
    first, handle = prefill_handle(prefill, "p", PROMPT)
    prefill.stop()  # gone with its agent and cache
    tokens, timings = decode(dec, PROMPT, first, handle)
    assert timings.kv_blocks_recomputed == 3
    assert tokens == decode(dec, PROMPT, None, None)[0]
    assert all_free(dec)
