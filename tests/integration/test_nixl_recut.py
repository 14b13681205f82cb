"""nixl between unlike grids (docs/design.md §3 "KV between unlike grids"): real NIXL agents
(UCX, DRAM pools) for every process of a P x N prefill grid and of a decode grid of another
split, in this process. Each decode process READs the cells it owns from the prefill
processes that hold them (``kv_store/nixl/recut.py``): its cache then holds, byte for byte,
its layers x heads of the whole KV; every prefill lease ends as pulled, a lease that several
decode processes read only after the last; a dropped request's re-cut load of no blocks
ends every lease at once. Service to service with real engines: ``test_nixl_grids.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from common.block_hash import compute_block_hashes
from engine.kv.reshard import grid_owned
from engine.models import ModelArgs
from kv_store.base import KvLayout, KVTransfer, TransferResult, rank_fingerprint
from kv_store.nixl import NixlConnector
from kv_store.reshard import Reshard

pytestmark = pytest.mark.timeout(120)
BS, LAYERS, DIM, BLOCKS = 4, 4, 2, 8
FP = "f" * 32
TOKENS = list(range(2 * BS + 1))  # two full blocks and a partial one
HASHES = compute_block_hashes(TOKENS, BS, include_partial=True)
SIZES = [BS, BS, 1]


def _args(kv_heads: int) -> ModelArgs:
    return ModelArgs(
        architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
        num_layers=LAYERS, num_heads=8, num_kv_heads=kv_heads, head_dim=DIM,
        rms_norm_eps=1e-5, rope_theta=1e4,
    )  # fmt: skip


def _connector(cache: torch.Tensor, fingerprint: str) -> NixlConnector:
    layers, _, _, _, heads, _ = cache.shape
    c = NixlConnector(timeout_s=10.0)
    c.bind_kv_cache(cache, KvLayout(1, "float32", BS, layers, heads, DIM), fingerprint)
    return c


@dataclass(slots=True)
class Prefill:
    """A P x N prefill grid holding ``whole``'s blocks 1, 4, 6 under one lease per process."""

    connectors: list[NixlConnector]
    handle: tuple[str, str]  # (source_address, transfer_id): every process's, rank order
    fingerprint: str

    def releases(self, timeout: float = 10.0) -> list[TransferResult]:
        out = []
        for c in self.connectors:
            got = c.wait(1, timeout)
            assert len(got) == 1 and got[0].kind == "release", got
            out += got
        return out


def _prefill(whole: torch.Tensor, args: ModelArgs, pp: int, tp: int) -> Prefill:
    grid = grid_owned(args, pp, tp)
    fp = FP + (f"-pp{pp}" if pp > 1 else "") + (f"-tp{tp}" if tp > 1 else "")
    conns, addresses, ids = [], [], []
    for g, o in enumerate(grid):
        shard = whole[o.layer_start : o.layer_end, :, :, :, o.head_start : o.head_end]
        c = _connector(shard.contiguous(), rank_fingerprint(fp, g, len(grid)))
        conns.append(c)
        c.start_save(KVTransfer("s", TOKENS, HASHES, [1, 4, 6], SIZES))
        (res,) = c.wait(1, 10)
        assert res.ok and res.held, res
        addresses.append(res.source_address)
        ids.append(res.transfer_id)
    return Prefill(conns, (",".join(addresses), ",".join(ids)), fp)


@pytest.fixture
def connectors() -> Iterator[list[NixlConnector]]:
    made: list[NixlConnector] = []
    yield made
    for c in made:
        c.close()


def _load(
    cache: torch.Tensor, prefill: Prefill, reshard: Reshard, ids: list[int], start: int = 0
) -> tuple[NixlConnector, TransferResult]:
    c = _connector(cache, "decode-" + prefill.fingerprint)
    n = len(ids)
    load = KVTransfer("d", TOKENS, HASHES[:n], ids, SIZES[:n], start)
    load.source_address, load.transfer_id = prefill.handle
    load.reshard = reshard.to_json()
    c.start_load(load)
    (res,) = c.wait(1, 20)
    return c, res


def whole_kv(kv_heads: int, device: str) -> torch.Tensor:
    """The whole KV both grids split: the same in every process (drawn on the CPU)."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(LAYERS, 2, BLOCKS, BS, kv_heads, DIM, generator=g).to(device)


def read_cells(
    connectors: list[NixlConnector], prefill: Prefill, src: tuple[int, int],
    dst: tuple[int, int], kv_heads: int, device: str,
) -> None:  # fmt: skip
    """Every process of a ``dst`` grid re-cuts ``prefill``'s blocks: each holds exactly its
    cells of ``whole_kv`` (blocks 1, 4, 6 into 0, 2, 3), nothing else written."""
    args = _args(kv_heads)
    whole = whole_kv(kv_heads, device)
    reshard = Reshard(prefill.fingerprint, grid_owned(args, *src), grid_owned(args, *dst))
    for rank, o in enumerate(reshard.dests):
        reshard.dest_rank = rank
        cache = torch.zeros(o.num_layers, 2, BLOCKS, BS, o.num_heads, DIM, device=device)
        c, res = _load(cache, prefill, reshard, [0, 2, 3])
        connectors.append(c)
        assert res.ok and res.num_loaded_blocks == 3, res
        want = whole[o.layer_start : o.layer_end, :, :, :, o.head_start : o.head_end]
        assert torch.equal(cache[:, :, [0, 2]], want[:, :, [1, 4]])
        assert torch.equal(cache[:, :, 3, :1], want[:, :, 6, :1])
        assert not cache[:, :, [1, 4, 5, 6, 7]].any()  # nothing else written


def serve_prefill(conn: Any, src: tuple[int, int], kv_heads: int, device: str) -> None:
    """A prefill grid in a process of its own (the GPU test: READs between processes, as
    in service): sends its handle, then, when told, whether every lease ended as pulled."""
    prefill = _prefill(whole_kv(kv_heads, device), _args(kv_heads), *src)
    try:
        conn.send((prefill.handle, prefill.fingerprint))
        conn.recv()
        ended = all(r.ok for r in prefill.releases())
        conn.send(ended and all(c.transport_stats().blocks_held == 0 for c in prefill.connectors))
    finally:
        for c in prefill.connectors:
            c.close()


def check_recut(
    connectors: list[NixlConnector], src: tuple[int, int], dst: tuple[int, int], kv_heads: int
) -> None:
    """A ``src`` grid's blocks re-cut into every process of a ``dst`` grid; every lease
    (replicas too) ends as pulled, once every reader was done."""
    prefill = _prefill(whole_kv(kv_heads, "cpu"), _args(kv_heads), *src)
    connectors += prefill.connectors
    read_cells(connectors, prefill, src, dst, kv_heads, "cpu")
    assert all(r.ok for r in prefill.releases()), "a lease did not end as pulled"
    for c in prefill.connectors:
        assert c.transport_stats().blocks_held == 0


# 1 -> 2 and 2 -> 1 (heads: through scratch), PP 2 -> 1 and 1 -> 2 (layers: straight into
# the pool), both at once, and replicated heads (1 x 4 of 2 heads: replicas released).
GRIDS = [
    ((1, 1), (1, 2), 4), ((1, 2), (1, 1), 4), ((2, 1), (1, 1), 4), ((1, 1), (2, 1), 4),
    ((2, 2), (1, 1), 4), ((1, 4), (1, 1), 2),
]  # fmt: skip


@pytest.mark.parametrize(("src", "dst", "kv_heads"), GRIDS)
def test_each_decode_process_reads_its_cells(
    connectors: list[NixlConnector], src: tuple[int, int], dst: tuple[int, int], kv_heads: int
) -> None:
    check_recut(connectors, src, dst, kv_heads)


def test_a_shared_lease_ends_after_its_last_reader(connectors: list[NixlConnector]) -> None:
    """1 -> 2: the one lease is read by both decode processes; the first ``done`` keeps it
    held (another reader's part is still to come), the second ends it."""
    args = _args(4)
    whole = torch.randn(LAYERS, 2, BLOCKS, BS, 4, DIM)
    prefill = _prefill(whole, args, 1, 1)
    connectors += prefill.connectors
    reshard = Reshard(prefill.fingerprint, grid_owned(args, 1, 1), grid_owned(args, 1, 2))
    caches = [torch.zeros(LAYERS, 2, BLOCKS, BS, 2, DIM) for _ in range(2)]
    c0, res0 = _load(caches[0], prefill, reshard, [0, 2, 3])
    connectors.append(c0)
    assert res0.ok, res0
    assert prefill.connectors[0].wait(1, 0.5) == []  # still held for rank 1
    reshard.dest_rank = 1
    c1, res1 = _load(caches[1], prefill, reshard, [5, 6, 7], start=1)  # block 0 cached there
    connectors.append(c1)
    assert res1.ok and res1.num_loaded_blocks == 2, res1
    assert torch.equal(caches[1][:, :, [6, 7]], whole[:, :, [4, 6], :, 2:4])
    assert not caches[1][:, :, 5].any()  # the cached block was not read
    (release,) = prefill.releases()
    assert release.ok


def test_a_dropped_request_ends_every_lease(connectors: list[NixlConnector]) -> None:
    """The decode dropped the request before loading: its load of no blocks (the engine's
    ``#drop``) pins nothing to read and ends each prefill process's lease at once."""
    args = _args(4)
    whole = torch.randn(LAYERS, 2, BLOCKS, BS, 4, DIM)
    prefill = _prefill(whole, args, 2, 2)
    connectors += prefill.connectors
    reshard = Reshard(prefill.fingerprint, grid_owned(args, 2, 2), grid_owned(args, 1, 1))
    cache = torch.zeros(LAYERS, 2, BLOCKS, BS, 4, DIM)
    c = _connector(cache, "decode")
    connectors.append(c)
    drop = KVTransfer("d#drop", [], [], [], [])
    drop.source_address, drop.transfer_id = prefill.handle
    drop.reshard = reshard.to_json()
    c.start_load(drop)
    (res,) = c.wait(1, 20)
    assert res.ok and res.num_loaded_blocks == 0, res
    assert all(r.ok for r in prefill.releases(5.0))
    assert not cache.any()


def test_a_source_of_another_model_is_refused(connectors: list[NixlConnector]) -> None:
    """A handle whose prefill processes run another model than the re-cut names: the pins
    are never sent (the cards' fingerprints differ), the load fails as ``layout`` and the
    leases stay held for a genuine reader."""
    args = _args(4)
    whole = torch.randn(LAYERS, 2, BLOCKS, BS, 4, DIM)
    prefill = _prefill(whole, args, 1, 2)
    connectors += prefill.connectors
    other = Reshard("e" * 32 + "-tp2", grid_owned(args, 1, 2), grid_owned(args, 1, 1))
    cache = torch.zeros(LAYERS, 2, BLOCKS, BS, 4, DIM)
    c, res = _load(cache, prefill, other, [0, 2, 3])
    connectors.append(c)
    assert not res.ok and res.failure_reason == "layout", res
    assert not cache.any()
    assert [p.transport_stats().blocks_held for p in prefill.connectors] == [3, 3]
