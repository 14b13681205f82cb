"""Fixtures of the C decode-kernel tests: the built kernel, and torch's thread count."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine.attention.cpu_kernels import DecodeKernel, load_decode_kernel


@pytest.fixture(scope="module")
def kernel() -> DecodeKernel:
    k = load_decode_kernel()
    assert k is not None, "the C kernel must build here (cc is installed)"
    return k


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """With 7 requests, 1 thread makes each request one work item and 2 threads split
    requests by KV head (fewer than 4 requests per thread): both layouts get checked."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)
