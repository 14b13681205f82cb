"""Tensor-parallel start-up checks that need no GPU: which GPU each rank takes and the
refusal of a size the visible GPUs cannot hold (``engine/tp_procs.py``)."""

from __future__ import annotations

import pytest

from engine.tp_procs import check_gpus, device_for_rank


def test_each_rank_takes_the_next_gpu() -> None:
    assert [device_for_rank("cuda", r) for r in range(3)] == ["cuda:0", "cuda:1", "cuda:2"]
    assert [device_for_rank("cuda:2", r) for r in range(2)] == ["cuda:2", "cuda:3"]
    assert device_for_rank("cpu", 1) == "cpu"


@pytest.mark.parametrize(
    "device, size, available",
    [("cuda", 2, 2), ("cuda", 4, 8), ("cuda:4", 4, 8), ("cuda:1", 1, 2)],
)
def test_enough_gpus_pass(device: str, size: int, available: int) -> None:
    check_gpus(device, size, available)


@pytest.mark.parametrize(
    "device, size, available, message",
    [
        ("cuda", 2, 0, r"needs 2 GPUs, but no GPU is visible .*CUDA_VISIBLE_DEVICES"),
        ("cuda", 2, 1, r"needs GPUs 0\.\.1, but only 1 are visible .* <= 1 from cuda"),
        ("cuda:1", 2, 2, r"needs GPUs 1\.\.2, .* <= 1 from cuda:1, a lower starting GPU"),
        ("cuda:6", 4, 8, r"needs GPUs 6\.\.9, but only 8 are visible \(0\.\.7\)"),
        ("cuda:3", 2, 2, r"cuda:3 does not exist: 2 GPU\(s\) are visible \(0\.\.1\)"),
    ],
)
def test_too_few_gpus_are_refused_clearly(
    device: str, size: int, available: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        check_gpus(device, size, available)
