"""KV between unlike grids (docs/design.md §3 "KV between unlike grids"): which cells of
which prefill process each decode process takes (``kv_store/reshard.py``, the grids from
``engine/kv/reshard.py``), and a store load that re-cuts real fs records into caches of
another split, byte for byte the same KV as the whole cache holds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.block_hash import compute_block_hashes
from engine.kv.reshard import grid_owned
from engine.models import ModelArgs
from kv_store.base import KvLayout, KVTransfer, rank_fingerprint
from kv_store.block_connector import BlockStoreConnector
from kv_store.fs_backend import FsBackend
from kv_store.reshard import Owned, Reshard, covered

BS, LAYERS, HEADS, DIM = 4, 4, 4, 2
FP = "f" * 32


def _args(kv_heads: int = HEADS) -> ModelArgs:
    return ModelArgs(
        architecture="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
        num_layers=LAYERS, num_heads=8, num_kv_heads=kv_heads, head_dim=DIM,
        rms_norm_eps=1e-5, rope_theta=1e4,
    )  # fmt: skip


def test_grids_name_layers_and_heads_in_global_rank_order() -> None:
    assert grid_owned(_args(), 2, 2) == [
        Owned(0, 2, 0, 2), Owned(0, 2, 2, 4), Owned(2, 4, 0, 2), Owned(2, 4, 2, 4)
    ]  # fmt: skip
    # Fewer KV heads than ranks: each head replicated on 2 ranks.
    assert grid_owned(_args(kv_heads=2), 1, 4) == [
        Owned(0, 4, 0, 1), Owned(0, 4, 0, 1), Owned(0, 4, 1, 2), Owned(0, 4, 1, 2)
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("src", "dst", "kv_heads"),
    [((1, 1), (1, 2), 4), ((1, 2), (1, 1), 4), ((2, 1), (1, 1), 4), ((2, 2), (1, 4), 4),
     ((1, 4), (2, 1), 2), ((1, 1), (1, 4), 2), ((1, 4), (1, 2), 2)],
)  # fmt: skip
def test_every_decode_cell_comes_from_exactly_one_prefill_process(
    src: tuple[int, int], dst: tuple[int, int], kv_heads: int
) -> None:
    args = _args(kv_heads)
    r = Reshard(FP, grid_owned(args, *src), grid_owned(args, *dst))
    for rank, mine in enumerate(r.dests):
        r.dest_rank = rank
        assert covered(r)
        cells = []
        for p in r.pieces():
            s = r.sources[p.source]
            for layer in range(p.src_layers.start, p.src_layers.stop):
                for head in range(p.src_heads.start, p.src_heads.stop):
                    cells.append((s.layer_start + layer, s.head_start + head))
            # The destination slices name the same global cells.
            assert p.dst_layers.start + mine.layer_start == p.src_layers.start + s.layer_start
            assert p.dst_heads.start + mine.head_start == p.src_heads.start + s.head_start
        want = [(la, h) for la in range(mine.layer_start, mine.layer_end)
                for h in range(mine.head_start, mine.head_end)]  # fmt: skip
        assert sorted(cells) == want  # each once, none missing


def _layout(layers: int, heads: int) -> KvLayout:
    return KvLayout(1, "float32", BS, layers, heads, DIM)


def _connector(
    root: Path, cache: torch.Tensor, layers: int, heads: int, fp: str
) -> BlockStoreConnector:
    c = BlockStoreConnector(FsBackend(str(root)), name="fs")
    c.bind_kv_cache(cache, _layout(layers, heads), fp)
    return c


def _save_grid(root: Path, whole: torch.Tensor, pp: int, tp: int, t: KVTransfer) -> str:
    """Save ``whole``'s blocks as a P x N prefill's processes would; returns its fingerprint."""
    grid = grid_owned(_args(), pp, tp)
    fp = FP + (f"-pp{pp}" if pp > 1 else "") + (f"-tp{tp}" if tp > 1 else "")
    for g, o in enumerate(grid):
        shard = whole[o.layer_start : o.layer_end, :, :, :, o.head_start : o.head_end].contiguous()
        c = _connector(root, shard, o.num_layers, o.num_heads, rank_fingerprint(fp, g, len(grid)))
        try:
            c.start_save(t)
            (res,) = c.wait(1, 10)
            assert res.ok, res
        finally:
            c.close()
    return fp


@pytest.mark.parametrize(("src", "dst"), [((1, 2), (1, 1)), ((1, 1), (1, 2)), ((2, 1), (1, 2))])
def test_fs_load_recuts_the_records_of_another_grid(
    tmp_path: Path, src: tuple[int, int], dst: tuple[int, int]
) -> None:
    torch.manual_seed(0)
    whole = torch.randn(LAYERS, 2, 8, BS, HEADS, DIM)
    tokens = list(range(2 * BS + 1))  # two full blocks and a partial one
    hashes = compute_block_hashes(tokens, BS, include_partial=True)
    save = KVTransfer("s", tokens, hashes, [1, 4, 6], [BS, BS, 1])
    source_fp = _save_grid(tmp_path, whole, *src, save)
    args = _args()
    reshard = Reshard(source_fp, grid_owned(args, *src), grid_owned(args, *dst))
    for rank, o in enumerate(reshard.dests):
        reshard.dest_rank = rank
        cache = torch.zeros(o.num_layers, 2, 8, BS, o.num_heads, DIM)
        c = _connector(tmp_path, cache, o.num_layers, o.num_heads, "mine")
        try:
            load = KVTransfer("d", tokens, hashes, [0, 2, 3], [BS, BS, 1])
            load.reshard = reshard.to_json()
            c.start_load(load)
            (res,) = c.wait(1, 10)
        finally:
            c.close()
        assert res.ok and res.num_loaded_blocks == 3, res
        want = whole[o.layer_start : o.layer_end, :, :, :, o.head_start : o.head_end]
        assert torch.equal(cache[:, :, [0, 2]], want[:, :, [1, 4]])
        assert torch.equal(cache[:, :, 3, :1], want[:, :, 6, :1])


def test_fs_recut_load_stops_at_a_block_one_source_lacks(tmp_path: Path) -> None:
    whole = torch.randn(LAYERS, 2, 8, BS, HEADS, DIM)
    tokens = list(range(3 * BS))
    hashes = compute_block_hashes(tokens, BS, include_partial=True)
    source_fp = _save_grid(
        tmp_path, whole, 1, 2, KVTransfer("s", tokens, hashes, [1, 2, 3], [BS] * 3)
    )
    from kv_store.keys import block_key

    FsBackend(str(tmp_path)).delete([block_key(f"{source_fp}-r1", hashes[1])])
    args = _args()
    reshard = Reshard(source_fp, grid_owned(args, 1, 2), grid_owned(args, 1, 1))
    cache = torch.zeros(LAYERS, 2, 8, BS, HEADS, DIM)
    c = _connector(tmp_path, cache, LAYERS, HEADS, "mine")
    try:
        load = KVTransfer("d", tokens, hashes, [4, 5, 6], [BS] * 3)
        load.reshard = reshard.to_json()
        c.start_load(load)
        (res,) = c.wait(1, 10)
    finally:
        c.close()
    assert not res.ok and res.num_loaded_blocks == 1 and res.failure_reason == "missing"


def test_p2p_pulls_share_a_lease_several_decode_processes_need() -> None:
    """1 x 1 -> 1 x 2: both decode ranks pull the one lease; 1 x 4 replicas -> 1 x 1:
    decode rank 0 pulls the distinct ones and ends the replicas' leases with empty pulls."""
    args = _args()
    r = Reshard(FP, grid_owned(args, 1, 1), grid_owned(args, 1, 2))
    for rank in (0, 1):
        r.dest_rank = rank
        assert r.pulls() == [(0, 2, True)]
    two = _args(kv_heads=2)
    r = Reshard(FP, grid_owned(two, 1, 4), grid_owned(two, 1, 1))
    assert r.pulls() == [(0, 1, True), (2, 1, True), (1, 1, False), (3, 1, False)]


def test_a_shared_lease_ends_after_its_last_puller() -> None:
    from kv_store.p2p.leases import LeaseTable
    from kv_store.p2p.stats import P2PCounters
    from kv_store.p2p.wire import PeerError
    from kv_store.stats import ConnectorStats

    ended: list[str] = []
    table = LeaseTable(30, P2PCounters(ConnectorStats()), lambda _lease, why: ended.append(why))
    lease = table.offer("r", [1, 2], [b"a", b"b"], None)
    first = table.pin(lease.transfer_id, 2)
    second = table.pin(lease.transfer_id, 2)  # at once: the lease is shared by two
    with pytest.raises(PeerError):
        table.pin(lease.transfer_id, 2)  # a third is one too many
    assert table.unpin(first, "pulled") is None and ended == []
    assert table.unpin(second, "pulled") == "pulled" and ended == ["pulled"]
    alone = table.offer("s", [3], [b"c"], None)
    table.pin(alone.transfer_id)
    with pytest.raises(PeerError):
        table.pin(alone.transfer_id)  # not shared: busy, as before
