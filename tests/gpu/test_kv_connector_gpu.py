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
