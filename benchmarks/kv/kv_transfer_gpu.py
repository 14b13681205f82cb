"""KV transfer with the paged cache on a GPU: the fs connector's staged path (each batch of
blocks gathered on the device and copied out in one transfer; loads copied in with one
transfer and scattered on the device) against per-block copies, and a plain device→host→
device copy of the same bytes through pinned memory as the reference.

    python3 -m benchmarks.kv.kv_transfer_gpu    # writes benchmarks/results/kv/kv_transfer_gpu.json

Llama-3.1-8B KV shape (32 layers, 8 KV heads × 128, bf16: 128 KiB per token), a 4096-token
prompt (256 blocks, 512 MiB: the two-GPU benchmark's prompt), fs store on /dev/shm.
Median of ``--repeats`` runs; every prompt is new to the store.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.record import recorded_command, result_path
from common.block_hash import compute_block_hashes
from kv_store.base import KvLayout, KVTransfer
from kv_store.block_connector import BlockStoreConnector
from kv_store.fs_backend import FsBackend

LAYOUT = KvLayout(1, "bfloat16", 16, 32, 8, 128)


def transfer(seed: int, tokens: int, blocks: list[int]) -> KVTransfer:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 120000, (tokens,), generator=g).tolist()
    hashes = compute_block_hashes(ids, LAYOUT.block_size, include_partial=True)
    counts = [min(16, tokens - i * 16) for i in range(len(hashes))]
    return KVTransfer(f"r{seed}", ids, hashes, blocks, counts)


def pinned_roundtrip(src: torch.Tensor, blocks: int) -> tuple[float, float]:
    """Reference: the blocks gathered and copied to pinned host memory, and back."""
    ids = torch.arange(blocks, device=src.device)
    host = torch.empty((*src.shape[:2], blocks, *src.shape[3:]), dtype=src.dtype, pin_memory=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    host.copy_(src.index_select(2, ids))
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    src.index_copy_(2, ids, host.to(src.device, non_blocking=True))
    torch.cuda.synchronize()
    return t1 - t0, time.perf_counter() - t1


def connector_roundtrip(
    src: torch.Tensor, dst: torch.Tensor, root: Path, staged: bool, seed: int, tokens: int
) -> tuple[float, float]:
    blocks = list(range(-(-tokens // 16)))
    t = transfer(seed, tokens, blocks)
    saver = BlockStoreConnector(FsBackend(root), staged=staged)
    loader = BlockStoreConnector(FsBackend(root), staged=staged)
    try:
        saver.bind_kv_cache(src, LAYOUT, "bench-gpu")
        loader.bind_kv_cache(dst, LAYOUT, "bench-gpu")
        t0 = time.perf_counter()
        saver.start_save(t)
        (r,) = saver.wait(1, 600)
        t1 = time.perf_counter()
        assert r.ok, r
        dst.zero_()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        loader.start_load(t)
        (r,) = loader.wait(1, 600)
        t3 = time.perf_counter()
        assert r.ok and r.num_loaded_blocks == len(blocks), r
        assert torch.equal(dst[:, :, : len(blocks)], src[:, :, : len(blocks)])
        return t1 - t0, t3 - t2
    finally:
        saver.close()
        loader.close()
        shutil.rmtree(root, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path, default=result_path("kv", "kv_transfer_gpu.json"))
    p.add_argument("--md", type=Path, help="also write the markdown table here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs a CUDA GPU")
    blocks = -(-args.tokens // 16)
    shape = (32, 2, blocks + 8, 16, 8, 128)
    src = torch.randn(shape, device="cuda").to(torch.bfloat16)
    dst = torch.zeros_like(src)
    payload = args.tokens * 2 * 32 * 8 * 128 * 2
    rows: dict[str, list[tuple[float, float]]] = {}
    shm = Path(tempfile.mkdtemp(prefix="pdserve-kvgpu-", dir="/dev/shm"))
    try:
        for rep in range(args.repeats):
            rows.setdefault("pinned copy (reference)", []).append(pinned_roundtrip(src, blocks))
            for name, staged in (("fs, staged batches", True), ("fs, per-block copies", False)):
                root = shm / f"{rep}-{staged}"
                rows.setdefault(name, []).append(
                    connector_roundtrip(src, dst, root, staged, 100 * rep + staged, args.tokens)
                )
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    result: dict[str, Any] = {
        "command": recorded_command("benchmarks.kv.kv_transfer_gpu"),
        "tokens": args.tokens,
        "payload_bytes": payload,
        "rows": {},
    }
    lines = [
        f"KV of a {args.tokens}-token prompt, Llama-3.1-8B shape, bf16 ({payload / 2**20:.0f} MiB),"
        f" {torch.cuda.get_device_name()}, median of {args.repeats}:",
        "",
        "| path | save ms | load ms | save GB/s | load GB/s |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, ts in rows.items():
        save = statistics.median(t[0] for t in ts)
        load = statistics.median(t[1] for t in ts)
        result["rows"][name] = {"save_s": save, "load_s": load}
        lines.append(
            f"| {name} | {save * 1e3:.1f} | {load * 1e3:.1f} | {payload / save / 1e9:.2f} |"
            f" {payload / load / 1e9:.2f} |"
        )
    md = "\n".join(lines) + "\n"
    print(md)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    if args.md:
        args.md.write_text(md)


if __name__ == "__main__":
    main()
