"""p2p KV handoff against raw send/recv of the same bytes, between two processes.

    python3 -m benchmarks.kv.kv_transfer_p2p    # writes benchmarks/results/kv/kv_transfer_p2p.json

Devices: two GPUs → prefill on cuda:0, decode on cuda:1 over NCCL; one GPU → both on cuda:0
by CUDA IPC (NCCL refuses two ranks on one GPU; raw is then one contiguous device copy out
of the peer's mapped buffer; ``--backend gloo`` for the host-staged path); no GPU → CPU over
gloo. Llama-3.1-8B KV
shape (32 layers, 8 KV heads x 128, bf16, 16-token blocks: 2 MiB a block); sizes 64 MiB,
512 MiB and 2 GiB by default (``--sizes``). A handoff is the whole pull as the decode engine
sees it — control messages, the gather into staging, the wire, the scatter into
non-contiguous blocks, the confirmation — timed from ``start_load`` to its result. Raw is
one send/recv of a contiguous tensor of the same bytes over a group of the same backend
(timed on the receiver from a go-signal to completion). Median of ``--repeats`` after one
warm-up (the warm-up also forms the pair, reported as ``setup_ms``). Needs only torch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.record import recorded_command, result_path
from common.sizes import parse_bytes
from kv_store.base import KvLayout, KVTransfer
from kv_store.p2p import P2PConnector
from kv_store.p2p.group import PairGroup, host_store

LAYOUT = KvLayout(1, "bfloat16", 16, 32, 8, 128)
BLOCK_BYTES = 32 * 2 * 16 * 8 * 128 * 2


def _hashes(rid: str, n: int) -> list[bytes]:
    return [hashlib.sha256(f"{rid}/{i}".encode()).digest() for i in range(n)]


def _transfer(rid: str, ids: list[int]) -> KVTransfer:
    return KVTransfer(rid, [], _hashes(rid, len(ids)), ids, [16] * len(ids))


def _cache(blocks: int, device: str, seed: int) -> torch.Tensor:
    shape = (32, 2, blocks, 16, 8, 128)
    g = torch.Generator(device=device).manual_seed(seed)
    return torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16)


def _ids(n: int, blocks: int, seed: int) -> list[int]:
    """``n`` distinct block ids in a shuffled order (a real request's blocks are scattered)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(blocks, generator=g)[:n].tolist()


def _raw_group(rank: int, q_out: Any, q_in: Any, backend: str) -> PairGroup:
    deadline = time.monotonic() + 120
    if rank == 0:
        store = host_store("127.0.0.1", 120)
        q_out.put(store.port)
    else:
        import datetime

        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", q_in.get(), None, False, datetime.timedelta(seconds=120))
    return PairGroup.create(store, "raw", rank, backend, "127.0.0.1", deadline)


def _side(
    rank: int,
    device: str,
    backend: str,
    sizes: list[int],
    repeats: int,
    q_out: Any,
    q_in: Any,
    results: Any,
) -> None:
    torch.set_num_threads(4)
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    blocks = max(sizes) // BLOCK_BYTES + 8
    kv = _cache(blocks, device, seed=rank)
    conn = P2PConnector(timeout_s=300.0, backend=backend)
    conn.bind_kv_cache(kv, LAYOUT, "bench")
    # Raw for cuda_ipc: one contiguous device copy out of the peer's mapped buffer.
    ipc = backend == "cuda_ipc"
    raw = None if ipc else _raw_group(rank, q_out, q_in, "nccl" if backend == "nccl" else "gloo")
    go = torch.zeros(1, device=device if backend == "nccl" else "cpu")
    out: list[dict[str, Any]] = []
    for size in sizes:
        n = size // BLOCK_BYTES
        row: dict[str, Any] = {"bytes": n * BLOCK_BYTES, "blocks": n, "handoff_s": [], "raw_s": []}
        flat = torch.empty(
            n * BLOCK_BYTES,
            dtype=torch.uint8,
            device=device if backend in ("nccl", "cuda_ipc") else "cpu",
        )
        peer_flat = None
        if ipc:  # torch's queue pickling shares a CUDA tensor by IPC handle
            if rank == 0:
                q_out.put(flat)
            else:
                peer_flat = q_in.get()
        for rep in range(repeats + 1):
            rid = f"s{size}-r{rep}"
            if rank == 0:
                conn.start_save(_transfer(rid, _ids(n, blocks, rep)))
                save = conn.wait(1, 60)[0]
                q_out.put((rid, save.source_address, save.transfer_id))
                q_in.get()  # the pull is done
                conn.wait(1, 60)  # its release
                if raw is None:
                    q_in.get()  # the peer's raw copy is done: ``flat`` may go
                else:
                    raw.wait(raw.recv(go, 0), time.monotonic() + 120)
                    raw.wait(raw.send(flat, 1), time.monotonic() + 300)
            else:
                rid, address, transfer_id = q_in.get()
                t = _transfer(rid, _ids(n, blocks, 1000 + rep))
                t.source_address, t.transfer_id = address, transfer_id
                t0 = time.perf_counter()
                conn.start_load(t)
                result = conn.wait(1, 300)[0]
                handoff = time.perf_counter() - t0
                assert result.ok and result.num_loaded_blocks == n, result
                q_out.put("done")
                t0 = time.perf_counter()
                if raw is None:
                    assert peer_flat is not None
                    flat.copy_(peer_flat)
                    torch.cuda.synchronize()
                    q_out.put("raw-done")
                else:
                    raw.wait(raw.send(go, 0), time.monotonic() + 120)
                    raw.wait(raw.recv(flat, 1), time.monotonic() + 300)
                if device.startswith("cuda"):
                    torch.cuda.synchronize()
                raw_s = time.perf_counter() - t0
                if rep == 0:
                    row["setup_ms"] = handoff * 1e3  # includes forming the pair (first size)
                else:
                    row["handoff_s"].append(handoff)
                    row["raw_s"].append(raw_s)
        out.append(row)
    if rank == 1:
        results.put(out)
    else:
        results.put(None)
    if raw is not None:
        raw.close()
    conn.close()


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    table = []
    for r in rows:
        h, w = statistics.median(r["handoff_s"]), statistics.median(r["raw_s"])
        table.append(
            {
                "size_mib": r["bytes"] / 2**20,
                "blocks": r["blocks"],
                "handoff_ms_p50": h * 1e3,
                "handoff_gbps": r["bytes"] / h / 1e9,
                "raw_ms_p50": w * 1e3,
                "raw_gbps": r["bytes"] / w / 1e9,
                "handoff_vs_raw": w / h,
                "first_pull_ms": r.get("setup_ms"),
            }
        )
    return table


def markdown(table: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"p2p handoff vs raw send/recv — {meta['devices']} over {meta['backend']}, "
        f"median of {meta['repeats']} (torch {meta['torch']})",
        "",
        "| KV | blocks | handoff p50 | handoff GB/s | raw p50 | raw GB/s | handoff / raw | first pull |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in table:
        first = f"{r['first_pull_ms']:.1f} ms" if r["first_pull_ms"] is not None else "-"
        lines.append(
            f"| {r['size_mib']:.0f} MiB | {r['blocks']} | {r['handoff_ms_p50']:.2f} ms | "
            f"{r['handoff_gbps']:.2f} | {r['raw_ms_p50']:.2f} ms | {r['raw_gbps']:.2f} | "
            f"{r['handoff_vs_raw']:.0%} | {first} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--sizes", default="64MiB,512MiB,2GiB")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl", "cuda_ipc"])
    ap.add_argument("--json", type=Path, default=result_path("kv", "kv_transfer_p2p.json"))
    ap.add_argument("--md", type=Path, help="also write the markdown table here")
    args = ap.parse_args()
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    devices = ["cuda:0", "cuda:1"] if gpus >= 2 else ["cuda:0"] * 2 if gpus == 1 else ["cpu"] * 2
    auto = "nccl" if gpus >= 2 else "cuda_ipc" if gpus == 1 else "gloo"
    backend = args.backend if args.backend != "auto" else auto
    sizes = [parse_bytes(s) for s in args.sizes.split(",")]
    ctx = mp.get_context("spawn")
    to_decode, to_prefill, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(
            target=_side,
            args=(0, devices[0], backend, sizes, args.repeats, to_decode, to_prefill, results),
        ),
        ctx.Process(
            target=_side,
            args=(1, devices[1], backend, sizes, args.repeats, to_prefill, to_decode, results),
        ),
    ]
    for p in procs:
        p.start()
    rows = [r for r in (results.get(timeout=3600) for _ in procs) if r is not None][0]
    for p in procs:
        p.join(timeout=60)
    meta = {
        "command": recorded_command("benchmarks.kv.kv_transfer_p2p"),
        "devices": " -> ".join(devices),
        "backend": backend,
        "repeats": args.repeats,
        "torch": torch.__version__,
    }
    table = summarize(rows)
    md = markdown(table, meta)
    print(md)
    if args.json:
        args.json.write_text(
            json.dumps({"meta": meta, "rows": table, "raw": rows}, indent=2) + "\n"
        )
    if args.md:
        args.md.write_text(md)


if __name__ == "__main__":
    main()
