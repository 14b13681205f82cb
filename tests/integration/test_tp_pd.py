"""Prefill → decode between tensor-parallel instances (N = 2 on both sides; CPU, gloo, real
services whose worker ranks are real processes): every rank's KV shard moves to the same
rank on the other side, over the fs store (per-rank records) and over p2p (rank-to-rank
pulls). Greedy tokens equal those of an N = 1 instance computing the prompt itself, and a
handle from another N is refused with a message that names both sizes.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import pytest

from pdserve.v1 import pdserve_pb2 as pb
from tests.e2e.router_support import wait_for
from tests.integration.test_p2p_services import decode, free_blocks, prefill_handle

if TYPE_CHECKING:
    from tests.service_fixtures import ProcessStack

pytestmark = pytest.mark.timeout(600)
TP2 = ("--tensor-parallel-size", "2")
PROMPT = [2000 + (i * 31) % 20000 for i in range(45)]  # 2 full blocks + a partial one


def _split(value: str) -> list[str]:
    return value.split(",")


def _refused(stack_decode: object, handle: pb.KvHandle, first: int) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        decode(stack_decode, PROMPT, first, handle)  # type: ignore[arg-type]
    return refused.value


def test_fs_handoff_per_rank_records(process_stack: ProcessStack, fs_kv_dir: Path) -> None:
    fs = ("--connector", "fs", "--kv-path", str(fs_kv_dir))
    prefill = process_stack.service("prefill", connector_args=fs, extra_args=TP2)
    dec = process_stack.service("decode", connector_args=fs, extra_args=TP2)
    single = process_stack.service("decode", connector_args=fs)  # N = 1

    first, handle = prefill_handle(prefill, "p1", PROMPT)
    assert handle.model_fingerprint.endswith("-tp2") and handle.num_tokens == len(PROMPT)
    fingerprint = handle.model_fingerprint
    # One record per block per rank, each rank under its own fingerprint.
    for rank in (0, 1):
        records = [p for p in (fs_kv_dir / "pdserve" / f"{fingerprint}-r{rank}").rglob("*")]
        assert sum(p.is_file() for p in records) == 3, (rank, records)

    tokens, timings = decode(dec, PROMPT, first, handle)
    assert timings.kv_blocks_loaded == 3 and timings.kv_blocks_recomputed == 0
    colocated, _ = decode(single, PROMPT, None, None)
    assert tokens == colocated

    error = _refused(single, handle, first)
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error.details()
    assert "tensor_parallel_size 2 (prefill) != 1" in (error.details() or "")


def test_fs_missing_shard_is_recomputed(process_stack: ProcessStack, fs_kv_dir: Path) -> None:
    """Rank 1's last record gone: every rank recomputes from there, output unchanged."""
    fs = ("--connector", "fs", "--kv-path", str(fs_kv_dir))
    prefill = process_stack.service("prefill", connector_args=fs, extra_args=TP2)
    dec = process_stack.service("decode", connector_args=fs, extra_args=TP2)
    first, handle = prefill_handle(prefill, "p1", PROMPT)
    last_key = handle.block_keys[-1].rsplit("/", 1)[1]
    rank1 = fs_kv_dir / "pdserve" / f"{handle.model_fingerprint}-r1"
    victims = [p for p in rank1.rglob("*") if p.is_file() and p.name.startswith(last_key[:16])]
    assert len(victims) == 1, list(rank1.rglob("*"))
    victims[0].unlink()

    tokens, timings = decode(dec, PROMPT, first, handle)
    assert timings.kv_blocks_loaded == 2 and timings.kv_blocks_recomputed == 1
    colocated, _ = decode(dec, PROMPT, None, None)
    assert tokens == colocated


def test_p2p_handoff_rank_to_rank(process_stack: ProcessStack) -> None:
    p2p = ("--connector", "p2p", "--p2p-timeout", "20")
    prefill = process_stack.service("prefill", connector_args=p2p, extra_args=TP2)
    dec = process_stack.service("decode", connector_args=p2p, extra_args=TP2)
    single = process_stack.service("decode", connector_args=p2p)  # N = 1

    first, handle = prefill_handle(prefill, "p1", PROMPT)
    sources, transfers = _split(handle.source_address), _split(handle.transfer_id)
    assert len(sources) == 2 and len(set(sources)) == 2, handle.source_address
    assert len(transfers) == 2 and all(t.startswith("p1.") for t in transfers)
    free, total = free_blocks(prefill)
    assert free < total  # held on every rank for the pull

    error = _refused(single, handle, first)  # before the pull: the hold stays intact
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION, error.details()
    assert "tensor_parallel_size 2 (prefill) != 1" in (error.details() or "")

    tokens, timings = decode(dec, PROMPT, first, handle)
    assert timings.kv_blocks_loaded == 3 and timings.kv_blocks_recomputed == 0
    colocated, _ = decode(single, PROMPT, None, None)
    assert tokens == colocated
    # Both ranks' leases end as pulled, and only then rank 0 frees the blocks.
    wait_for(lambda: free_blocks(prefill)[0] == total, 20, "the prefill to free the pulled blocks")


def test_p2p_handle_of_other_size_is_recomputed_never_misread(
    process_stack: ProcessStack,
) -> None:
    """A handle listing one source where N = 2 (its fingerprint forged to match): the load
    fails with reason layout and the decode computes the prompt itself."""
    p2p = ("--connector", "p2p", "--p2p-timeout", "20")
    prefill = process_stack.service("prefill", connector_args=p2p, extra_args=TP2)
    dec = process_stack.service("decode", connector_args=p2p, extra_args=TP2)
    first, handle = prefill_handle(prefill, "p1", PROMPT)
    forged = pb.KvHandle()
    forged.CopyFrom(handle)
    forged.source_address = _split(handle.source_address)[0]
    forged.transfer_id = _split(handle.transfer_id)[0]
    tokens, timings = decode(dec, PROMPT, first, forged)
    assert timings.kv_blocks_loaded == 0 and timings.kv_blocks_recomputed == 3
    colocated, _ = decode(dec, PROMPT, None, None)
    assert tokens == colocated
