"""The staged block path (what a GPU cache uses: each batch of blocks gathered into a host
buffer in one copy, and loaded records scattered back in one), run here on a CPU cache by
forcing ``staged=True``, against a real fs directory and a real redis-server. The GPU run
of the same path is tests/gpu/test_kv_connector_gpu.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kv_store.block_connector import BlockStoreConnector
from kv_store.fs_backend import FsBackend
from kv_store.redis_backend import RedisBackend
from tests.integration.test_kv_contract import BS, layout, one, prompt, random_cache, transfer


@pytest.fixture(params=["fs", "redis"])
def make_backend(request: pytest.FixtureRequest, tmp_path: Path) -> Any:
    if request.param == "fs":
        return lambda: FsBackend(tmp_path / "store")
    url = request.getfixturevalue("redis_server")
    return lambda: RedisBackend(url, key_prefix="staged:")


def _connector(make_backend: Any, cache: torch.Tensor, dtype: str, staged: bool) -> Any:
    conn = BlockStoreConnector(make_backend(), batch_blocks=3, staged=staged)
    conn.bind_kv_cache(cache, layout(dtype), "fp-staged")
    return conn


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    ("save_staged", "load_staged"), [(True, True), (True, False), (False, True)]
)
def test_staged_roundtrip_is_exact_and_interoperates(
    make_backend: Any, dtype: str, save_staged: bool, load_staged: bool
) -> None:
    """7 blocks (batches of 3, 3, 1) with a partial tail; records written by one path read
    back by the other, bit-exact, touching only the target blocks' tokens."""
    lay = layout(dtype)
    src = random_cache(lay, 12, seed=5)
    tokens = prompt(5, 6 * BS + 9)
    src_ids, dst_ids = [3, 11, 0, 7, 5, 9, 2], [1, 4, 6, 8, 10, 2, 5]
    saver = _connector(make_backend, src, dtype, save_staged)
    loader = None
    try:
        saver.start_save(transfer("s1", tokens, src_ids))
        r = one(saver)
        assert r.ok and r.num_saved_blocks == 7, r
        dst = torch.zeros_like(src)
        loader = _connector(make_backend, dst, dtype, load_staged)
        loader.start_load(transfer("s1", tokens, dst_ids))
        r = one(loader)
        assert r.ok and r.num_loaded_blocks == 7, r
        for a, b in zip(src_ids[:-1], dst_ids[:-1], strict=True):
            assert torch.equal(dst[:, :, b], src[:, :, a])
        assert torch.equal(dst[:, :, 5, :9], src[:, :, 2, :9])
        assert not dst[:, :, 5, 9:].any(), "a partial load must not write past its tokens"
        assert not dst[:, :, [0, 3, 7, 9, 11]].any(), "only the target blocks may change"
    finally:
        saver.close()
        if loader is not None:
            loader.close()


def test_staged_load_stops_at_a_missing_block(make_backend: Any) -> None:
    """Blocks after a missing one are not counted (nor scattered as loaded)."""
    lay = layout()
    src = random_cache(lay, 8, seed=6)
    tokens = prompt(6, 5 * BS)
    saver = _connector(make_backend, src, "float32", True)
    loader = None
    try:
        saver.start_save(transfer("m1", tokens[: 2 * BS], [0, 1]))  # only the first 2 blocks
        assert one(saver).ok
        dst = torch.zeros_like(src)
        loader = _connector(make_backend, dst, "float32", True)
        loader.start_load(transfer("m1", tokens, [2, 3, 4, 5, 6]))
        r = one(loader)
        assert not r.ok and r.num_loaded_blocks == 2 and r.failure_reason == "missing", r
        assert torch.equal(dst[:, :, 2], src[:, :, 0]) and torch.equal(dst[:, :, 3], src[:, :, 1])
        assert not dst[:, :, 4].any(), "the missing block's slot must not be written"
    finally:
        saver.close()
        if loader is not None:
            loader.close()
