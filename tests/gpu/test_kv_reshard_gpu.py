"""KV between unlike grids with the decode's cache on the GPU (docs/design.md §3 "KV
between unlike grids"): fs records of a prefill grid (TP 2, TP 1, PP 2) re-cut into CUDA
caches of another grid, bit-exact with the whole cache's cells."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from common.block_hash import compute_block_hashes
from engine.kv.reshard import grid_owned
from kv_store.base import KVTransfer
from kv_store.reshard import Reshard
from tests.unit.test_kv_reshard import BS, DIM, HEADS, LAYERS, _args, _connector, _save_grid

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA GPU present (these tests need one)"
    ),
]


@pytest.mark.parametrize(("src", "dst"), [((1, 2), (1, 1)), ((1, 1), (1, 2)), ((2, 1), (1, 2))])
def test_fs_recut_into_a_cuda_cache(
    tmp_path: Path, src: tuple[int, int], dst: tuple[int, int]
) -> None:
    torch.manual_seed(0)
    whole = torch.randn(LAYERS, 2, 8, BS, HEADS, DIM)
    tokens = list(range(2 * BS + 1))
    hashes = compute_block_hashes(tokens, BS, include_partial=True)
    source_fp = _save_grid(
        tmp_path, whole, *src, KVTransfer("s", tokens, hashes, [1, 4, 6], [BS, BS, 1])
    )
    args = _args()
    reshard = Reshard(source_fp, grid_owned(args, *src), grid_owned(args, *dst))
    for rank, o in enumerate(reshard.dests):
        reshard.dest_rank = rank
        cache = torch.zeros(o.num_layers, 2, 8, BS, o.num_heads, DIM, device="cuda")
        c = _connector(tmp_path, cache, o.num_layers, o.num_heads, "mine")
        try:
            load = KVTransfer("d", tokens, hashes, [0, 2, 3], [BS, BS, 1])
            load.reshard = reshard.to_json()
            c.start_load(load)
            (res,) = c.wait(1, 30)
        finally:
            c.close()
        assert res.ok and res.num_loaded_blocks == 3, res
        want = whole[o.layer_start : o.layer_end, :, :, :, o.head_start : o.head_end]
        got = cache.cpu()
        assert torch.equal(got[:, :, [0, 2]], want[:, :, [1, 4]])
        assert torch.equal(got[:, :, 3, :1], want[:, :, 6, :1])
