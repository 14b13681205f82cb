"""The record MAC's algorithm, A/B on the real Redis path: one process, one redis-server,
the same connector saving and loading a 2048-token prompt, rounds interleaved so load
drift hits every variant alike. Variants: no KV secret, the keyed-BLAKE3 MAC (record
version 4, ``kv_store/record_mac.py``) and HMAC-SHA256 (version 3's MAC, swapped in for
the comparison only). Redis is flushed after every transfer so memory does not grow.

    python -m benchmarks.kv.kv_mac_ab --rounds 8   # writes benchmarks/results/kv/kv_mac_ab.json
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import statistics
from collections.abc import Iterable
from pathlib import Path

import torch

from benchmarks.kv import kv_transfer as kt
from benchmarks.record import recorded_command, result_path
from kv_store import record_mac
from kv_store.factory import KVStoreSettings

BLAKE3_TAG = record_mac.RecordMac.tag


def hmac_sha256_tag(
    self: record_mac.RecordMac,
    key: str,
    header: bytes | memoryview,
    payload: Iterable[bytes | memoryview],
) -> bytes:
    """Version 3's MAC over the same message (keyed with the derived key: same cost)."""
    h = hmac.new(self._key, digestmod=hashlib.sha256)
    raw = key.encode()
    h.update(len(raw).to_bytes(4, "little"))
    h.update(raw)
    h.update(header)
    for piece in payload:
        h.update(piece)
    return h.digest()[: record_mac.MAC_SIZE]


VARIANTS = {"no MAC": None, "keyed BLAKE3": BLAKE3_TAG, "HMAC-SHA256": hmac_sha256_tag}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama3.1-8b-bf16", choices=list(kt.SHAPES))
    p.add_argument("--rounds", type=int, default=8)
    p.add_argument("--json", type=Path, default=result_path("kv", "kv_mac_ab.json"))
    args = p.parse_args()
    import redis

    server, url = kt.start_redis()
    try:
        lay = kt.SHAPES[args.shape]
        tokens = 2048
        src = kt.make_cache(lay, -(-tokens // lay.block_size), 0)
        dst = torch.zeros_like(src)
        payload = tokens * 2 * lay.num_layers * lay.num_kv_heads * lay.head_dim
        payload *= src.element_size()
        rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
        flush = redis.Redis.from_url(url)
        seed = 0
        for _ in range(args.rounds):
            for name, tag in VARIANTS.items():
                seed += 1
                settings = KVStoreSettings("redis", kv_ttl=0, kv_capacity=0)
                settings.redis_url, settings.kv_secret = url, "" if tag is None else "bench"
                record_mac.RecordMac.tag = tag or BLAKE3_TAG  # type: ignore[method-assign]
                save, load = kt.bench_connector(settings, lay, src, dst, tokens, 100 + seed)
                rates[name].append(2 * payload / (save + load) / 1e9)
                flush.flushall()
        record_mac.RecordMac.tag = BLAKE3_TAG  # type: ignore[method-assign]
    finally:
        server.stop()
    medians = {name: statistics.median(v) for name, v in rates.items()}
    pairs = [b / h for b, h in zip(rates["keyed BLAKE3"], rates["HMAC-SHA256"], strict=True)]
    result = {
        "command": recorded_command("benchmarks.kv.kv_mac_ab"),
        "shape": args.shape,
        "tokens": tokens,
        "roundtrip_gbps": rates,
        "median_roundtrip_gbps": medians,
        "blake3_over_hmac_pairwise_median": statistics.median(pairs),
        "mac_gbps_one_core": kt.mac_rates(),
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }
    for name, value in medians.items():
        print(f"| {name} | {value:.2f} |")
    print(
        f"keyed BLAKE3 / HMAC-SHA256, pairwise median: {result['blake3_over_hmac_pairwise_median']:.2f}"
    )
    print(
        f"one core GB/s: {result['mac_gbps_one_core']}; load after {result['load_average_after']}"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
