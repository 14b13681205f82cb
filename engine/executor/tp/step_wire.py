"""A step's host inputs as one small header plus one packed buffer (tensor parallelism).

Rank 0 builds each step's ``HostInputs`` (``engine/executor/step_inputs.py``) and hands them to the
other ranks as a fixed-size header (the operation and every segment's length: 80 bytes)
and one int64 buffer holding every segment back to back (the int32 ones widened), written
together on each worker's pipe: one write per worker and step, and rank 0 need not wait
for the worker to wake (a broadcast would). The receiving ranks rebuild the same
``HostInputs`` and copy it to their device exactly as rank 0 does.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np

from engine.executor.step_inputs import HostInputs

OP_STEP = 1
OP_SHUTDOWN = 2
# A KV-connector message (``engine/kv/tp.py``): ``num_ids`` bytes of JSON follow the header
# on the pipe itself (no broadcast).
OP_KV = 3
_HEADER = struct.Struct("<10q")
HEADER_SIZE = _HEADER.size


@dataclass(frozen=True, slots=True)
class Header:
    """The operation and the lengths ``unpack`` needs (``buffer_len`` int64s follow the
    header on the pipe); ``ids_on_device``: the token ids follow in a broadcast on the
    device (async scheduling)."""

    op: int
    num_ids: int = 0
    num_tokens: int = 0
    num_logits: int = 0
    num_reqs: int = 0
    max_blocks: int = 0
    max_query_len: int = 0
    ids_on_device: bool = False
    # The step's number (pipeline parallelism: the tag of its sends between stages).
    seq: int = 0

    @property
    def buffer_len(self) -> int:
        """int64 elements of the packed buffer."""
        return (
            self.num_ids
            + 2 * self.num_tokens
            + self.num_logits
            + (self.num_reqs + 1)
            + self.num_reqs
            + self.num_reqs * self.max_blocks
        )

    def encode(self) -> bytes:
        return _HEADER.pack(
            self.op,
            self.num_ids,
            self.num_tokens,
            self.num_logits,
            self.num_reqs,
            self.max_blocks,
            self.max_query_len,
            int(self.ids_on_device),
            self.buffer_len,
            self.seq,
        )

    @classmethod
    def decode(cls, data: bytes) -> Header:
        """``ValueError`` for bytes that are not a header (a torn or foreign write)."""
        if len(data) != HEADER_SIZE:
            raise ValueError(f"step header is {HEADER_SIZE} bytes, got {len(data)}")
        f = _HEADER.unpack(data)
        header = cls(f[0], f[1], f[2], f[3], f[4], f[5], f[6], bool(f[7]), f[9])
        if header.op not in (OP_STEP, OP_SHUTDOWN, OP_KV) or header.buffer_len != f[8]:
            raise ValueError(f"not a step header: {f}")
        return header


def pack(host: HostInputs, ids_on_device: bool, seq: int = 0) -> tuple[Header, np.ndarray]:
    """The header and the packed int64 buffer of ``host`` (step number ``seq``)."""
    n, max_blocks = host.block_tables.shape
    header = Header(
        OP_STEP,
        num_ids=int(host.ids.size),
        num_tokens=int(host.positions.size),
        num_logits=int(host.logits_idx.size),
        num_reqs=n,
        max_blocks=max_blocks,
        max_query_len=host.max_query_len,
        ids_on_device=ids_on_device,
        seq=seq,
    )
    parts = (
        host.ids,
        host.positions,
        host.slots,
        host.logits_idx,
        host.query_start_loc,
        host.seq_lens,
        host.block_tables.reshape(-1),
    )
    return header, np.concatenate(parts, dtype=np.int64)


def unpack(header: Header, buffer: np.ndarray) -> HostInputs:
    """``HostInputs`` from a header and its buffer (views into ``buffer`` where the dtype
    allows; the int32 segments are copies)."""
    if buffer.size != header.buffer_len:
        raise ValueError(f"step buffer holds {buffer.size} values, header says {header.buffer_len}")
    sizes = (
        header.num_ids,
        header.num_tokens,
        header.num_tokens,
        header.num_logits,
        header.num_reqs + 1,
        header.num_reqs,
        header.num_reqs * header.max_blocks,
    )
    bounds = np.cumsum((0, *sizes))
    ids, positions, slots, logits_idx, qsl, lens, tables = (
        buffer[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)
    )
    qsl32, lens32 = qsl.astype(np.int32), lens.astype(np.int32)
    return HostInputs(
        ids,
        positions,
        slots,
        logits_idx,
        qsl32,
        lens32,
        tables.astype(np.int32).reshape(header.num_reqs, header.max_blocks),
        header.max_query_len,
        qsl32.tolist(),
        lens32.tolist(),
    )
