"""The fs store trusts nothing it finds at a record path: a FIFO, a symlink, a directory
or an oversized file is refused without blocking or reading it, reads as missing and is
removed, so the next save writes a good record there; a record that fails its checksum is
deleted (fs and Redis alike) and rewritten by the next save instead of failing every load."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kv_store.record import record_size
from tests.integration.test_kv_contract import Target, layout, one, prompt, random_cache, transfer

BLOCKS = 3
VICTIM = 1  # the middle block: block 0 still loads, block 2 is behind the bad one


@pytest.fixture
def fs_target(tmp_path: Path) -> Iterator[Target]:
    t = Target("fs", str(tmp_path / "kv"))
    try:
        yield t
    finally:
        t.close()


def _save(t: Target, src: torch.Tensor, tokens: list[int]) -> Any:
    """Save blocks 0..BLOCKS-1 of ``src`` through a fresh connector; returns it."""
    a = t.connector(src, layout())
    a.start_save(transfer("save", tokens, list(range(BLOCKS))))
    r = one(a)
    assert r.ok, r
    return a


def _load(t: Target, src: torch.Tensor, tokens: list[int]) -> tuple[Any, torch.Tensor]:
    dst = torch.zeros_like(src)
    b = t.connector(dst, layout())
    b.start_load(transfer("load", tokens, list(range(BLOCKS))))
    return one(b), dst


def _same_blocks(dst: torch.Tensor, src: torch.Tensor, count: int) -> bool:
    return all(torch.equal(dst[:, :, i], src[:, :, i]) for i in range(count))


def _victim_path(t: Target, a: Any, tokens: list[int]) -> Path:
    h = transfer("x", tokens, list(range(BLOCKS))).block_hashes[VICTIM]
    path: Path = a.backend.path_of(f"pdserve/{t.fingerprint}/{h.hex()}")
    assert path.is_file()
    return path


def _fifo(path: Path, _: Path) -> None:
    os.mkfifo(path)  # opening it for reading without O_NONBLOCK waits for a writer


def _symlink_to_dev_zero(path: Path, _: Path) -> None:
    os.symlink("/dev/zero", path)  # an endless read


def _symlink_to_a_good_copy(path: Path, copy: Path) -> None:
    os.symlink(copy, path)  # even a valid record is not read through a link


def _directory(path: Path, _: Path) -> None:
    path.mkdir()
    (path / "inside").write_bytes(b"x")


def _oversized(path: Path, _: Path) -> None:
    with open(path, "wb") as f:  # sparse: 64 MiB that an unbounded read would allocate
        f.truncate(64 << 20)


@pytest.mark.parametrize(
    "plant", [_fifo, _symlink_to_dev_zero, _symlink_to_a_good_copy, _directory, _oversized]
)
def test_a_foreign_entry_at_a_record_path_is_a_miss_then_repaired(
    fs_target: Target, tmp_path: Path, plant: Callable[[Path, Path], None]
) -> None:
    t = fs_target
    src = random_cache(layout(), 4, seed=5)
    tokens = prompt(5, BLOCKS * 16)
    a = _save(t, src, tokens)
    path = _victim_path(t, a, tokens)
    copy = tmp_path / "good-copy"
    copy.write_bytes(path.read_bytes())
    path.unlink()
    plant(path, copy)

    hashes = transfer("x", tokens, list(range(BLOCKS))).block_hashes
    assert a.lookup(tokens, hashes) == VICTIM
    r, dst = _load(t, src, tokens)
    assert not r.ok and r.failure_reason == "missing" and r.num_loaded_blocks == VICTIM, r
    assert _same_blocks(dst, src, VICTIM)
    assert not os.path.lexists(path), "the refused entry was left in place"
    assert copy.read_bytes() and os.path.exists("/dev/zero"), "a link target was touched"

    # The next save writes a good record in its place, and loads are whole again.
    _save(t, src, tokens)
    assert path.is_file() and not path.is_symlink()
    r, dst = _load(t, src, tokens)
    assert r.ok and r.num_loaded_blocks == BLOCKS, r
    assert _same_blocks(dst, src, BLOCKS)


def test_a_directory_at_a_record_path_does_not_fail_the_save(fs_target: Target) -> None:
    """Before anything reads it: ``os.replace`` cannot swap a file in over a directory."""
    t = fs_target
    src = random_cache(layout(), 4, seed=6)
    tokens = prompt(6, BLOCKS * 16)
    a = _save(t, src, tokens)
    path = _victim_path(t, a, tokens)
    path.unlink()
    _directory(path, path)
    _save(t, src, tokens)
    assert path.is_file()


@pytest.mark.parametrize("kind", ["fs", "redis"])
def test_a_record_failing_its_checksum_is_deleted_and_rewritten(
    kind: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    location = str(tmp_path / "kv") if kind == "fs" else request.getfixturevalue("redis_server")
    t = Target(kind, location)
    try:
        src = random_cache(layout(), 4, seed=7)
        tokens = prompt(7, BLOCKS * 16)
        a = _save(t, src, tokens)
        h = transfer("x", tokens, list(range(BLOCKS))).block_hashes
        key = f"pdserve/{t.fingerprint}/{h[VICTIM].hex()}"
        data = bytearray(a.backend.get([key])[0])
        assert len(data) == record_size(layout(), 16)
        data[len(data) // 2] ^= 0x40
        a.backend.put([(key, data)])

        r, _ = _load(t, src, tokens)
        assert not r.ok and r.failure_reason == "checksum" and r.num_loaded_blocks == VICTIM, r
        # Deleted: the store no longer claims it, so the next save writes it again ...
        assert a.backend.get([key]) == [None]
        assert a.lookup(tokens, h) == VICTIM
        _save(t, src, tokens)
        # ... and every block loads again, bit-exact.
        r, dst = _load(t, src, tokens)
        assert r.ok and r.num_loaded_blocks == BLOCKS, r
        assert _same_blocks(dst, src, BLOCKS)
    finally:
        t.close()
