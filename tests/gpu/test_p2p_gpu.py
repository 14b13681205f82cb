"""The p2p transport between two processes with CUDA caches.

- One GPU: both processes on cuda:0. NCCL refuses two ranks on one device, so ``auto`` picks
  CUDA IPC (the decode side maps the prefill's cache and copies on the device); a forced
  ``gloo`` stages through pinned host memory; a forced ``nccl`` is refused with a reason.
- Two GPUs or more: prefill on cuda:0, decode on cuda:1, over NCCL (``auto`` picks it);
  and a decode killed mid-transfer leaves the prefill process serving.

Each case moves bfloat16 blocks in several batches and checks them bit for bit. Runs under
pytest (``-m gpu``) or, on a machine that has only torch, as a script:

    PYTHONPATH=. python3 tests/gpu/test_p2p_gpu.py
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

from tests.integration.p2p_support import LAYOUT, Worker

# 32 layers x 2 x 16 tokens x 8 heads x 128 dims x 2 bytes = 2 MiB a block (Llama-8B-like).
GPU_LAYOUT = {**LAYOUT, "dtype": "bfloat16", "num_layers": 32, "num_kv_heads": 8, "head_dim": 128}
SRC = list(range(1, 40, 2))  # 20 blocks
DST = list(range(0, 40, 2))


def gpu_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def check_pair(log_dir: Path, src_dev: str, dst_dev: str, backend: str = "auto") -> dict:
    """Pull 20 blocks (8 MiB batches) from a cache on ``src_dev`` into one on ``dst_dev``."""
    common = {"layout": GPU_LAYOUT, "num_blocks": 48, "batch_bytes": 8 << 20, "backend": backend}
    prefill = Worker(log_dir, f"prefill-{backend}", seed=1, device=src_dev, **common)
    decode = Worker(log_dir, f"decode-{backend}", seed=2, device=dst_dev, **common)
    try:
        offer = prefill.offer("g", SRC)
        got = decode.call("pull", timeout=180, **decode.pull_args(prefill, offer, "g", SRC, DST))
        stats = decode.call("stats")["p2p"]
        return {**got, "pairs_made": stats["pairs_made"]}
    finally:
        prefill.stop()
        decode.stop()


def check_same_gpu(log_dir: Path) -> None:
    for backend in ("auto", "cuda_ipc", "gloo"):
        got = check_pair(log_dir, "cuda:0", "cuda:0", backend=backend)
        assert got["ok"] and got["loaded"] == len(SRC) and got["equal"], (backend, got)
    refused = check_pair(log_dir, "cuda:0", "cuda:0", backend="nccl")
    assert not refused["ok"] and refused["reason"] == "backend", refused


def check_two_gpus(log_dir: Path) -> None:
    got = check_pair(log_dir, "cuda:0", "cuda:1")
    assert got["ok"] and got["loaded"] == len(SRC) and got["equal"], got
    print(
        f"cuda:0 -> cuda:1 over NCCL: {got['bytes'] / got['seconds'] / 1e9:.2f} GB/s (incl. setup)"
    )


def check_nccl_peer_loss(log_dir: Path) -> None:
    """A decode process killed mid-transfer must not take the prefill process with it (NCCL's
    default error handling would): the prefill frees at lease end and serves a new peer."""
    from tests.integration.p2p_support import wait_for

    marker = log_dir / "sending"
    common = {"layout": GPU_LAYOUT, "num_blocks": 48, "batch_bytes": 8 << 20}
    slow = {"lease_s": 5.0, "slow_tag": 1, "slow_s": 2.0, "marker": str(marker)}
    prefill = Worker(log_dir, "prefill-loss", seed=1, device="cuda:0", **slow, **common)
    decode = Worker(log_dir, "decode-loss", seed=2, device="cuda:1", **common)
    try:
        offer = prefill.offer("lost", SRC)
        decode.send("pull", **decode.pull_args(prefill, offer, "lost", SRC, DST))
        wait_for(marker, 60)
        decode.kill()
        stats = prefill.call("wait_released", count=1, timeout=60)
        assert stats["releases"][0]["reason"] == "expired", stats
        assert stats["p2p"]["blocks_held"] == 0, stats
        marker.unlink()
        again = Worker(log_dir, "decode-again", seed=3, device="cuda:1", **common)
        try:
            offer = prefill.offer("next", SRC)
            args = again.pull_args(prefill, offer, "next", SRC, DST)
            got = again.call("pull", timeout=180, **args)
            assert got["ok"] and got["equal"], got
        finally:
            again.stop()
    finally:
        prefill.stop()
        decode.stop()


try:
    import pytest
except ImportError:  # a torch-only machine: run as a script
    pytest = None  # type: ignore[assignment]

if pytest is not None:
    pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

    def test_two_processes_one_gpu(tmp_path: Path) -> None:
        if gpu_count() < 1:
            pytest.skip("no CUDA GPU present (this test needs one)")
        check_same_gpu(tmp_path / "logs")

    def test_two_gpus_over_nccl(tmp_path: Path) -> None:
        if gpu_count() < 2:
            pytest.skip(f"needs 2 CUDA GPUs for NCCL between processes, found {gpu_count()}")
        check_two_gpus(tmp_path / "logs")

    def test_nccl_peer_loss_keeps_the_prefill(tmp_path: Path) -> None:
        if gpu_count() < 2:
            pytest.skip(f"needs 2 CUDA GPUs for NCCL between processes, found {gpu_count()}")
        check_nccl_peer_loss(tmp_path / "logs")


if __name__ == "__main__":
    n = gpu_count()
    if n < 1:
        print("SKIP: no CUDA GPU present")
        sys.exit(0)
    with tempfile.TemporaryDirectory() as tmp:
        check_same_gpu(Path(tmp) / "one-gpu")
        print("one GPU, two processes (CUDA IPC; gloo over pinned host memory): ok")
        if n >= 2:
            check_two_gpus(Path(tmp) / "two-gpus")
            print("two GPUs (NCCL): ok")
            check_nccl_peer_loss(Path(tmp) / "peer-loss")
            print("NCCL peer killed mid-transfer: the prefill survives and frees at lease end")
        else:
            print("SKIP two-GPU case: only one GPU")
