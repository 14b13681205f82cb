"""Fault handling of the KV connectors: corrupt and missing records, a Redis that dies
mid-run, concurrent fs writers, and LMCache misconfiguration."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from kv_store.fs_backend import FsBackend
from kv_store.record import HEADER_SIZE, decode_block, encode_block
from tests.integration.test_kv_contract import (
    REPO,
    Target,
    layout,
    one,
    prompt,
    random_cache,
    transfer,
)
from tests.servers import ManagedServer, free_port


def _target(kind: str, tmp_path: Path, request: pytest.FixtureRequest) -> Target:
    location = str(tmp_path / "kv") if kind == "fs" else request.getfixturevalue("redis_server")
    return Target(kind, location)


def _saved(t: Target, n_blocks: int) -> tuple[Any, torch.Tensor, list[int]]:
    lay = layout()
    src = random_cache(lay, 8, seed=21)
    tokens = prompt(21, n_blocks * 16)
    a = t.connector(src, lay)
    a.start_save(transfer("r", tokens, list(range(n_blocks))))
    assert one(a).ok
    return a, src, tokens


@pytest.mark.parametrize("kind", ["fs", "redis"])
def test_flipped_byte_reports_checksum_and_keeps_leading_blocks(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    t = _target(kind, tmp_path, request)
    try:
        a, src, tokens = _saved(t, 4)
        key = transfer("r", tokens, [0, 1, 2, 3]).block_hashes[2]
        victim = f"pdserve/{t.fingerprint}/{key.hex()}"
        data = bytearray(a.backend.get([victim])[0])
        data[len(data) // 2] ^= 0x40
        a.backend.put([(victim, data)])
        dst = torch.zeros_like(src)
        b = t.connector(dst, layout())
        b.start_load(transfer("r", tokens, [4, 5, 6, 7]))
        r = one(b)
        assert not r.ok and r.failure_reason == "checksum" and r.num_loaded_blocks == 2, r
        assert torch.equal(dst[:, :, 4], src[:, :, 0]) and torch.equal(dst[:, :, 5], src[:, :, 1])
        # Blocks past the leading intact ones are not reported loaded; the engine recomputes
        # them, so what the fs fast path (readv straight into the cache) left there is moot.
        assert b.stats().failures == {"checksum": 1}
    finally:
        t.close()


@pytest.mark.parametrize("kind", ["fs", "redis"])
def test_version_1_record_is_a_miss_not_wrong_tokens(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """A store still holding a record written by record version 1 (40-byte header,
    CRC32; same payload) loads the leading blocks and stops there with a clear reason."""
    t = _target(kind, tmp_path, request)
    try:
        a, src, tokens = _saved(t, 3)
        key = transfer("r", tokens, [0, 1, 2]).block_hashes[1]
        victim = f"pdserve/{t.fingerprint}/{key.hex()}"
        payload = bytes(a.backend.get([victim])[0])[HEADER_SIZE:]
        lay = layout()
        old = struct.pack(
            "<4sHHB3xIIIIQ", b"PDKV", 1, lay.version, 1, lay.num_layers, 16,
            lay.num_kv_heads, lay.head_dim, len(payload),
        )  # fmt: skip
        old += struct.pack("<I", zlib.crc32(payload, zlib.crc32(old)))
        a.backend.put([(victim, old + payload)])
        dst = torch.zeros_like(src)
        b = t.connector(dst, lay)
        b.start_load(transfer("r", tokens, [4, 5, 6]))
        r = one(b)
        assert not r.ok and r.failure_reason == "corrupt" and r.num_loaded_blocks == 1, r
        assert "record version 1 is not supported" in (r.error or ""), r.error
        assert torch.equal(dst[:, :, 4], src[:, :, 0])
    finally:
        t.close()


@pytest.mark.parametrize("kind", ["fs", "redis"])
def test_deleted_block_reports_missing(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    t = _target(kind, tmp_path, request)
    try:
        a, src, tokens = _saved(t, 3)
        h = transfer("r", tokens, [0, 1, 2]).block_hashes
        a.backend.delete([f"pdserve/{t.fingerprint}/{h[1].hex()}"])
        assert a.lookup(tokens, h) == 1
        dst = torch.zeros_like(src)
        b = t.connector(dst, layout())
        b.start_load(transfer("r", tokens, [0, 1, 2]))
        r = one(b)
        assert not r.ok and r.failure_reason == "missing" and r.num_loaded_blocks == 1, r
        # The missing block is never written. Redis reads a batch in one pipelined round
        # trip, so block 2 may land too; it is not reported loaded and gets recomputed.
        assert torch.equal(dst[:, :, 0], src[:, :, 0]) and not dst[:, :, 1].any()
    finally:
        t.close()


def test_redis_stopped_mid_run_fails_fast_then_recovers(
    redis_proc: ManagedServer, redis_server: str
) -> None:
    t = Target("redis", redis_server)
    try:
        a, src, tokens = _saved(t, 2)
        tr = transfer("r", tokens, [0, 1])
        redis_proc.stop()
        other = prompt(22, 32)
        a.start_save(transfer("s", other, [2, 3]))
        a.start_load(tr)
        results = a.wait(2, timeout_s=30)  # socket timeouts and bounded retries end them
        assert len(results) == 2, results
        assert all(not r.ok and r.failure_reason == "unreachable" for r in results), results
        assert a.lookup(tokens, tr.block_hashes) == 0
        assert a.stats().failures["unreachable"] >= 3
        # Three failures in a row opened the circuit breaker: operations fail at once.
        assert a.lookup(tokens, tr.block_hashes) == 0
        assert a.stats().failures["circuit_open"] >= 1
        redis_proc.start()  # same port, empty store
        _save_until_ok(a, tr)  # the breaker's next probe closes it
        dst = torch.zeros_like(src)
        a2 = t.connector(dst, layout())
        a2.start_load(tr)
        r = one(a2)
        assert r.ok and r.num_loaded_blocks == 2 and torch.equal(dst[:, :, :2], src[:, :, :2])
    finally:
        t.close()


def _save_until_ok(conn: Any, tr: Any, deadline_s: float = 60.0) -> None:
    """Save ``tr`` until it succeeds; only the open breaker may refuse it meanwhile."""
    end = time.monotonic() + deadline_s
    while True:
        conn.start_save(tr)
        r = one(conn)
        if r.ok:
            return
        assert r.failure_reason == "circuit_open", r
        assert time.monotonic() < end, "the breaker never let a save through"
        time.sleep(0.2)


def _writer(root: str, seed: int, rounds: int) -> None:
    """Child process: write the same keys over and over with this writer's own records."""
    lay = layout()
    kv = random_cache(lay, 8, seed=seed)
    fs = FsBackend(root)
    for _ in range(rounds):
        fs.put([(f"pdserve/shared/k{i}", encode_block(kv[:, :, i], lay)) for i in range(8)])


def test_two_fs_writers_never_tear_a_record(tmp_path: Path) -> None:
    root = str(tmp_path / "kv")
    lay = layout()
    versions = {seed: random_cache(lay, 8, seed=seed) for seed in (101, 102)}
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "tests.integration.test_kv_faults", "writer", root]
    procs = [subprocess.Popen([*cmd, str(s), "150"], cwd=REPO, env=env) for s in versions]
    fs = FsBackend(root)
    reads = 0
    try:
        end = time.monotonic() + 120
        while any(p.poll() is None for p in procs) and time.monotonic() < end:
            for i, data in enumerate(fs.get([f"pdserve/shared/k{i}" for i in range(8)])):
                if data is None:
                    continue
                block = decode_block(data, lay, expected_tokens=16)  # raises on a torn record
                assert any(torch.equal(block, v[:, :, i]) for v in versions.values())
                reads += 1
    finally:
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0]
    assert reads > 0
    leftovers = [p for p in Path(root).rglob(".tmp-*")]
    assert leftovers == [], leftovers


def _lmcache_start(url: str, seed: str) -> subprocess.CompletedProcess[str]:
    code = (
        "from kv_store.lmcache_connector import LMCacheConnector\n"
        "from kv_store.base import KVStoreError\n"
        "try:\n"
        f"    LMCacheConnector({url!r})\n"
        "except KVStoreError as e:\n"
        "    print('KVStoreError:', e)\n"
    )
    env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(REPO))
    return subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=120
    )


def test_lmcache_refuses_random_hash_seed(lmcache_server: str) -> None:
    out = _lmcache_start(lmcache_server, "1").stdout
    assert "KVStoreError" in out and "PYTHONHASHSEED=0" in out, out


def test_lmcache_unreachable_remote_fails_loudly() -> None:
    out = _lmcache_start(f"lm://127.0.0.1:{free_port()}", "0").stdout
    assert "KVStoreError" in out and "unreachable" in out, out


def _lmcache_dies() -> dict[str, Any]:
    """Child process (PYTHONHASHSEED=0): save through LMCache, kill its server, save again."""
    from tests.servers import start_lmcache

    srv, url = start_lmcache()
    t = Target("lmcache", url)
    try:
        lay = layout()
        a = t.connector(random_cache(lay, 8, seed=41), lay)
        tokens = prompt(41, 48)
        a.start_save(transfer("r", tokens, [0, 1, 2]))
        first = one(a)
        srv.stop()
        a.start_save(transfer("s", prompt(42, 48), [3, 4, 5]))
        second = one(a, timeout_s=60)
        return {"first": first.ok, "second": second.ok, "reason": second.failure_reason}
    finally:
        t.close()
        srv.stop()


def test_lmcache_server_stopped_mid_run_fails_the_save() -> None:
    env = dict(os.environ, PYTHONHASHSEED="0", PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "tests.integration.test_kv_faults", "lmcache-dies"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out == {"first": True, "second": False, "reason": "unreachable"}, out


def main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[0] == "writer":
        torch.set_num_threads(1)
        _writer(argv[1], int(argv[2]), int(argv[3]))
        return 0
    if argv == ["lmcache-dies"]:
        print(json.dumps(_lmcache_dies()))
        return 0
    print(
        "usage: python -m tests.integration.test_kv_faults writer ROOT SEED ROUNDS", file=sys.stderr
    )
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def test_paused_redis_opens_the_breaker(redis_proc: ManagedServer, redis_server: str) -> None:
    """A hung Redis (SIGSTOP): each operation fails after its socket timeout (not retried),
    and after three in a row the rest are refused at once without being tried."""
    from kv_store.base import KVStoreCircuitOpen, KVStoreError
    from kv_store.redis_backend import RedisBackend

    rb = RedisBackend(redis_server, socket_timeout_s=0.5)
    assert redis_proc.proc is not None
    try:
        rb.put([("k", b"v")])
        redis_proc.proc.send_signal(signal.SIGSTOP)
        kinds = []
        for _ in range(5):
            with pytest.raises(KVStoreError) as info:
                rb.exists(["k"])
            kinds.append(type(info.value))
        assert kinds == [KVStoreError] * 3 + [KVStoreCircuitOpen] * 2
        assert rb.breaker.rejected == 2 and rb.breaker.opened == 1
    finally:
        redis_proc.proc.send_signal(signal.SIGCONT)
        rb.close()
