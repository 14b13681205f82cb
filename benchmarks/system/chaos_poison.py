"""Record poisoning for ``benchmarks.system.chaos``: what an attacker or a broken disk can put
where a decode instance reads its KV (docs/design.md §3, "KV records and keys").

Four kinds, each applied to a seeded random share of the records already in the store:

- ``garbage``: random bytes of the record's own length (fails the checksum);
- ``forged``: the record's header with garbage KV and a *valid* XXH3 checksum, MAC field
  zero: what a writer without the deployment's KV secret can make (fails the MAC);
- ``fifo`` (fs only): the record file replaced by a named pipe (a blocking open would
  stall the whole load until its deadline);
- ``oversized`` (fs only): the record file grown to ``OVERSIZED_BYTES`` (an unbounded read
  would bloat the process).

Every reader must refuse these, recompute the blocks and give the undisturbed output.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import xxhash

from kv_store.record import HEADER_SIZE

FS_KINDS = ("garbage", "forged", "fifo", "oversized")
REDIS_KINDS = ("garbage", "forged")
OVERSIZED_BYTES = 64 << 20  # sparse: costs no disk, but 4096x a record of the tiny model
_CHECKSUM_AT = 40  # record.py: xxh3_64 at bytes 40..48 of the header, the MAC after it


def forged(record: bytes, rng: random.Random) -> bytes:
    """Garbage KV under the record's own header, checksum fixed up, MAC field zero."""
    head = bytearray(record[:HEADER_SIZE])
    payload = rng.randbytes(len(record) - HEADER_SIZE)
    digest = xxhash.xxh3_64(bytes(head[:_CHECKSUM_AT]) + payload).intdigest()
    head[_CHECKSUM_AT : _CHECKSUM_AT + 8] = digest.to_bytes(8, "little")
    head[_CHECKSUM_AT + 8 : HEADER_SIZE] = bytes(HEADER_SIZE - _CHECKSUM_AT - 8)
    return bytes(head) + payload


def fs_records(root: Path) -> list[Path]:
    """The record files under the fs store directory (not the writers' temp files)."""
    return sorted(
        p for p in root.rglob("*") if p.is_file() and not p.is_symlink() and ".tmp" not in p.name
    )


def clear_fs(root: Path) -> None:
    """Remove every entry of the fs store (between poisoning phases: no poison carries over)."""
    for p in sorted(root.rglob("*"), key=lambda q: len(q.parts), reverse=True):
        if p.is_dir() and not p.is_symlink():
            p.rmdir()
        else:
            p.unlink(missing_ok=True)


def special_files(root: Path) -> int:
    """FIFOs and files larger than ``OVERSIZED_BYTES // 2`` left in the store."""
    paths = [p for p in root.rglob("*") if not p.is_dir()]
    return sum(
        p.is_fifo() or (p.is_file() and p.stat().st_size > OVERSIZED_BYTES // 2) for p in paths
    )


def poison_fs(root: Path, kind: str, share: float, seed: int) -> int:
    """Poison ``share`` of the records under ``root`` with ``kind``; returns how many."""
    if kind not in FS_KINDS:
        raise ValueError(f"unknown fs poison {kind!r}; one of {FS_KINDS}")
    rng = random.Random(seed)
    files = fs_records(root)
    victims = rng.sample(files, max(1, round(share * len(files)))) if files else []
    done = 0
    for path in victims:
        try:  # the services replace and delete records meanwhile: skip what moved
            if kind == "garbage":
                path.write_bytes(rng.randbytes(path.stat().st_size))
            elif kind == "forged":
                path.write_bytes(forged(path.read_bytes(), rng))
            elif kind == "fifo":
                path.unlink()
                os.mkfifo(path)
            else:
                os.truncate(path, OVERSIZED_BYTES)
        except OSError:
            continue
        done += 1
    return done


def poison_redis(client: Any, kind: str, share: float, seed: int) -> int:
    """Poison ``share`` of the record keys in the Redis behind ``client`` (redis-py) with
    ``kind`` (SET at the record's own key); returns how many."""
    if kind not in REDIS_KINDS:
        raise ValueError(f"unknown redis poison {kind!r}; one of {REDIS_KINDS}")
    rng = random.Random(seed)
    keys = sorted(k for k in client.scan_iter(count=1000) if client.type(k) == b"string")
    victims = rng.sample(keys, max(1, round(share * len(keys)))) if keys else []
    done = 0
    for key in victims:
        value = client.get(key)
        if value is None or len(value) <= HEADER_SIZE:
            continue
        ttl = client.pttl(key)
        bad = rng.randbytes(len(value)) if kind == "garbage" else forged(value, rng)
        client.set(key, bad, px=ttl if ttl and ttl > 0 else None)
        done += 1
    return done


def clear_store(store: Path | str) -> None:
    """Empty the fs store (a directory) or the Redis (a URL): no poison carries over."""
    if isinstance(store, Path):
        clear_fs(store)
        return
    import redis as redis_py

    client = redis_py.Redis.from_url(store, socket_timeout=10)
    try:
        client.flushdb()
    finally:
        client.close()


def poison_store(store: Path | str, fault: str, share: float, seed: int) -> int:
    """``poison_fs`` or ``poison_redis`` with the kind named by ``fault`` (``<kind>_records``)."""
    kind = fault.removesuffix("_records")
    if isinstance(store, Path):
        return poison_fs(store, kind, share, seed)
    import redis as redis_py

    client = redis_py.Redis.from_url(store, socket_timeout=10)
    try:
        return poison_redis(client, kind, share, seed)
    finally:
        client.close()
