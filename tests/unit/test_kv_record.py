"""The KV record codec and key format (docs/design.md §3)."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch

from kv_store.base import KvLayout, KVRecordError
from kv_store.keys import block_key
from kv_store.record import (
    HEADER_SIZE,
    RECORD_VERSION,
    RecordChecksumError,
    RecordLayoutError,
    block_parts,
    cache_numpy,
    check_record_parts,
    decode_block,
    encode_block,
    record_header,
    record_size,
)

LAYOUT = KvLayout(
    version=1, dtype="float32", block_size=16, num_layers=3, num_kv_heads=2, head_dim=4
)


def cache(dtype: torch.dtype = torch.float32, blocks: int = 4) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    return torch.randn(3, 2, blocks, 16, 2, 4, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_round_trip_full_block(dtype: str) -> None:
    lay = KvLayout(1, dtype, 16, 3, 2, 4)
    kv = cache(getattr(torch, dtype))
    rec = encode_block(kv[:, :, 2], lay)
    assert len(rec) == record_size(lay, 16) == HEADER_SIZE + kv[:, :, 2].numel() * kv.element_size()
    out = decode_block(bytes(rec), lay, expected_tokens=16)
    assert out.dtype == kv.dtype and out.shape == (3, 2, 16, 2, 4)
    bits = torch.int32 if dtype == "float32" else torch.int16  # bitwise, not numeric, equality
    assert torch.equal(out.contiguous().view(bits), kv[:, :, 2].contiguous().view(bits))


def test_round_trip_is_bit_exact_for_nan_and_negative_zero() -> None:
    kv = cache()
    kv[0, 0, 1, 0, 0, 0] = float("nan")
    kv[0, 1, 1, 0, 0, 1] = -0.0
    out = decode_block(encode_block(kv[:, :, 1], LAYOUT), LAYOUT)
    assert torch.equal(out.view(torch.int32), kv[:, :, 1].contiguous().view(torch.int32))


def test_partial_block_stores_only_its_tokens() -> None:
    kv = cache()
    rec = encode_block(kv[:, :, 3, :5], LAYOUT)
    assert len(rec) == record_size(LAYOUT, 5) < record_size(LAYOUT, 16)
    out = decode_block(rec, LAYOUT, expected_tokens=5)
    assert torch.equal(out, kv[:, :, 3, :5])
    with pytest.raises(RecordLayoutError, match="holds 5 tokens, expected 16"):
        decode_block(rec, LAYOUT, expected_tokens=16)


def test_header_is_64_bytes_so_the_payload_stays_16_byte_aligned() -> None:
    assert HEADER_SIZE == 64 and RECORD_VERSION == 4
    rec = encode_block(cache()[:, :, 0], LAYOUT)
    assert rec[:4] == b"PDKV" and struct.unpack_from("<H", rec, 4) == (4,)
    assert rec[36:40] == b"\0\0\0\0"  # reserved
    assert rec[48:64] == bytes(16)  # no KV secret: the MAC field is zero


# A payload byte (start, end), the checksum itself, and header bytes that no field check
# looks at (padding at 10 after the kind byte, reserved at 37): only the checksum can catch
# those. (The MAC field, 48..63, is checked only by a reader with the KV secret:
# test_kv_record_mac; a flipped kind byte, 9, is refused as another layout: test_mla_kv.)
@pytest.mark.parametrize("where", [HEADER_SIZE + 7, -1, 47, 40, 10, 37])
def test_any_flipped_byte_is_detected(where: int) -> None:
    rec = encode_block(cache()[:, :, 0], LAYOUT)
    rec[where] ^= 0x01
    with pytest.raises(RecordChecksumError, match="checksum"):
        decode_block(rec, LAYOUT)


def test_header_field_corruption_is_detected() -> None:
    rec = encode_block(cache()[:, :, 0], LAYOUT)
    bad = bytearray(rec)
    bad[0:4] = b"XXXX"
    with pytest.raises(KVRecordError, match="bad magic"):
        decode_block(bad, LAYOUT)
    bad = bytearray(rec)
    bad[4] = 9  # record version
    with pytest.raises(KVRecordError, match="version 9"):
        decode_block(bad, LAYOUT)
    with pytest.raises(KVRecordError, match="too short"):
        decode_block(rec[:10], LAYOUT)
    with pytest.raises(KVRecordError, match="length"):
        decode_block(rec[:-4], LAYOUT)


def _v1_record(kv: torch.Tensor, lay: KvLayout) -> bytes:
    """A record as version 1 wrote it: 40-byte header ending in a CRC32."""
    payload = kv.contiguous().numpy().tobytes()
    header = struct.pack(
        "<4sHHB3xIIIIQ", b"PDKV", 1, lay.version, 1, lay.num_layers, int(kv.shape[2]),
        lay.num_kv_heads, lay.head_dim, len(payload),
    )  # fmt: skip
    return header + struct.pack("<I", zlib.crc32(payload, zlib.crc32(header))) + payload


def test_version_1_record_is_refused_not_misread() -> None:
    rec = _v1_record(cache()[:, :, 0], LAYOUT)
    with pytest.raises(KVRecordError, match="record version 1 is not supported .expected 4"):
        decode_block(rec, LAYOUT, expected_tokens=16)


def test_version_2_record_is_refused_not_misread() -> None:
    """Version 2: the 48-byte header without the MAC field (checksum still valid)."""
    kv = cache()[:, :, 0]
    rec = encode_block(kv, LAYOUT)
    v2 = bytearray(rec[:48] + rec[HEADER_SIZE:])
    struct.pack_into("<H", v2, 4, 2)
    with pytest.raises(KVRecordError, match="record version 2 is not supported .expected 4"):
        decode_block(v2, LAYOUT, expected_tokens=16)


@pytest.mark.parametrize(
    "other",
    [
        KvLayout(1, "bfloat16", 16, 3, 2, 4),
        KvLayout(2, "float32", 16, 3, 2, 4),
        KvLayout(1, "float32", 16, 4, 2, 4),
        KvLayout(1, "float32", 16, 3, 1, 4),
        KvLayout(1, "float32", 16, 3, 2, 8),
    ],
)
def test_wrong_layout_is_refused(other: KvLayout) -> None:
    rec = encode_block(cache()[:, :, 0], LAYOUT)
    with pytest.raises(RecordLayoutError, match="layout mismatch"):
        decode_block(rec, other)


def test_encode_rejects_mismatched_tensor() -> None:
    kv = cache()
    with pytest.raises(ValueError, match="dtype"):
        encode_block(kv[:, :, 0].to(torch.float16), LAYOUT)
    with pytest.raises(ValueError, match="shape"):
        encode_block(kv[:2, :, 0], LAYOUT)
    with pytest.raises(ValueError, match="5-D"):
        encode_block(kv[:, :, 0, 0], LAYOUT)
    with pytest.raises(ValueError, match="unsupported"):
        encode_block(kv[:, :, 0], KvLayout(1, "int8", 16, 3, 2, 4))


def test_block_key_format() -> None:
    h = bytes(range(32))
    assert block_key("abc123", h) == "pdserve/abc123/" + h.hex()
    with pytest.raises(ValueError):
        block_key("", h)
    with pytest.raises(ValueError):
        block_key("a/b", h)
    with pytest.raises(ValueError):
        block_key("abc", b"")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_scattered_record_equals_encoded_record(dtype: str) -> None:
    """The fast paths' record (header + cache slices, no buffer) is byte for byte the
    record ``encode_block`` builds, and ``check_record_parts`` accepts it."""
    lay = KvLayout(1, dtype, 16, 3, 2, 4)
    kv = cache(getattr(torch, dtype))
    kv_np = cache_numpy(kv)
    assert kv_np is not None
    for block, n in [(0, 16), (2, 16), (3, 5), (1, 1)]:
        parts = block_parts(kv_np, block, n)
        assert len(parts) == 2 * 3
        header = record_header(lay, n, parts)
        assert header + b"".join(parts) == bytes(encode_block(kv[:, :, block, :n], lay))
        check_record_parts(header, parts, lay, n)
        bad = bytearray(header)
        bad[37] ^= 1  # a reserved byte
        with pytest.raises(RecordChecksumError):
            check_record_parts(bad, parts, lay, n)
    assert cache_numpy(kv.transpose(0, 1)) is None  # strided: no slicing into it
