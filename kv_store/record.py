"""The KV block record codec (DESIGN §3).

A record is a fixed 40-byte little-endian header followed by the raw tensor bytes of one
block, ``[layers, 2, block_tokens, kv_heads, head_dim]`` in C order::

    magic "PDKV" | record version u16 | layout version u16 | dtype code u8 | pad u8 x3 |
    layers u32 | block tokens u32 | kv heads u32 | head dim u32 | payload bytes u64 |
    crc32 u32   (over the header bytes before it, then the payload)

``block_tokens`` is the number of tokens actually stored, so a partial tail block is a
shorter record. Encoding makes exactly one copy (cache view → record buffer); decoding is a
view over the record's bytes. bfloat16 has no numpy dtype, so bytes move as int16.
"""

from __future__ import annotations

import struct
import warnings
import zlib

import numpy as np
import torch

from kv_store.base import KvLayout, KVRecordError

MAGIC = b"PDKV"
RECORD_VERSION = 1
_HEADER = struct.Struct("<4sHHB3xIIIIQ")
_CRC = struct.Struct("<I")
HEADER_SIZE = _HEADER.size + _CRC.size


class RecordChecksumError(KVRecordError):
    """The record's bytes do not match its checksum (corrupted in the store or in flight)."""


class RecordLayoutError(KVRecordError):
    """The record is intact but was written for another layout (model, dtype, shape)."""


# dtype name -> (code in the header, torch dtype, same-width integer dtype used for bytes)
_DTYPES: dict[str, tuple[int, torch.dtype, torch.dtype]] = {
    "float32": (1, torch.float32, torch.int32),
    "float16": (2, torch.float16, torch.int16),
    "bfloat16": (3, torch.bfloat16, torch.int16),
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


def block_shape(layout: KvLayout, num_tokens: int) -> tuple[int, int, int, int, int]:
    """Payload shape of a block holding ``num_tokens`` tokens."""
    return (layout.num_layers, 2, num_tokens, layout.num_kv_heads, layout.head_dim)


def record_size(layout: KvLayout, num_tokens: int) -> int:
    """Bytes of a whole record (header + payload) for ``num_tokens`` tokens."""
    n = 1
    for d in block_shape(layout, num_tokens):
        n *= d
    return HEADER_SIZE + n * torch_dtype(layout.dtype).itemsize


def encode_block(tensor: torch.Tensor, layout: KvLayout, out: bytearray | None = None) -> bytearray:
    """Encode one block ``[layers, 2, n, kv_heads, head_dim]`` (any strides, e.g. the view
    ``kv_cache[:, :, block_id, :n]``) into a record. ``ValueError`` if it does not match
    ``layout``. Returns ``out`` when it has exactly the record's size (reusing a buffer
    saves the page faults of a fresh one), else a fresh buffer the caller owns."""
    code, dtype, int_dtype = _DTYPES.get(layout.dtype, (0, None, None))
    if dtype is None or int_dtype is None:
        raise ValueError(f"unsupported KV dtype {layout.dtype!r}")
    if tensor.dtype != dtype:
        raise ValueError(f"block dtype {tensor.dtype} does not match layout dtype {layout.dtype}")
    if tensor.dim() != 5:
        raise ValueError(
            f"block must be 5-D [layers, 2, tokens, heads, dim], got {tuple(tensor.shape)}"
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
        layout.num_layers,
        n,
        layout.num_kv_heads,
        layout.head_dim,
        nbytes,
    )
    out[: _HEADER.size] = header
    view = memoryview(out)
    crc = zlib.crc32(view[HEADER_SIZE:], zlib.crc32(header))
    _CRC.pack_into(out, _HEADER.size, crc)
    return out


def _check_header(
    data: memoryview, layout: KvLayout, expected_tokens: int | None, total_len: int
) -> int:
    """Validate the header against ``layout`` and the record's ``total_len``; return the
    payload's token count."""
    if len(data) < HEADER_SIZE or total_len < HEADER_SIZE:
        raise KVRecordError(f"record too short: {total_len} bytes < header {HEADER_SIZE}")
    magic, version, layout_version, code, layers, n, heads, dim, nbytes = _HEADER.unpack_from(data)
    if magic != MAGIC:
        raise KVRecordError(f"bad magic {bytes(magic)!r}: not a pdserve KV record")
    if version != RECORD_VERSION:
        raise KVRecordError(
            f"record version {version} is not supported (expected {RECORD_VERSION})"
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
    data: bytes | bytearray | memoryview, layout: KvLayout, expected_tokens: int | None = None
) -> torch.Tensor:
    """Decode a record into a tensor ``[layers, 2, n, kv_heads, head_dim]`` of the layout's
    dtype that views ``data`` (no copy; treat it as read-only). Raises ``KVRecordError`` on
    bad magic, version, layout mismatch, wrong token count, truncation or checksum."""
    view = memoryview(data).cast("B")
    n = _check_header(view, layout, expected_tokens, len(view))
    (stored_crc,) = _CRC.unpack_from(view, _HEADER.size)
    crc = zlib.crc32(view[HEADER_SIZE:], zlib.crc32(view[: _HEADER.size]))
    if crc != stored_crc:
        raise RecordChecksumError(
            f"record checksum mismatch (stored {stored_crc:#010x}, computed {crc:#010x})"
        )
    _, dtype, int_dtype = _DTYPES[layout.dtype]
    with warnings.catch_warnings():
        # ``bytes`` from a socket are read-only; the view is only ever read from.
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(view, dtype=int_dtype, offset=HEADER_SIZE)
    return raw.view(dtype).view(block_shape(layout, n))


# -- scatter/gather: records straight from / into the paged cache (fs fast path) ----------


def cache_numpy(kv_cache: torch.Tensor) -> np.ndarray | None:
    """An integer-typed numpy view of a CPU cache (None on GPU), for ``block_parts``."""
    if kv_cache.device.type != "cpu":
        return None
    int_dtype = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
        kv_cache.element_size()
    ]
    return kv_cache.view(int_dtype).numpy()


def block_parts(cache_np: np.ndarray, block_id: int, num_tokens: int) -> list[np.ndarray]:
    """The ``2 × layers`` contiguous pieces of one block's first ``num_tokens`` tokens, in
    record payload order (C order of ``[layers, 2, n, heads, dim]``), as views of the
    cache: a writer hands them to ``writev`` and a reader ``readv``s into them, with no
    intermediate buffer."""
    layers = cache_np.shape[0]
    return [cache_np[layer, kv, block_id, :num_tokens] for layer in range(layers) for kv in (0, 1)]


def record_header(layout: KvLayout, num_tokens: int, parts: list[np.ndarray]) -> bytes:
    """The header (with checksum) of the record whose payload is ``parts`` in order."""
    code = _DTYPES[layout.dtype][0]
    nbytes = sum(p.nbytes for p in parts)
    header = _HEADER.pack(
        MAGIC,
        RECORD_VERSION,
        layout.version,
        code,
        layout.num_layers,
        num_tokens,
        layout.num_kv_heads,
        layout.head_dim,
        nbytes,
    )
    crc = zlib.crc32(header)
    for p in parts:
        crc = zlib.crc32(p.data, crc)
    return header + _CRC.pack(crc)


def check_record_parts(
    header: bytes | bytearray, parts: list[np.ndarray], layout: KvLayout, expected_tokens: int
) -> None:
    """Verify a record read as ``header`` + ``parts`` (``KVRecordError`` subclasses as in
    ``decode_block``)."""
    view = memoryview(header)
    total = HEADER_SIZE + sum(p.nbytes for p in parts)
    _check_header(view, layout, expected_tokens, total)
    (stored_crc,) = _CRC.unpack_from(view, _HEADER.size)
    crc = zlib.crc32(view[: _HEADER.size])
    for p in parts:
        crc = zlib.crc32(p.data, crc)
    if crc != stored_crc:
        raise RecordChecksumError(
            f"record checksum mismatch (stored {stored_crc:#010x}, computed {crc:#010x})"
        )
