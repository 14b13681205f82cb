"""Golden values of the chained block hashes (docs/design.md §3).

hash(block i) = sha256(hash(block i-1) ‖ token ids as little-endian int32 ‖ extra keys), root
parent 32 zero bytes. Pods on different machines key shared KV by these hashes, so a change
here silently breaks every cache in the fleet: the literal digests are pinned, and an
independent hashlib computation cross-checks the chaining rule.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest

from common.block_hash import ROOT_PARENT, compute_block_hashes, extend_block_hashes

GOLDEN = {
    # (tokens, block_size, extra_keys, include_partial) -> hex digests
    "range8_bs4": (
        list(range(8)),
        4,
        b"",
        False,
        [
            "b02e0d143ccacaaee83a69ef8eda1d98b38aa1e3799ee50360538059e0c2a5c4",
            "a42a5305c04a857685206d3e54998e9fe3b29191d5b1af140d42f2bc385310a4",
        ],
    ),
    "partial_tail": (
        [1, 2, 3, 4, 5, 6],
        4,
        b"",
        True,
        [
            "d8faa8ec8c0500567ca87b56e4bb666d69cb512e638103891defea24e88cbc92",
            "c77f6f4031aa7166d81d8a83068b54b097a2226789b757a3993b223764a25fbf",
        ],
    ),
    "extra_keys": (
        list(range(16)),
        16,
        b"lora:7",
        False,
        ["379be82e5ed77e66f9457812d175367ac4d989794dc93e8d2e7b3929d9fb09f0"],
    ),
    "int32_edges": (
        [-1, 2**31 - 1, 49151, 0],
        2,
        b"",
        False,
        [
            "bc8a42421b98b57ed1f07805ff1312abe46e04341b1720024a57f36900b28372",
            "de0fa152c77e5465fa753b95068a4f015125ddffa69ec8802f2052f127d18815",
        ],
    ),
}


def _independent(tokens: list[int], bs: int, extra: bytes, partial: bool) -> list[str]:
    """The docs/design.md §3 rule written out with hashlib and int.to_bytes (no struct)."""
    parent = bytes(32)
    out = []
    chunks = [tokens[i : i + bs] for i in range(0, len(tokens), bs)]
    for chunk in chunks:
        if len(chunk) < bs and not partial:
            break
        payload = b"".join(t.to_bytes(4, "little", signed=True) for t in chunk)
        digest = hashlib.sha256(parent + payload + extra).digest()
        out.append(digest.hex())
        parent = digest
    return out


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_digests(name: str) -> None:
    tokens, bs, extra, partial, expect = GOLDEN[name]
    got = [
        h.hex() for h in compute_block_hashes(tokens, bs, extra_keys=extra, include_partial=partial)
    ]
    assert got == expect
    assert _independent(tokens, bs, extra, partial) == expect


def test_first_block_literal_bytes() -> None:
    """Block 0 of [0, 1, 2, 3] hashes exactly these 48 bytes."""
    data = bytes(32) + bytes([0, 0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0])
    assert bytes(32) == ROOT_PARENT
    assert compute_block_hashes([0, 1, 2, 3], 4)[0] == hashlib.sha256(data).digest()


def test_chaining_makes_identical_blocks_differ_by_prefix() -> None:
    a = compute_block_hashes([9, 9, 5, 5], 2)
    b = compute_block_hashes([7, 7, 5, 5], 2)
    assert a[0] != b[0] and a[1] != b[1]  # same block content, different parents
    assert compute_block_hashes([5, 5], 2)[0] != a[1]


def test_partial_tail_never_equals_a_full_block() -> None:
    full = compute_block_hashes([1, 2, 3, 4], 4)
    part = compute_block_hashes([1, 2, 3], 4, include_partial=True)
    assert len(part) == 1 and part[0] != full[0]
    assert compute_block_hashes([1, 2, 3], 4) == []


def test_extend_matches_full_recompute_incrementally() -> None:
    tokens = list(range(100, 137))
    hashes: list[bytes] = []
    for n in range(len(tokens) + 1):
        extend_block_hashes(hashes, tokens[:n], 8)
        assert hashes == compute_block_hashes(tokens[:n], 8)


def test_same_in_a_fresh_process_with_random_hash_seed() -> None:
    """Never Python's hash(): another interpreter (different PYTHONHASHSEED) agrees."""
    code = (
        "from common.block_hash import compute_block_hashes as c;"
        "print(c(list(range(8)), 4)[1].hex())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PYTHONHASHSEED": "12345", "PATH": "/usr/bin:/bin"},
        cwd=str(Path(__file__).resolve().parents[2]),
        check=True,
    )
    assert out.stdout.strip() == GOLDEN["range8_bs4"][4][1]


def test_bad_block_size() -> None:
    with pytest.raises(ValueError, match="block_size"):
        compute_block_hashes([1, 2], 0)
