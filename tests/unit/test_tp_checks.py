"""Rank 0's side of the worker processes without a GPU (``engine/executor/tp/procs.py``): which GPU
each rank takes, the refusal of a size the visible GPUs cannot hold, and the bounded pipe
writes that hand out each step's inputs."""

from __future__ import annotations

import os
import threading

import pytest

from engine.executor.tp.procs import check_gpus, device_for_rank, open_pipe, write_all


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


def test_write_all_delivers_everything_through_a_small_pipe() -> None:
    read_fd, write_fd = os.pipe()
    open_pipe(write_fd, size=4096)  # smaller than the message: the writer must wait
    message = bytes(range(256)) * 2048  # 512 KiB
    got = bytearray()

    def drain() -> None:
        with os.fdopen(read_fd, "rb") as reader:
            while chunk := reader.read(65536):
                got.extend(chunk)

    reader = threading.Thread(target=drain)
    reader.start()
    try:
        write_all(write_fd, message, timeout_s=60)
    finally:
        os.close(write_fd)
        reader.join(60)
    assert bytes(got) == message


def test_write_all_to_a_reader_that_stopped_reading_times_out() -> None:
    read_fd, write_fd = os.pipe()
    try:
        open_pipe(write_fd, size=4096)
        with pytest.raises(TimeoutError, match="read nothing from its pipe for 0.2 s"):
            write_all(write_fd, b"x" * (1 << 20), timeout_s=0.2)
    finally:
        os.close(read_fd)
        os.close(write_fd)


def test_write_all_to_a_closed_reader_is_a_broken_pipe() -> None:
    read_fd, write_fd = os.pipe()
    os.close(read_fd)
    try:
        open_pipe(write_fd)
        with pytest.raises(BrokenPipeError):
            write_all(write_fd, b"step", timeout_s=5)
    finally:
        os.close(write_fd)
