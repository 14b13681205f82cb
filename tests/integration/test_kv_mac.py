"""Poisoning the KV store (issue 17, item 3) against a real fs directory and a real
redis-server: with a KV secret, a forged record (right checksum, no or a wrong MAC) and a
valid record copied under another key are refused with reason ``mac``, deleted, and
rewritten by the next save; on every record path (vectored, staged, whole-record). Without
the secret the same forgeries load, which is what the secret is for."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

from kv_store.block_connector import BlockStoreConnector
from kv_store.fs_backend import FsBackend
from kv_store.record import HEADER_SIZE
from kv_store.record_mac import RecordMac
from kv_store.redis_backend import RedisBackend
from tests.integration.test_kv_contract import layout, one, prompt, random_cache, transfer

SECRET = "deployment-secret"
FP = "fp-mac"


class _WholeRecordFs(FsBackend):
    """The fs store without its vectored methods: records go through get/put whole (the
    path rediss:// takes), so the encoder and decoder's MAC is exercised too."""

    @property
    def vectored_io(self) -> bool:
        return False


@pytest.fixture(params=["fs", "fs-whole", "fs-staged", "redis", "redis-staged"])
def make(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """``make(cache, secret)`` → a bound connector; all share one store."""
    kind: str = request.param
    url = request.getfixturevalue("redis_server") if kind.startswith("redis") else ""
    made: list[BlockStoreConnector] = []

    def build(cache: torch.Tensor, secret: str | None = SECRET) -> BlockStoreConnector:
        backend: Any
        if kind.startswith("redis"):
            backend = RedisBackend(url, key_prefix="mac:")
        else:
            cls = _WholeRecordFs if kind == "fs-whole" else FsBackend
            backend = cls(tmp_path / "store")
        mac = RecordMac(secret) if secret else None
        conn = BlockStoreConnector(backend, batch_blocks=2, staged=kind.endswith("staged"), mac=mac)
        conn.bind_kv_cache(cache, layout(), FP)
        made.append(conn)
        return conn

    yield build
    for conn in made:
        conn.close()


def _key(tokens: list[int], n_blocks: int, i: int) -> str:
    return f"pdserve/{FP}/{transfer('k', tokens, list(range(n_blocks))).block_hashes[i].hex()}"


def _forge(record: bytes, mac: bytes) -> bytes:
    """What a writer without the secret can make: garbage KV, a valid XXH3 checksum."""
    head = bytearray(record[:HEADER_SIZE])
    payload = torch.full(((len(record) - HEADER_SIZE) // 4,), 7.0).numpy().tobytes()
    head[40:48] = xxhash.xxh3_64(bytes(head[:40]) + payload).intdigest().to_bytes(8, "little")
    head[48:HEADER_SIZE] = mac
    return bytes(head) + payload


@pytest.mark.parametrize("mac", [bytes(16), b"\x5a" * 16], ids=["no-mac", "wrong-mac"])
def test_forged_record_is_refused_deleted_and_rewritten(make: Any, mac: bytes) -> None:
    lay = layout()
    src = random_cache(lay, 8, seed=3)
    tokens = prompt(3, 3 * 16)
    a = make(src)
    a.start_save(transfer("s", tokens, [0, 1, 2]))
    assert one(a).ok
    victim = _key(tokens, 3, 1)
    a.backend.put([(victim, _forge(bytes(a.backend.get([victim])[0]), mac))])

    # Without the secret the forgery loads: garbage KV for this prompt (the attack).
    garbage = torch.zeros_like(src)
    plain = make(garbage, secret=None)
    plain.start_load(transfer("p", tokens, [4, 5, 6]))
    assert one(plain).ok and (garbage[:, :, 5] == 7.0).all()

    dst = torch.zeros_like(src)
    b = make(dst)
    b.start_load(transfer("l", tokens, [4, 5, 6]))
    r = one(b)
    assert not r.ok and r.failure_reason == "mac" and r.num_loaded_blocks == 1, r
    assert "MAC" in (r.error or "") and b.stats().failures == {"mac": 1}
    assert torch.equal(dst[:, :, 4], src[:, :, 0])
    assert a.backend.exists([victim]) == [False]  # deleted: the next save rewrites it
    a.start_save(transfer("s2", tokens, [0, 1, 2]))
    assert one(a).num_saved_blocks == 1
    b.start_load(transfer("l2", tokens, [4, 5, 6]))
    assert one(b).ok
    assert torch.equal(dst[:, :, 4:7], src[:, :, 0:3])


def test_valid_record_copied_under_another_key_is_refused(make: Any) -> None:
    lay = layout()
    src = random_cache(lay, 8, seed=4)
    one_prompt, other = prompt(4, 2 * 16), prompt(5, 2 * 16)
    a = make(src)
    a.start_save(transfer("a", one_prompt, [0, 1]))
    a.start_save(transfer("b", other, [2, 3]))
    assert one(a).ok and one(a).ok
    # A sealed record of one prompt put where the other prompt's first block is read.
    a.backend.put([(_key(other, 2, 0), bytes(a.backend.get([_key(one_prompt, 2, 0)])[0]))])
    dst = torch.zeros_like(src)
    b = make(dst)
    b.start_load(transfer("l", other, [4, 5]))
    r = one(b)
    assert not r.ok and r.failure_reason == "mac" and r.num_loaded_blocks == 0, r
    assert a.backend.exists([_key(other, 2, 0)]) == [False]
    assert a.backend.exists([_key(one_prompt, 2, 0)]) == [True]  # the original stays


def test_records_without_a_mac_are_refused_by_a_reader_with_the_secret(make: Any) -> None:
    """A store filled before the secret was set (or by a writer without it) is recomputed,
    not trusted; a writer with the secret then replaces each record."""
    lay = layout()
    src = random_cache(lay, 4, seed=6)
    tokens = prompt(6, 2 * 16)
    old = make(src, secret=None)
    old.start_save(transfer("s", tokens, [0, 1]))
    assert one(old).ok
    b = make(torch.zeros_like(src))
    b.start_load(transfer("l", tokens, [2, 3]))
    r = one(b)
    assert not r.ok and r.failure_reason == "mac" and "no MAC" in (r.error or ""), r


@pytest.mark.parametrize("version", [2, 3])
def test_older_record_versions_are_refused_explicitly_and_deleted(make: Any, version: int) -> None:
    """A record an earlier version wrote (2: 48-byte header, no MAC field; 3: this layout
    with an HMAC-SHA256 MAC) is never read as a current one: the load stops there with a
    clear reason and the next save replaces it."""
    lay = layout()
    src = random_cache(lay, 4, seed=7)
    tokens = prompt(7, 2 * 16)
    a = make(src)
    a.start_save(transfer("s", tokens, [0, 1]))
    assert one(a).ok
    victim = _key(tokens, 2, 1)
    rec = bytes(a.backend.get([victim])[0])
    old = bytearray(rec[:48] + rec[HEADER_SIZE:] if version == 2 else rec)
    old[4:6] = version.to_bytes(2, "little")
    a.backend.put([(victim, bytes(old))])
    b = make(torch.zeros_like(src))
    b.start_load(transfer("l", tokens, [2, 3]))
    r = one(b)
    assert not r.ok and r.failure_reason == "corrupt" and r.num_loaded_blocks == 1, r
    assert f"record version {version} is not supported" in (r.error or ""), r.error
    assert a.backend.exists([victim]) == [False]


class _HeldFs(FsBackend):
    """The fs store whose read of ``held`` waits for ``release`` first (at most 5 s): a
    batch still reading after another batch of the same load already failed."""

    def __init__(self, root: Path, held: str, release: threading.Event) -> None:
        super().__init__(root)
        self.held, self.release = held, release

    def get_into(self, key: str, parts: Any) -> int | None:
        if key == self.held:
            self.release.wait(5.0)
        return super().get_into(key, parts)


def test_failed_load_result_waits_for_every_batch(tmp_path: Path) -> None:
    """Loaded blocks join the prefix cache only once verified (docs/design.md §3): after a
    failed load the engine recomputes every block past ``num_loaded_blocks`` into the
    same cache blocks. A batch still reading then would overwrite recomputed KV with the
    unverified bytes of a forged record; so the result comes only after every batch."""
    lay = layout()
    src = random_cache(lay, 8, seed=8)
    tokens = prompt(8, 2 * 16)
    a = BlockStoreConnector(FsBackend(tmp_path / "store"), mac=RecordMac(SECRET))
    a.bind_kv_cache(src, lay, FP)
    a.start_save(transfer("s", tokens, [0, 1]))
    assert one(a).ok
    for i in range(2):  # both records forged: garbage KV, valid checksum, no MAC
        key = _key(tokens, 2, i)
        (record,) = a.backend.get([key])
        assert record is not None
        a.backend.put([(key, _forge(bytes(record), bytes(16)))])
    a.close()

    release = threading.Event()
    dst = torch.zeros_like(src)
    held = _HeldFs(tmp_path / "store", _key(tokens, 2, 1), release)
    b = BlockStoreConnector(held, batch_blocks=1, io_threads=2, mac=RecordMac(SECRET))
    b.bind_kv_cache(dst, lay, FP)
    try:
        b.start_load(transfer("l", tokens, [4, 5]))
        r = one(b)
        assert not r.ok and r.failure_reason == "mac" and r.num_loaded_blocks == 0, r
        dst[:, :, 4:6] = src[:, :, 0:2]  # what the engine's recompute writes
        release.set()
    finally:
        b.close()  # waits for the I/O threads: a late read would have landed by now
    assert torch.equal(dst[:, :, 4:6], src[:, :, 0:2])
