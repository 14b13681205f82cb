"""KV transfer throughput: save + load per connector beside a plain in-memory copy.

    python -m benchmarks.kv.kv_transfer      # writes benchmarks/results/kv/kv_transfer.json

For each block shape (SmolLM2-135M fp32; Llama-3.1-8B bf16 = 128 KiB/token) and a prompt
of ``--tokens`` tokens (blocks of 16), it times ``start_save`` → result and ``start_load``
→ result through each connector (fs on /dev/shm, Redis on loopback, LMCache with an
``lmcache_server`` on loopback), each prompt fresh (no dedup hits), and the same bytes
copied block by block between two in-memory tensors ("memcpy"), and, with fs, the same
bytes through bare tmpfs syscalls ("tmpfs syscalls only": the floor under the fs
connector, see ``bench_tmpfs_raw``). It starts and stops its
own redis-server and lmcache_server. Reports GB/s (1e9 bytes/s, payload bytes) and the
per-block overhead versus memcpy. LMCache needs PYTHONHASHSEED=0 (re-exec'd if unset).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import platform
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
from kv_store.factory import KVStoreSettings, build_connector
from kv_store.record import block_parts, cache_numpy, copy_into
from tests.servers import start_lmcache, start_redis

REPO = Path(__file__).resolve().parents[2]

SHAPES = {
    "smollm2-135m-fp32": KvLayout(1, "float32", 16, 30, 3, 64),
    "llama3.1-8b-bf16": KvLayout(1, "bfloat16", 16, 32, 8, 128),
}


def make_cache(lay: KvLayout, blocks: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    shape = (lay.num_layers, 2, blocks, lay.block_size, lay.num_kv_heads, lay.head_dim)
    return torch.randn(shape, generator=g).to(getattr(torch, lay.dtype))


def make_transfer(rid: str, seed: int, n_tokens: int, lay: KvLayout) -> KVTransfer:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 32000, (n_tokens,), generator=g).tolist()
    hashes = compute_block_hashes(tokens, lay.block_size, include_partial=True)
    counts = [min(lay.block_size, n_tokens - i * lay.block_size) for i in range(len(hashes))]
    return KVTransfer(rid, tokens, hashes, list(range(len(hashes))), counts)


def bench_memcpy(src: torch.Tensor, dst: torch.Tensor, blocks: int) -> tuple[float, float]:
    """Block-by-block copy out of the cache into preallocated buffers, and back."""
    bufs = [torch.empty_like(src[:, :, 0]) for _ in range(blocks)]
    for b in range(blocks):  # touch pages once so neither side pays first-touch faults
        copy_into(bufs[b], src[:, :, b])
    t0 = time.perf_counter()
    for b in range(blocks):
        copy_into(bufs[b], src[:, :, b])
    t1 = time.perf_counter()
    for b in range(blocks):
        copy_into(dst[:, :, b], bufs[b])
    t2 = time.perf_counter()
    assert torch.equal(dst[:, :, :blocks], src[:, :, :blocks])
    return t1 - t0, t2 - t1


def bench_tmpfs_raw(
    src: torch.Tensor, dst: torch.Tensor, blocks: int, directory: Path
) -> tuple[float, float]:
    """The floor under the fs connector: the same block bytes written to new files on the
    same tmpfs (create, ``writev`` of the 2 × layers cache slices, close, rename) and read
    back (``readv`` into the cache), in one thread, with no header, checksum, thread pool
    or Python connector around it."""
    directory.mkdir(parents=True, exist_ok=True)
    src_np, dst_np = cache_numpy(src), cache_numpy(dst)
    assert src_np is not None and dst_np is not None
    names = [str(directory / f"b{b}") for b in range(blocks)]
    t0 = time.perf_counter()
    for b, name in enumerate(names):
        fd = os.open(name + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        os.writev(fd, block_parts(src_np, b, src.shape[3]))
        os.close(fd)
        os.replace(name + ".tmp", name)
    t1 = time.perf_counter()
    for b, name in enumerate(names):
        fd = os.open(name, os.O_RDONLY)
        os.readv(fd, block_parts(dst_np, b, dst.shape[3]))
        os.close(fd)
    t2 = time.perf_counter()
    assert torch.equal(dst[:, :, :blocks], src[:, :, :blocks])
    shutil.rmtree(directory, ignore_errors=True)
    return t1 - t0, t2 - t1


def bench_connector(
    settings: KVStoreSettings,
    lay: KvLayout,
    src: torch.Tensor,
    dst: torch.Tensor,
    tokens: int,
    seed: int,
) -> tuple[float, float]:
    producer, consumer = build_connector(settings), build_connector(settings)
    assert producer is not None and consumer is not None
    try:
        producer.bind_kv_cache(
            src, lay, f"bench-{lay.num_layers}x{lay.num_kv_heads}x{lay.head_dim}"
        )
        consumer.bind_kv_cache(
            dst, lay, f"bench-{lay.num_layers}x{lay.num_kv_heads}x{lay.head_dim}"
        )
        t = make_transfer(f"r{seed}", seed, tokens, lay)
        t0 = time.perf_counter()
        producer.start_save(t)
        (r,) = producer.wait(1, 600)  # type: ignore[attr-defined]
        t1 = time.perf_counter()
        assert r.ok and r.num_saved_blocks == len(t.block_ids), r
        dst.zero_()
        t2 = time.perf_counter()
        consumer.start_load(t)
        (r,) = consumer.wait(1, 600)  # type: ignore[attr-defined]
        t3 = time.perf_counter()
        assert r.ok and r.num_loaded_blocks == len(t.block_ids), r
        n = len(t.block_ids)
        assert torch.equal(dst[:, :, :n], src[:, :, :n]), "loaded bytes differ"
        return t1 - t0, t3 - t2
    finally:
        producer.close()
        consumer.close()


def mac_rates(size: int = 64 << 20, repeats: int = 5) -> dict[str, float]:
    """One core, data in memory: GB/s of the record MAC (keyed BLAKE3) beside HMAC-SHA256,
    the MAC of record version 3 it replaced, and the XXH3-64 checksum; best of ``repeats``."""
    import hashlib
    import hmac

    import xxhash
    from blake3 import blake3

    data = memoryview(os.urandom(size))
    key = b"k" * 32
    hashes = {
        "blake3_keyed": lambda: blake3(data, key=key).digest(16),
        "hmac_sha256": lambda: hmac.new(key, data, hashlib.sha256).digest(),
        "xxh3_64": lambda: xxhash.xxh3_64(data).digest(),
    }
    rates = {}
    for name, fn in hashes.items():
        best = math.inf
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        rates[name] = size / best / 1e9
    return rates


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {"tokens": args.tokens, "repeats": args.repeats, "rows": []}
    # On a shared machine the absolute numbers move with other work: record the load.
    load_before = os.getloadavg()
    if args.mac:
        results["mac_gbps_one_core"] = mac_rates()
    servers = []
    redis_url = lm_url = ""
    if "redis" in args.backends:
        redis_srv, redis_url = start_redis()
        servers.append(redis_srv)
    if "lmcache" in args.backends:
        lm_srv, lm_url = start_lmcache()
        servers.append(lm_srv)
    shm = Path(tempfile.mkdtemp(prefix="pdserve-kvbench-", dir="/dev/shm"))
    try:
        for shape_name in args.shapes:
            lay = SHAPES[shape_name]
            blocks = -(-args.tokens // lay.block_size)
            src = make_cache(lay, blocks, 0)
            dst = torch.empty_like(src)
            dst.zero_()  # touch every page now, not inside a timed load
            token_bytes = 2 * lay.num_layers * lay.num_kv_heads * lay.head_dim * src.element_size()
            payload = args.tokens * token_bytes
            timings: dict[str, list[tuple[float, float]]] = {}
            for rep in range(args.repeats):
                timings.setdefault("memcpy", []).append(bench_memcpy(src, dst, blocks))
                if "fs" in args.backends:
                    dst.zero_()
                    timings.setdefault("tmpfs syscalls only", []).append(
                        bench_tmpfs_raw(src, dst, blocks, shm / f"raw-{shape_name}-{rep}")
                    )
                sealed = [f"{n}+mac" for n in args.backends if args.mac and n != "lmcache"]
                for i, label in enumerate([*args.backends, *sealed]):
                    name = label.removesuffix("+mac")
                    # "+mac": the same connector with a KV secret (keyed BLAKE3 per record).
                    s = KVStoreSettings(name, kv_ttl=0, kv_capacity=0)
                    s.kv_secret = "bench-secret" if label != name else ""
                    if name == "fs":
                        s.kv_path = str(shm / f"{shape_name}-{rep}")
                    elif name == "redis":
                        s.redis_url = redis_url
                    elif name == "lmcache":
                        s.lmcache_url, s.kv_capacity = lm_url, 2 * payload + (64 << 20)
                    seed = 1000 * rep + 10 + i  # a fresh prompt per run: no dedup hits
                    timings.setdefault(label, []).append(
                        bench_connector(s, lay, src, dst, args.tokens, seed)
                    )
                    if name == "fs":
                        shutil.rmtree(s.kv_path or "", ignore_errors=True)
            base_save = statistics.median(t[0] for t in timings["memcpy"])
            base_load = statistics.median(t[1] for t in timings["memcpy"])
            for name, ts in timings.items():
                save, load = (
                    statistics.median(t[0] for t in ts),
                    statistics.median(t[1] for t in ts),
                )
                results["rows"].append(
                    {
                        "shape": shape_name,
                        "backend": name,
                        "blocks": blocks,
                        "payload_bytes": payload,
                        "block_bytes": lay.block_size * token_bytes,
                        "save_s": save,
                        "load_s": load,
                        "save_gbps": payload / save / 1e9,
                        "load_gbps": payload / load / 1e9,
                        "roundtrip_gbps": 2 * payload / (save + load) / 1e9,
                        "vs_memcpy_roundtrip": (base_save + base_load) / (save + load),
                        "save_overhead_us_per_block": (save - base_save) / blocks * 1e6,
                        "load_overhead_us_per_block": (load - base_load) / blocks * 1e6,
                    }
                )
            del src, dst
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        for srv in servers:
            srv.stop()
    results["machine"] = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }
    return results


def table(results: dict[str, Any]) -> str:
    lines = [
        "| shape | backend | save GB/s | load GB/s | round trip GB/s | vs memcpy | save µs/block over memcpy | load µs/block over memcpy |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["rows"]:
        lines.append(
            f"| {r['shape']} | {r['backend']} | {r['save_gbps']:.2f} | {r['load_gbps']:.2f} | "
            f"{r['roundtrip_gbps']:.2f} | {100 * r['vs_memcpy_roundtrip']:.0f}% | "
            f"{r['save_overhead_us_per_block']:.0f} | {r['load_overhead_us_per_block']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument(
        "--backends",
        nargs="+",
        default=["fs", "redis", "lmcache"],
        choices=["fs", "redis", "lmcache"],
    )
    p.add_argument(
        "--tokens", type=int, default=2048, help="prompt length (default 2048 = 128 blocks)"
    )
    p.add_argument("--repeats", type=int, default=3, help="median of this many runs")
    p.add_argument(
        "--mac", action="store_true", help="also time fs and redis with a KV secret (+mac rows)"
    )
    p.add_argument(
        "--json",
        type=Path,
        default=result_path("kv", "kv_transfer.json"),
        help="write the results here",
    )
    args = p.parse_args()
    if "lmcache" in args.backends and os.environ.get("PYTHONHASHSEED") != "0":
        # LMCache keys chunks by hash(): it needs a fixed seed, set before the interpreter starts.
        env = dict(os.environ, PYTHONHASHSEED="0", PYTHONPATH=str(REPO))
        argv = [sys.executable, "-m", "benchmarks.kv.kv_transfer", *sys.argv[1:]]
        os.execve(sys.executable, argv, env)
    if args.tokens < 1 or args.repeats < 1:
        p.error("--tokens and --repeats must be >= 1")
    logging.basicConfig(level=logging.WARNING)
    results = run(args)
    results["command"] = recorded_command("benchmarks.kv.kv_transfer")
    print(table(results))
    if "mac_gbps_one_core" in results:
        rates = ", ".join(f"{k} {v:.2f}" for k, v in results["mac_gbps_one_core"].items())
        print(f"one core, GB/s: {rates}")
    m = results["machine"]
    print(
        f"load average (1/5/15 min) before {m['load_average_before']}, after {m['load_average_after']}"
    )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
