"""KV connectors with the paged cache on the GPU (the deployment case): blocks saved from
a CUDA cache load bit-exact into another CUDA cache, and records are device-independent
(a CUDA cache's blocks load into a CPU cache and back)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.integration.test_kv_contract import (
    BS,
    Target,
    layout,
    one,
    prompt,
    random_cache,
    transfer,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA GPU present (these tests need one)"
    ),
]


def _roundtrip(t: Target, dtype: str, src_device: str, dst_device: str) -> None:
    lay = layout(dtype)
    src = random_cache(lay, 10, seed=3).to(src_device)
    tokens = prompt(7, 2 * BS + 5)  # two full blocks and a 5-token tail
    saver = t.connector(src, lay)
    saver.start_save(transfer("g1", tokens, [4, 9, 1]))
    r = one(saver)
    assert r.ok and r.num_saved_blocks == 3, r
    dst = torch.zeros_like(src, device=dst_device)
    loader = t.connector(dst, lay)
    loader.start_load(transfer("g1", tokens, [2, 0, 6]))
    r = one(loader)
    assert r.ok and r.num_loaded_blocks == 3, r
    got, want = dst.cpu(), src.cpu()
    assert torch.equal(got[:, :, 2], want[:, :, 4]) and torch.equal(got[:, :, 0], want[:, :, 9])
    assert torch.equal(got[:, :, 6, :5], want[:, :, 1, :5])
    assert not got[:, :, 6, 5:].any() and not got[:, :, [1, 3, 4, 5, 7, 8, 9]].any()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fs_roundtrip_between_cuda_caches(tmp_path: Path, dtype: str) -> None:
    t = Target("fs", str(tmp_path))
    try:
        _roundtrip(t, dtype, "cuda", "cuda")
    finally:
        t.close()


@pytest.mark.parametrize(("src", "dst"), [("cuda", "cpu"), ("cpu", "cuda")])
def test_fs_records_are_device_independent(tmp_path: Path, src: str, dst: str) -> None:
    t = Target("fs", str(tmp_path))
    try:
        _roundtrip(t, "bfloat16", src, dst)
    finally:
        t.close()


@pytest.mark.parametrize("staged", [True, False])
def test_block_paths_on_gpu_match(tmp_path: Path, staged: bool) -> None:
    """Both GPU paths (staged batches, the default; per-block copies) save and load the
    same bytes, a partial tail included, and read each other's records."""
    from kv_store.block_connector import BlockStoreConnector
    from kv_store.fs_backend import FsBackend

    lay = layout("bfloat16")
    src = random_cache(lay, 10, seed=4).cuda()
    tokens = prompt(9, 4 * BS + 3)
    saver = BlockStoreConnector(FsBackend(tmp_path), batch_blocks=2, staged=staged)
    loader = BlockStoreConnector(FsBackend(tmp_path), batch_blocks=3, staged=not staged)
    try:
        saver.bind_kv_cache(src, lay, "fp-gpu")
        saver.start_save(transfer("p1", tokens, [9, 1, 4, 6, 0]))
        assert one(saver).ok
        dst = torch.zeros_like(src)
        loader.bind_kv_cache(dst, lay, "fp-gpu")
        loader.start_load(transfer("p1", tokens, [2, 3, 5, 7, 8]))
        r = one(loader)
        assert r.ok and r.num_loaded_blocks == 5, r
        got, want = dst.cpu(), src.cpu()
        for a, b in ((9, 2), (1, 3), (4, 5), (6, 7)):
            assert torch.equal(got[:, :, b], want[:, :, a])
        assert torch.equal(got[:, :, 8, :3], want[:, :, 0, :3]) and not got[:, :, 8, 3:].any()
        assert not got[:, :, [0, 1, 4, 6, 9]].any()
    finally:
        saver.close()
        loader.close()
