"""The records' keyed MAC (kv_store/record_mac.py, docs/design.md §3): only the secret's
holders make records that verify, for one key only; the vectored header agrees with the
whole-record encoder."""

from __future__ import annotations

import pytest
import torch

from kv_store.base import KvLayout
from kv_store.record import (
    HEADER_SIZE,
    RecordChecksumError,
    block_parts,
    cache_numpy,
    check_record_parts,
    decode_block,
    encode_block,
    record_header,
)
from kv_store.record_mac import RecordMac, RecordMacError, record_mac

LAYOUT = KvLayout(1, "float32", 16, 3, 2, 4)
KEY = "pdserve/fp/00aa"


def cache() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randn(3, 2, 4, 16, 2, 4, generator=g)


def test_sealed_record_round_trips_with_the_secret_and_without_one() -> None:
    kv = cache()
    mac = RecordMac("s3cret")
    rec = encode_block(kv[:, :, 1], LAYOUT, mac=mac, key=KEY)
    assert rec[48:HEADER_SIZE] != bytes(16)
    assert torch.equal(decode_block(rec, LAYOUT, 16, mac=mac, key=KEY), kv[:, :, 1])
    # A reader without the secret checks the checksum only, as before the MAC existed.
    assert torch.equal(decode_block(rec, LAYOUT, 16), kv[:, :, 1])


def test_unsealed_record_is_refused_by_a_reader_with_the_secret() -> None:
    """A forger without the secret can still make the checksum right."""
    rec = encode_block(cache()[:, :, 0], LAYOUT)
    decode_block(rec, LAYOUT, 16)  # valid checksum
    with pytest.raises(RecordMacError, match="no MAC"):
        decode_block(rec, LAYOUT, 16, mac=RecordMac("s3cret"), key=KEY)


def test_other_secret_or_other_key_is_refused() -> None:
    rec = encode_block(cache()[:, :, 0], LAYOUT, mac=RecordMac("other"), key=KEY)
    with pytest.raises(RecordMacError, match="does not verify"):
        decode_block(rec, LAYOUT, 16, mac=RecordMac("s3cret"), key=KEY)
    mac = RecordMac("s3cret")
    rec = encode_block(cache()[:, :, 0], LAYOUT, mac=mac, key=KEY)
    with pytest.raises(RecordMacError, match="does not verify"):
        decode_block(rec, LAYOUT, 16, mac=mac, key="pdserve/fp/00ab")


@pytest.mark.parametrize("where", [48, HEADER_SIZE - 1])
def test_flipped_mac_byte_is_refused(where: int) -> None:
    mac = RecordMac("s3cret")
    rec = encode_block(cache()[:, :, 0], LAYOUT, mac=mac, key=KEY)
    rec[where] ^= 0x01
    with pytest.raises(RecordMacError):
        decode_block(rec, LAYOUT, 16, mac=mac, key=KEY)


def test_corruption_is_reported_as_checksum_not_mac() -> None:
    mac = RecordMac("s3cret")
    rec = encode_block(cache()[:, :, 0], LAYOUT, mac=mac, key=KEY)
    rec[HEADER_SIZE + 3] ^= 0x10
    with pytest.raises(RecordChecksumError):
        decode_block(rec, LAYOUT, 16, mac=mac, key=KEY)


def test_vectored_header_matches_the_encoder_and_verifies_over_the_parts() -> None:
    kv = cache()
    mac = RecordMac(b"s3cret")
    parts = block_parts(cache_numpy(kv), 2, 9)  # type: ignore[arg-type]
    head = record_header(LAYOUT, 9, parts, mac=mac, key=KEY)
    rec = encode_block(kv[:, :, 2, :9], LAYOUT, mac=mac, key=KEY)
    assert head == bytes(rec[:HEADER_SIZE])
    check_record_parts(head, parts, LAYOUT, 9, mac=mac, key=KEY)
    with pytest.raises(RecordMacError):
        check_record_parts(head, parts, LAYOUT, 9, mac=mac, key="pdserve/fp/ffff")


def test_secret_never_in_repr_and_empty_means_off() -> None:
    assert "s3cret" not in repr(RecordMac("s3cret"))
    assert record_mac("") is None and record_mac(None) is None
    with pytest.raises(ValueError, match="empty"):
        RecordMac(b"")


def test_tag_is_keyed_blake3_as_documented() -> None:
    """The contract in docs/design.md §3, recomputed independently: BLAKE3 keyed with the
    secret's derived key, over len(key) ‖ key ‖ the 48 header bytes ‖ payload, 16 bytes."""
    import struct

    from blake3 import blake3

    rec = encode_block(cache()[:, :, 2], LAYOUT, mac=RecordMac("s3cret"), key=KEY)
    derived = blake3(b"s3cret", derive_key_context="pdserve 2026-12 KV record MAC").digest()
    message = struct.pack("<I", len(KEY)) + KEY.encode() + rec[:48] + rec[HEADER_SIZE:]
    assert rec[48:HEADER_SIZE] == blake3(message, key=derived).digest(16)
