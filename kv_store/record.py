"""The KV block record codec (docs/design.md §3).

A record is a fixed 64-byte little-endian header followed by the raw tensor bytes of one
block, ``[layers, planes, block_tokens, kv_heads, head_dim]`` in C order::

    magic "PDKV" | record version u16 | layout version u16 | dtype code u8 | kind u8 | pad u8 x2 |
    layers u32 | block tokens u32 | kv heads u32 | head dim u32 | payload bytes u64 |
    reserved u8 x4 | xxh3_64 u64   (over the 40 header bytes before it, then the payload) |
    mac u8 x16   (``record_mac.RecordMac`` over the record's key, the 48 bytes before it
                  and the payload; all zero when written without a KV secret)

Record version 3 added the MAC field: checksums catch corruption, only a keyed MAC
catches a forged record (keys follow from the prompt). Version 4 (this one, same layout)
changed the MAC from HMAC-SHA256 to keyed BLAKE3 (twice as fast; ``record_mac``), so a
version-3 record is refused rather than failing its MAC. Versions 1 (40-byte header,
CRC32), 2 (48-byte header, no MAC field) and 3 are refused as unsupported, which a reader
treats like a corrupt block: deleted, recomputed, never loaded. XXH3-64 (~21 GB/s on
cached data here) replaced zlib's CRC32 (~4.4 GB/s) in version 2: CRC32 ran slower than the
copy it protected. The header stays a multiple of 16 bytes so the payload keeps the
alignment of the buffer it sits in.

A reader given a ``RecordMac`` verifies the MAC after the checksum (``RecordMacError``
when it fails, a record without a MAC included); a reader without one checks only the
checksum, as before the MAC existed.

``block_tokens`` is the number of tokens actually stored, so a partial tail block is a
shorter record. Encoding makes exactly one copy (cache view → record buffer); decoding is a
view over the record's bytes. bfloat16 and float8 have no numpy dtype, so bytes move as
int16 / int8. The dtype code (1 float32, 2 float16, 3 bfloat16, 4 float8_e4m3fn) is the
cache's storage dtype, so a record of an fp8 cache is refused by a bfloat16 reader.

``kind`` says what a layer's planes are: 0 K and V (2 planes; the byte was padding before,
so every record written earlier reads as kind 0), 1 one MLA latent per token (1 plane,
one "head" of ``kv_lora_rank + qk_rope_head_dim``; DeepSeek, docs/design.md §3 "MLA
latent cache"). A reader of the other kind refuses the record as a layout mismatch that
names both kinds, before any size is compared.
"""

from __future__ import annotations

import struct
import warnings
from collections.abc import Iterable

import numpy as np
import torch
import xxhash

from kv_store.base import KvLayout, KVRecordError
from kv_store.record_mac import MAC_SIZE, NO_MAC, RecordMac

MAGIC = b"PDKV"
RECORD_VERSION = 4
# The checksummed fields; the 4 reserved bytes pad them to 40 so that, with the u64
# checksum and the 16-byte MAC, the header is 64 bytes: a multiple of 16, keeping payload
# views aligned.
_HEADER = struct.Struct("<4sHHBB2xIIIIQ4x")
_CHECKSUM = struct.Struct("<Q")
_MAC_AT = _HEADER.size + _CHECKSUM.size  # the MAC covers the bytes before it
HEADER_SIZE = _MAC_AT + MAC_SIZE
assert HEADER_SIZE % 16 == 0


def _checksum(header: bytes | memoryview, payload: Iterable[bytes | memoryview]) -> int:
    """XXH3-64 of the checksummed header bytes then the payload pieces, streamed (no
    concatenation copy)."""
    h = xxhash.xxh3_64(header)
    for piece in payload:
        h.update(piece)
    return h.intdigest()


class RecordChecksumError(KVRecordError):
    """The record's bytes do not match its checksum (corrupted in the store or in flight)."""


class RecordLayoutError(KVRecordError):
    """The record is intact but was written for another layout (model, dtype, shape)."""


# dtype name -> (code in the header, torch dtype, same-width integer dtype used for bytes)
_DTYPES: dict[str, tuple[int, torch.dtype, torch.dtype]] = {
    "float32": (1, torch.float32, torch.int32),
    "float16": (2, torch.float16, torch.int16),
    "bfloat16": (3, torch.bfloat16, torch.int16),
    # An fp8 KV cache (kv_cache_dtype "fp8"): half a bfloat16 record's payload. Its scale is
    # fixed at 1.0 (engine/attention/kv_quant.py), so the header needs no scale field.
    "float8_e4m3fn": (4, torch.float8_e4m3fn, torch.int8),
}
_CODE_TO_NAME = {code: name for name, (code, _, _) in _DTYPES.items()}


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` for same-shape, same-dtype tensors, on CPU done by numpy in the
    calling thread. Why: torch parallelises big copies over its intra-op pool, and on a
    busy machine (engine steps on the same cores) that made a 700 KiB block copy 50×
    slower than one thread; numpy's copy never leaves the I/O thread."""
    if dst.device.type != "cpu" or src.device.type != "cpu":
        dst.copy_(src)
        return
    int_dtype = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[dst.element_size()]
    np.copyto(dst.view(int_dtype).numpy(), src.view(int_dtype).numpy(), casting="no")


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a layout dtype name; ``ValueError`` if unsupported."""
    try:
        return _DTYPES[name][1]
    except KeyError:
        raise ValueError(
            f"unsupported KV dtype {name!r}; expected one of {sorted(_DTYPES)}"
        ) from None


# The kind byte per number of planes, and the words a refusal uses for each.
_KIND_OF_PLANES = {2: 0, 1: 1}
_KIND_NAMES = {0: "per-head K/V", 1: "MLA latent"}


def layout_kind(layout: KvLayout) -> int:
    """The header's kind byte for ``layout`` (``ValueError`` for another plane count)."""
    try:
        return _KIND_OF_PLANES[layout.planes]
    except KeyError:
        raise ValueError(f"unsupported KV planes {layout.planes}; expected 1 or 2") from None


def block_shape(layout: KvLayout, num_tokens: int) -> tuple[int, int, int, int, int]:
    """Payload shape of a block holding ``num_tokens`` tokens."""
    return (layout.num_layers, layout.planes, num_tokens, layout.num_kv_heads, layout.head_dim)


def record_size(layout: KvLayout, num_tokens: int) -> int:
    """Bytes of a whole record (header + payload) for ``num_tokens`` tokens."""
    n = 1
    for d in block_shape(layout, num_tokens):
        n *= d
    return HEADER_SIZE + n * torch_dtype(layout.dtype).itemsize


def encode_block(
    tensor: torch.Tensor,
    layout: KvLayout,
    out: bytearray | None = None,
    *,
    mac: RecordMac | None = None,
    key: str = "",
) -> bytearray:
    """Encode one block ``[layers, planes, n, kv_heads, head_dim]`` (any strides, e.g. the view
    ``kv_cache[:, :, block_id, :n]``) into a record. ``ValueError`` if it does not match
    ``layout``. Returns ``out`` when it has exactly the record's size (reusing a buffer
    saves the page faults of a fresh one), else a fresh buffer the caller owns. With
    ``mac``, the record is sealed for the store key ``key``."""
    code, dtype, int_dtype = _DTYPES.get(layout.dtype, (0, None, None))
    if dtype is None or int_dtype is None:
        raise ValueError(f"unsupported KV dtype {layout.dtype!r}")
    if tensor.dtype != dtype:
        raise ValueError(f"block dtype {tensor.dtype} does not match layout dtype {layout.dtype}")
    if tensor.dim() != 5:
        raise ValueError(
            f"block must be 5-D [layers, planes, tokens, heads, dim], got {tuple(tensor.shape)}"
        )
    n = int(tensor.shape[2])
    if not 1 <= n <= layout.block_size or tuple(tensor.shape) != block_shape(layout, n):
        raise ValueError(
            f"block shape {tuple(tensor.shape)} does not match layout "
            f"{block_shape(layout, layout.block_size)} with 1..{layout.block_size} tokens"
        )
    nbytes = tensor.numel() * tensor.element_size()
    if out is None or len(out) != HEADER_SIZE + nbytes:
        out = bytearray(HEADER_SIZE + nbytes)
    payload = torch.frombuffer(out, dtype=int_dtype, offset=HEADER_SIZE).view(tensor.shape)
    copy_into(payload, tensor.view(int_dtype).cpu())  # the one copy: gather the strided view
    header = _HEADER.pack(
        MAGIC,
        RECORD_VERSION,
        layout.version,
        code,
        layout_kind(layout),
        layout.num_layers,
        n,
        layout.num_kv_heads,
        layout.head_dim,
        nbytes,
    )
    out[: _HEADER.size] = header
    view = memoryview(out)
    _CHECKSUM.pack_into(out, _HEADER.size, _checksum(header, (view[HEADER_SIZE:],)))
    seal = NO_MAC if mac is None else mac.tag(key, view[:_MAC_AT], (view[HEADER_SIZE:],))
    out[_MAC_AT:HEADER_SIZE] = seal
    return out


def _check_header(
    data: memoryview, layout: KvLayout, expected_tokens: int | None, total_len: int
) -> int:
    """Validate the header against ``layout`` and the record's ``total_len``; return the
    payload's token count."""
    if len(data) < HEADER_SIZE or total_len < HEADER_SIZE:
        raise KVRecordError(f"record too short: {total_len} bytes < header {HEADER_SIZE}")
    magic, version, layout_version, code, kind, layers, n, heads, dim, nbytes = _HEADER.unpack_from(
        data
    )
    if magic != MAGIC:
        raise KVRecordError(f"bad magic {bytes(magic)!r}: not a pdserve KV record")
    if version != RECORD_VERSION:
        raise KVRecordError(
            f"record version {version} is not supported (expected {RECORD_VERSION})"
        )
    if kind != layout_kind(layout):
        raise RecordLayoutError(
            f"record layout mismatch: the record holds a "
            f"{_KIND_NAMES.get(kind, f'kind {kind}')} cache, the reader a "
            f"{_KIND_NAMES[layout_kind(layout)]} cache (a DeepSeek model's blocks are "
            "latents, not K and V)"
        )
    got = (layout_version, _CODE_TO_NAME.get(code, f"code {code}"), layers, heads, dim)
    want = (layout.version, layout.dtype, layout.num_layers, layout.num_kv_heads, layout.head_dim)
    if got != want:
        raise RecordLayoutError(
            "record layout mismatch: (layout version, dtype, layers, kv heads, head dim) "
            f"is {got}, reader expects {want}"
        )
    if not 1 <= n <= layout.block_size:
        raise KVRecordError(f"record holds {n} tokens; block size is {layout.block_size}")
    if expected_tokens is not None and n != expected_tokens:
        raise RecordLayoutError(f"record holds {n} tokens, expected {expected_tokens}")
    if total_len != HEADER_SIZE + nbytes or nbytes != record_size(layout, n) - HEADER_SIZE:
        raise KVRecordError(
            f"record length {total_len} does not match its header ({HEADER_SIZE} + {nbytes} bytes)"
        )
    return int(n)


def decode_block(
    data: bytes | bytearray | memoryview,
    layout: KvLayout,
    expected_tokens: int | None = None,
    *,
    mac: RecordMac | None = None,
    key: str = "",
) -> torch.Tensor:
    """Decode a record into a tensor ``[layers, planes, n, kv_heads, head_dim]`` of the layout's
    dtype that views ``data`` (no copy; treat it as read-only). Raises ``KVRecordError`` on
    bad magic, version, layout mismatch, wrong token count, truncation or checksum, and
    (with ``mac``) ``RecordMacError`` unless the record was sealed for ``key``."""
    view = memoryview(data).cast("B")
    n = _check_header(view, layout, expected_tokens, len(view))
    _verify(view, (view[HEADER_SIZE:],), mac, key)
    _, dtype, int_dtype = _DTYPES[layout.dtype]
    with warnings.catch_warnings():
        # ``bytes`` from a socket are read-only; the view is only ever read from.
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(view, dtype=int_dtype, offset=HEADER_SIZE)
    return raw.view(dtype).view(block_shape(layout, n))


# -- scatter/gather: records straight from / into the paged cache (fs fast path) ----------


def cache_numpy(kv_cache: torch.Tensor) -> np.ndarray | None:
    """An integer-typed numpy view of a contiguous CPU cache (None on GPU or for a strided
    cache), for ``block_parts``."""
    if kv_cache.device.type != "cpu" or not kv_cache.is_contiguous():
        return None
    int_dtype = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
        kv_cache.element_size()
    ]
    return kv_cache.view(int_dtype).numpy()


def block_parts(cache_np: np.ndarray, block_id: int, num_tokens: int) -> list[memoryview]:
    """The ``planes × layers`` contiguous pieces of one block's first ``num_tokens`` tokens,
    in record payload order (C order of ``[layers, planes, n, heads, dim]``), as byte views of the
    cache (from ``cache_numpy``): a writer hands them to ``writev``/``sendmsg`` and a
    reader ``readv``s/``recvmsg_into``s into them, with no intermediate buffer. Sliced
    from one flat view: ~10x cheaper than numpy indexing for the 60-64 pieces a block has."""
    flat = cache_np.data.cast("B")
    s_layer, s_kv, s_block, s_token = cache_np.strides[:4]
    start, size = block_id * s_block, num_tokens * s_token
    # C order: layer l, plane p starts at l * s_layer + p * s_kv, and s_layer == planes * s_kv.
    return [
        flat[start + off : start + off + size]
        for off in range(0, cache_np.shape[0] * s_layer, s_kv)
    ]


def record_header(
    layout: KvLayout,
    num_tokens: int,
    parts: list[memoryview],
    *,
    mac: RecordMac | None = None,
    key: str = "",
) -> bytes:
    """The header (with checksum, and with ``mac`` the MAC for the store key ``key``) of
    the record whose payload is ``parts`` in order."""
    code = _DTYPES[layout.dtype][0]
    nbytes = sum(p.nbytes for p in parts)
    header = _HEADER.pack(
        MAGIC,
        RECORD_VERSION,
        layout.version,
        code,
        layout_kind(layout),
        layout.num_layers,
        num_tokens,
        layout.num_kv_heads,
        layout.head_dim,
        nbytes,
    )
    head = header + _CHECKSUM.pack(_checksum(header, parts))
    return head + (NO_MAC if mac is None else mac.tag(key, head, parts))


def check_record_parts(
    header: bytes | bytearray,
    parts: list[memoryview],
    layout: KvLayout,
    expected_tokens: int,
    *,
    mac: RecordMac | None = None,
    key: str = "",
) -> None:
    """Verify a record read as ``header`` + ``parts`` (``KVRecordError`` subclasses as in
    ``decode_block``)."""
    view = memoryview(header)
    total = HEADER_SIZE + sum(p.nbytes for p in parts)
    _check_header(view, layout, expected_tokens, total)
    _verify(view, parts, mac, key)


def _verify(
    header: memoryview,
    payload: list[memoryview] | tuple[memoryview, ...],
    mac: RecordMac | None,
    key: str,
) -> None:
    """``RecordChecksumError`` unless the header's stored checksum matches the record;
    then, with ``mac``, ``RecordMacError`` unless its MAC does. The checksum goes first so
    that corruption is reported as such, and a forgery (valid checksum) as ``mac``."""
    (stored,) = _CHECKSUM.unpack_from(header, _HEADER.size)
    computed = _checksum(header[: _HEADER.size], payload)
    if computed != stored:
        raise RecordChecksumError(
            f"record checksum mismatch (stored {stored:#018x}, computed {computed:#018x})"
        )
    if mac is not None:
        mac.verify(key, header[:_MAC_AT], payload, bytes(header[_MAC_AT:HEADER_SIZE]))
