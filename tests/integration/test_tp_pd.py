"""Prefill → decode between tensor-parallel instances (N = 2 on both sides; CPU, gloo, real
services whose worker ranks are real processes): every rank's KV shard moves to the same
rank on the other side, over the fs store (per-rank records) and over p2p (rank-to-rank
pulls). Greedy tokens equal those of an N = 1 instance computing the prompt itself; a shard
one rank lacks is recomputed on all; one listing another number of p2p sources is
recomputed. Between unlike grids (docs/design.md §3 "KV between unlike grids") a decode of
N = 1 loads an N = 2 prefill's blocks (2 -> 1) and a decode of N = 2 an N = 1 prefill's
(1 -> 2), each re-cutting the heads; a handle of another model is refused naming both sides.

Each connector gets one stack for the module (prefill N = 2, decode N = 2, decode N = 1,
prefill N = 1): starting tensor-parallel services is the slow part.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from pdserve_api.v1 import pdserve_pb2 as pb
from tests.e2e.router_support import wait_for
from tests.integration.test_p2p_services import decode, free_blocks, prefill_handle
from tests.service_fixtures import ProcessStack, ServiceProcess

pytestmark = pytest.mark.timeout(900)
TP2 = ("--tensor-parallel-size", "2")
PROMPT = [2000 + (i * 31) % 20000 for i in range(45)]  # 2 full blocks + a partial one
OTHER = [3000 + (i * 17) % 20000 for i in range(40)]  # a second prompt, no shared block
THIRD = [4000 + (i * 13) % 20000 for i in range(40)]  # for 1 -> 2: nobody holds it yet
FOURTH = [5000 + (i * 11) % 20000 for i in range(40)]  # for p2p 2 -> 1


@dataclass(slots=True)
class Stack:
    prefill: ServiceProcess  # N = 2 (or P = 2: test_pp_pd.py)
    decode: ServiceProcess  # N = 2 (or P = 2)
    single: ServiceProcess  # N = P = 1: the reference, and the instance of another size
    kv_dir: Path
    single_prefill: ServiceProcess  # N = P = 1: the prefill of another size


def parallel_stack(
    factory: pytest.TempPathFactory,
    model: Path,
    connector: tuple[str, ...],
    parallel: tuple[str, ...] = TP2,
) -> Iterator[Stack]:
    """Prefill and decode with the ``parallel`` flags, and a decode without them, over one
    ``connector`` (``{kv}`` stands for the module's store directory)."""
    root = factory.mktemp("parallel_pd")
    kv_dir = root / "kv"
    kv_dir.mkdir()
    args = tuple(a.replace("{kv}", str(kv_dir)) for a in connector)
    stack = ProcessStack(root / "logs", model)
    try:
        prefill, dec, single, single_prefill = stack.together(
            lambda: stack.service("prefill", connector_args=args, extra_args=parallel),
            lambda: stack.service("decode", connector_args=args, extra_args=parallel),
            lambda: stack.service("decode", connector_args=args),
            lambda: stack.service("prefill", connector_args=args),
        )
        yield Stack(prefill, dec, single, kv_dir, single_prefill)
    finally:
        stack.close()


@pytest.fixture(scope="module")
def fs_stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Stack]:
    yield from parallel_stack(
        tmp_path_factory, tiny_model_dir, ("--connector", "fs", "--kv-path", "{kv}")
    )


@pytest.fixture(scope="module")
def p2p_stack(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[Stack]:
    yield from parallel_stack(
        tmp_path_factory, tiny_model_dir, ("--connector", "p2p", "--p2p-timeout", "20")
    )


def recut(target: ServiceProcess, handle: pb.KvHandle, first: int, prompt: list[int]) -> list[int]:
    """A decode of another grid loads every block of ``handle`` (re-cut), computes none;
    ``target`` must not hold ``prompt`` in its prefix cache yet."""
    tokens, timings = decode(target, prompt, first, handle)
    blocks = -(-len(prompt) // 16)
    assert (timings.kv_blocks_loaded, timings.kv_blocks_recomputed) == (blocks, 0), timings
    return tokens


def refused_other_model(target: ServiceProcess, handle: pb.KvHandle, first: int) -> None:
    """A handle of another model (hash part) is refused naming both sides' grids."""
    forged = pb.KvHandle()
    forged.CopyFrom(handle)
    forged.model_fingerprint = "0" * 32 + handle.model_fingerprint[32:]
    with pytest.raises(grpc.RpcError) as refused:
        decode(target, PROMPT, first, forged)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION, refused.value.details()
    details = refused.value.details() or ""
    assert "(prefill)" in details and "(this decode" in details, details


def test_fs_per_rank_records_match_n1(fs_stack: Stack) -> None:
    first, handle = prefill_handle(fs_stack.prefill, "p1", PROMPT)
    assert handle.model_fingerprint.endswith("-tp2") and handle.num_tokens == len(PROMPT)
    for rank in (0, 1):  # one record per block per rank, under the rank's own fingerprint
        records = (fs_stack.kv_dir / "pdserve" / f"{handle.model_fingerprint}-r{rank}").rglob("*")
        assert sum(p.is_file() for p in records) == 3, rank

    tokens, timings = decode(fs_stack.decode, PROMPT, first, handle)
    assert timings.kv_blocks_loaded == 3 and timings.kv_blocks_recomputed == 0
    assert recut(fs_stack.single, handle, first, PROMPT) == tokens  # 2 -> 1
    colocated, _ = decode(fs_stack.single, PROMPT, None, None)
    assert tokens == colocated
    refused_other_model(fs_stack.single, handle, first)


def test_fs_n1_prefill_to_n2_decode(fs_stack: Stack) -> None:
    """1 -> 2: each decode rank takes its heads out of the N = 1 prefill's records."""
    first, handle = prefill_handle(fs_stack.single_prefill, "p3", THIRD)
    assert "-tp" not in handle.model_fingerprint
    tokens = recut(fs_stack.decode, handle, first, THIRD)
    colocated, _ = decode(fs_stack.single, THIRD, None, None)
    assert tokens == colocated


def test_fs_shard_missing_on_one_rank_is_recomputed(fs_stack: Stack) -> None:
    first, handle = prefill_handle(fs_stack.prefill, "p2", OTHER)
    last = handle.block_keys[-1].rsplit("/", 1)[1]
    rank1 = fs_stack.kv_dir / "pdserve" / f"{handle.model_fingerprint}-r1"
    victim = next(p for p in rank1.rglob(last) if p.is_file())
    victim.unlink()  # rank 0 still has this block: the load must not count it

    tokens, timings = decode(fs_stack.decode, OTHER, first, handle)
    assert timings.kv_blocks_loaded == 2 and timings.kv_blocks_recomputed == 1
    colocated, _ = decode(fs_stack.single, OTHER, None, None)
    assert tokens == colocated


def test_p2p_rank_to_rank_matches_n1(p2p_stack: Stack) -> None:
    first, handle = prefill_handle(p2p_stack.prefill, "p1", PROMPT)
    sources, transfers = handle.source_address.split(","), handle.transfer_id.split(",")
    assert len(sources) == 2 and len(set(sources)) == 2, handle.source_address
    assert len(transfers) == 2 and all(t.startswith("p1.") for t in transfers)
    free, total = free_blocks(p2p_stack.prefill)
    assert free < total  # held on every rank for the pull
    refused_other_model(p2p_stack.single, handle, first)  # before any pull: the hold stays

    tokens, timings = decode(p2p_stack.decode, PROMPT, first, handle)
    assert timings.kv_blocks_loaded == 3 and timings.kv_blocks_recomputed == 0
    colocated, _ = decode(p2p_stack.single, PROMPT, None, None)
    assert tokens == colocated
    # Both ranks' leases end as pulled; only then does rank 0 free the blocks.
    wait_for(lambda: free_blocks(p2p_stack.prefill)[0] == total, 20, "the held blocks freed")


def test_p2p_n2_prefill_to_n1_decode(p2p_stack: Stack) -> None:
    """2 -> 1: the N = 1 decode pulls both prefill ranks' leases and joins their heads."""
    first, handle = prefill_handle(p2p_stack.prefill, "p5", FOURTH)
    _, total = free_blocks(p2p_stack.prefill)
    tokens = recut(p2p_stack.single, handle, first, FOURTH)
    colocated, _ = decode(p2p_stack.decode, FOURTH, None, None)
    assert tokens == colocated
    wait_for(lambda: free_blocks(p2p_stack.prefill)[0] == total, 20, "both leases pulled")


def test_p2p_n1_prefill_to_n2_decode(p2p_stack: Stack) -> None:
    """1 -> 2: both decode ranks pull the one lease (each its heads); it ends after both."""
    first, handle = prefill_handle(p2p_stack.single_prefill, "p6", THIRD)
    _, total = free_blocks(p2p_stack.single_prefill)
    tokens = recut(p2p_stack.decode, handle, first, THIRD)
    colocated, _ = decode(p2p_stack.single, THIRD, None, None)
    assert tokens == colocated
    wait_for(lambda: free_blocks(p2p_stack.single_prefill)[0] == total, 20, "the lease pulled")


def test_p2p_handle_listing_one_source_is_recomputed(p2p_stack: Stack) -> None:
    """Its fingerprint matches (forged), but it names one rank's source where N = 2: the
    load fails (reason layout) and the decode computes the prompt, never half a cache."""
    first, handle = prefill_handle(p2p_stack.prefill, "p2", OTHER)
    forged = pb.KvHandle()
    forged.CopyFrom(handle)
    forged.source_address = handle.source_address.split(",")[0]
    forged.transfer_id = handle.transfer_id.split(",")[0]
    tokens, timings = decode(p2p_stack.decode, OTHER, first, forged)
    assert timings.kv_blocks_loaded == 0 and timings.kv_blocks_recomputed == 3
    colocated, _ = decode(p2p_stack.single, OTHER, None, None)
    assert tokens == colocated


def test_redis_per_rank_records(process_stack: ProcessStack, redis_server: str) -> None:
    """The same handoff through a real redis-server: each rank's own keys; the N = 2 tokens
    equal an N = 1 engine's."""
    import redis as redis_py

    args = ("--connector", "redis", "--redis-url", redis_server)
    prefill = process_stack.service("prefill", connector_args=args, extra_args=TP2)
    dec = process_stack.service("decode", connector_args=args, extra_args=TP2)
    first, handle = prefill_handle(prefill, "p1", PROMPT)
    client = redis_py.Redis.from_url(redis_server)
    try:
        for rank in (0, 1):
            keys = client.keys(f"pdserve/{handle.model_fingerprint}-r{rank}/*")
            assert len(keys) == 3, (rank, keys)
    finally:
        client.close()
    tokens, timings = decode(dec, PROMPT, first, handle)
    assert timings.kv_blocks_loaded == 3 and timings.kv_blocks_recomputed == 0
    from engine.core.sampling_params import SamplingParams
    from engine.llm import LLM

    with LLM(str(process_stack.model_dir), num_kv_blocks=64) as llm:  # N = 1, in this process
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        assert tokens == llm.generate(PROMPT, params)[0].token_ids
