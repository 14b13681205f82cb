"""CUDA IPC between two processes on one GPU (kv_store/p2p/ipc.py): the decode-side process
maps the prefill-side process's cache and copies leased blocks bit-exact, at device speed."""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no CUDA GPU present (these tests need one)"
    ),
]

SHAPE = (4, 2, 64, 16, 2, 64)  # [layers, 2, blocks, block, kv heads, head dim]
SRC_IDS = [5, 17, 3, 40, 41, 63]
DST_IDS = [0, 9, 22, 23, 50, 1]


def _owner(conn: Any, dtype_name: str) -> None:
    """Holds a random cache, shares it, answers with the checksum of chosen blocks."""
    from kv_store.p2p.ipc import describe_cache

    dtype = getattr(torch, dtype_name)
    kv = torch.randn(SHAPE, device="cuda", dtype=torch.float32).to(dtype)
    torch.cuda.synchronize()
    conn.send(describe_cache(kv))
    conn.send(kv[:, :, SRC_IDS].float().cpu())
    conn.recv()  # keep the cache alive until the peer has copied
    conn.close()


def _run_pair(dtype_name: str) -> None:
    from kv_store.p2p.ipc import copy_blocks, open_cache

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_owner, args=(child, dtype_name))
    proc.start()
    try:
        assert parent.poll(120), "the cache owner did not share its cache in time"
        desc = parent.recv()
        expected = parent.recv()
        src = open_cache(desc, torch.device("cuda"))
        dst = torch.full(SHAPE, float("nan"), device="cuda").to(getattr(torch, dtype_name))
        copy_blocks(src, SRC_IDS, dst, DST_IDS, torch.cuda.Stream(), batch_blocks=4)
        got = dst[:, :, DST_IDS].float().cpu()
        assert torch.equal(got, expected)
        untouched = [b for b in range(SHAPE[2]) if b not in DST_IDS]
        assert torch.isnan(dst[:, :, untouched].float()).all(), "a block outside the copy changed"
        parent.send("done")
    finally:
        proc.join(60)
        if proc.is_alive():
            proc.kill()
    assert proc.exitcode == 0


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float32"])
def test_ipc_copy_between_processes_is_bit_exact(dtype_name: str) -> None:
    _run_pair(dtype_name)


def test_open_cache_refuses_a_malformed_description() -> None:
    from kv_store.p2p.ipc import describe_cache, open_cache

    kv = torch.zeros(SHAPE, device="cuda", dtype=torch.bfloat16)
    desc = describe_cache(kv)
    with pytest.raises(ValueError):
        open_cache({**desc, "shape": [1, 2, 3]}, torch.device("cuda"))
    with pytest.raises(ValueError):
        open_cache({**desc, "dtype": "int64"}, torch.device("cuda"))
    with pytest.raises(ValueError):
        open_cache({**desc, "handle": "not base64!"}, torch.device("cuda"))
