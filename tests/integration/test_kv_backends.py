"""The ``StorageBackend`` contract for fs and redis, and fs capacity GC."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from kv_store.backend import StorageBackend
from kv_store.base import KVStoreError
from kv_store.fs_backend import FsBackend
from kv_store.redis_backend import RedisBackend


@pytest.fixture(params=["fs", "redis"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StorageBackend]:
    if request.param == "fs":
        b: StorageBackend = FsBackend(tmp_path / "kv")
    else:
        b = RedisBackend(request.getfixturevalue("redis_server"), key_prefix="test:")
    try:
        yield b
    finally:
        b.close()


def test_backend_contract(backend: StorageBackend) -> None:
    keys = ["pdserve/fp/aa01", "pdserve/fp/aa02", "pdserve/other/../x", "k"]
    assert backend.exists(keys) == [False] * 4
    assert backend.get(keys) == [None] * 4
    assert backend.exists([]) == [] and backend.get([]) == []
    backend.put([(keys[0], b"one"), (keys[1], bytearray(b"two")), (keys[2], memoryview(b"three"))])
    assert backend.exists(keys) == [True, True, True, False]
    assert [None if v is None else bytes(v) for v in backend.get(keys)] == [
        b"one",
        b"two",
        b"three",
        None,
    ]
    backend.put([(keys[0], b"uno")])  # overwrite
    assert bytes(backend.get([keys[0]])[0] or b"") == b"uno"
    backend.delete([keys[1], keys[3]])  # deleting a missing key is fine
    assert backend.exists(keys) == [True, False, True, False]
    big = os.urandom(3 << 20)
    backend.put([("pdserve/fp/big", big)])
    assert backend.get(["pdserve/fp/big"]) == [big]


def test_fs_keys_cannot_escape_root(tmp_path: Path) -> None:
    fs = FsBackend(tmp_path / "kv")
    for key in ["../../etc/x", "pdserve/../../x", "/abs/x", ".tmp-x"]:
        if "//" in key or key.startswith("/"):
            with pytest.raises(ValueError):
                fs.put([(key, b"v")])
            continue
        fs.put([(key, b"v")])
        assert fs.path_of(key).resolve().is_relative_to((tmp_path / "kv").resolve())
        assert fs.get([key]) == [b"v"]
    assert not (tmp_path / "etc").exists() and not (tmp_path / "x").exists()


def test_fs_capacity_gc_evicts_least_recently_used(tmp_path: Path) -> None:
    rec = 1000
    fs = FsBackend(tmp_path / "kv", capacity_bytes=int(3.5 * rec), low_watermark=0.8)
    keys = [f"pdserve/fp/k{i}" for i in range(4)]
    fs.put([(k, os.urandom(rec)) for k in keys[:3]])
    # Pin the access order explicitly (file timestamps can tie): k0 oldest ... k2 newest.
    base = time.time() - 100
    for i, k in enumerate(keys[:3]):
        os.utime(fs.path_of(k), (base + i, base + i))
    assert fs.get([keys[0]])[0] is not None  # reading k0 makes it the most recently used
    fs.put([(keys[3], os.urandom(rec))])  # 4000 > 3500: GC down to <= 2800
    assert fs.exists(keys) == [True, False, False, True]
    assert fs._scan_total() == 2 * rec


def test_fs_ttl_expired_is_missing_and_collected(tmp_path: Path) -> None:
    fs = FsBackend(tmp_path / "kv", ttl_s=50)
    fs.put([("pdserve/fp/old", b"x" * 10), ("pdserve/fp/new", b"y" * 10)])
    past = time.time() - 100
    os.utime(fs.path_of("pdserve/fp/old"), (past, past))
    assert fs.exists(["pdserve/fp/old", "pdserve/fp/new"]) == [False, True]
    assert fs.get(["pdserve/fp/old"]) == [None]
    assert fs.gc() == 10
    assert not fs.path_of("pdserve/fp/old").exists() and fs.path_of("pdserve/fp/new").exists()


def test_fs_gc_removes_stale_temp_files(tmp_path: Path) -> None:
    fs = FsBackend(tmp_path / "kv", capacity_bytes=10**6)
    fs.put([("pdserve/fp/ab", b"v")])
    stale = fs.path_of("pdserve/fp/ab").parent / ".tmp-999-dead"
    stale.write_bytes(b"torn")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    fs.gc()
    assert not stale.exists() and fs.get(["pdserve/fp/ab"]) == [b"v"]


def test_redis_ttl_and_prefix(redis_server: str) -> None:
    import redis as redis_py

    b = RedisBackend(redis_server, ttl_s=30, key_prefix="ns1:")
    try:
        b.put([("pdserve/fp/a", b"v")])
        raw = redis_py.Redis.from_url(redis_server)
        assert raw.get("ns1:pdserve/fp/a") == b"v"
        assert 0 < raw.ttl("ns1:pdserve/fp/a") <= 30
        raw.close()
    finally:
        b.close()
    with pytest.raises(ValueError, match="redis://"):
        RedisBackend("http://127.0.0.1:1")


def test_redis_get_into_receives_values_into_caller_buffers(redis_server: str) -> None:
    import redis as redis_py

    b = RedisBackend(redis_server, key_prefix="gi:")
    try:
        big = os.urandom(3 << 20)
        b.put([("big", big), ("small", b"0123456789"), ("odd", b"abc")])
        # 3 MiB scattered over 100 buffers (like a block's cache slices), a missing key,
        # a size mismatch, then a small value: the reply stream must stay in step.
        cuts = [i * len(big) // 100 for i in range(101)]
        scattered = [bytearray(cuts[i + 1] - cuts[i]) for i in range(100)]
        missing, odd, small = [bytearray(4)], [bytearray(5)], [bytearray(4), bytearray(6)]
        sizes = b.get_into(["big", "nope", "odd", "small"], [scattered, missing, odd, small])
        assert sizes == [len(big), None, 3, 10]
        assert b"".join(scattered) == big
        assert missing == [bytearray(4)] and odd == [bytearray(5)]  # untouched
        assert small == [bytearray(b"0123"), bytearray(b"456789")]
        assert b.get_into([], []) == []
        with pytest.raises(ValueError, match="2 keys but 1 buffer"):
            b.get_into(["a", "b"], [[bytearray(1)]])
        # A key of the wrong type is a bad record: missing (and deleted), not an error
        # (tests/integration/test_kv_redis_wrongtype.py); the next call still works.
        raw = redis_py.Redis.from_url(redis_server)
        raw.rpush("gi:list", b"x")
        raw.close()
        assert b.get_into(["small", "list"], [[bytearray(10)], [bytearray(1)]]) == [10, None]
        again = [bytearray(10)]
        assert b.get_into(["small"], [again]) == [10] and again == [bytearray(b"0123456789")]
    finally:
        b.close()
    assert not RedisBackend("rediss://127.0.0.1:1").vectored_io


@pytest.mark.timeout(20)  # a dead server must give an error, not a hang
def test_redis_get_into_fails_fast_when_server_is_gone() -> None:
    from tests.servers import free_port

    b = RedisBackend(f"redis://127.0.0.1:{free_port()}", retries=0, connect_timeout_s=0.5)
    try:
        with pytest.raises(KVStoreError, match="unreachable"):
            b.get_into(["k"], [[bytearray(1)]])
    finally:
        b.close()


def test_redis_put_parts_sends_pieces_as_one_value(redis_server: str) -> None:
    import redis as redis_py

    b = RedisBackend(redis_server, ttl_s=60, key_prefix="pp:")
    try:
        big = os.urandom(3 << 20)
        # More pieces than one sendmsg takes (IOV_MAX 1024), and an empty one.
        cuts = [i * len(big) // 2500 for i in range(2501)]
        pieces: list[bytes | bytearray | memoryview] = [
            memoryview(big)[cuts[i] : cuts[i + 1]] for i in range(2500)
        ]
        pieces.insert(7, b"")
        b.put_parts([("big", pieces), ("small", [b"ab", bytearray(b"cd")])])
        assert b.get(["big", "small"]) == [big, b"abcd"]
        raw = redis_py.Redis.from_url(redis_server)
        assert 0 < raw.ttl("pp:big") <= 60 and raw.get("pp:small") == b"abcd"
        raw.close()
        b.put_parts([("small", [b"x"])])  # overwrite; the connection is still in step
        assert b.get(["small", "big"]) == [b"x", big]
    finally:
        b.close()
    no_ttl = RedisBackend(redis_server, key_prefix="pp:")
    try:
        no_ttl.put_parts([("forever", [b"v"])])
        raw = redis_py.Redis.from_url(redis_server)
        assert raw.ttl("pp:forever") == -1 and raw.get("pp:forever") == b"v"
        raw.close()
    finally:
        no_ttl.close()


def test_redis_bad_buffers_are_value_errors_before_any_io(redis_server: str) -> None:
    """A read-only or non-contiguous buffer is a ValueError naming it, raised before
    anything is sent or written (it was a TypeError from inside the reply loop, after
    earlier keys' buffers had been filled); the backend stays usable."""
    b = RedisBackend(redis_server, key_prefix="bb:")
    try:
        b.put([("a", b"0123456789"), ("b", b"abcdefghij")])
        strided = memoryview(bytearray(20))[::2]  # writable, not C-contiguous
        cases: list[tuple[bytes | memoryview, str]] = [
            (bytes(10), "read-only"),
            (strided, "C-contiguous"),
        ]
        for bad, why in cases:
            first = [bytearray(10)]
            with pytest.raises(ValueError, match=rf"parts\[1\]\[0\] .*{why}"):
                b.get_into(["a", "b"], [first, [bad]])
            assert first == [bytearray(10)]  # nothing received
        with pytest.raises(ValueError, match=r"items\[1\]\[1\] must be a C-contiguous"):
            b.put_parts([("c", [b"x"]), ("d", [b"y", strided])])
        assert b.get(["c", "d"]) == [None, None]  # nothing sent
        got = [bytearray(10)]
        assert b.get_into(["b"], [got]) == [10] and got == [bytearray(b"abcdefghij")]
    finally:
        b.close()
