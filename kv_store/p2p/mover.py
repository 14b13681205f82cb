"""Moving blocks of the paged cache ``[layers, 2, blocks, block, heads, dim]`` over a pair.

Blocks go in batches: the sender gathers a batch with one ``index_select`` on the block
dimension into a staging tensor and posts one send; the receiver receives into staging and
scatters with one ``index_copy_``. Two staging slots alternate, so gathering batch k+1 (or
scattering batch k) overlaps the wire moving the other one. On a CUDA cache every copy runs
on a side stream, so the engine's steps do not queue behind a transfer; the stream is
synchronized before a transfer is reported. Over gloo a CUDA cache is staged through pinned
host memory (gloo moves host buffers); over NCCL the staging stays on the device.

Whole blocks move, a partial tail block included: the receiver's block is its own, freshly
allocated, and positions past the prompt are overwritten by its own compute.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from kv_store.base import byte_view
from kv_store.p2p.group import PairGroup

DEFAULT_BATCH_BYTES = 64 * 1024 * 1024


class BlockMover:
    """Sends or receives blocks of one bound cache over a ``PairGroup``. Not thread-safe:
    each pair's worker owns one (its staging is reused from transfer to transfer)."""

    def __init__(self, kv: torch.Tensor, wire: str, batch_bytes: int = DEFAULT_BATCH_BYTES) -> None:
        """``wire``: ``"nccl"`` (tensors stay on the cache's device) or ``"gloo"``."""
        if batch_bytes < 1:
            raise ValueError(f"batch_bytes must be >= 1, got {batch_bytes}")
        # Bytes only: an fp8 cache moves as uint8 (gloo has no float8, nor has torch's CPU
        # index_copy_), which is also exactly what a receiving fp8 cache holds.
        self.kv = byte_view(kv)
        layers, two, _, block, heads, dim = kv.shape
        self._block_shape = (layers, two, block, heads, dim)
        self.block_bytes = layers * two * block * heads * dim * kv.element_size()
        self.batch_blocks = max(1, batch_bytes // self.block_bytes)
        self.cuda = kv.device.type == "cuda"
        self.host_staged = self.cuda and wire == "gloo"
        self.stream = torch.cuda.Stream(kv.device) if self.cuda else None
        self._slots: list[torch.Tensor] = []  # [layers, 2, batch_blocks, block, heads, dim]
        self._host: list[torch.Tensor] = []  # pinned flat bytes per slot (host_staged only)

    # -- staging ------------------------------------------------------------------------
    def _ensure_slots(self, count: int) -> None:
        """Allocate the two slots once, sized for ``min(count, batch_blocks)`` blocks, and
        grow them when a larger transfer comes (up to ``batch_blocks``)."""
        need = min(count, self.batch_blocks)
        if self._slots and self._slots[0].shape[2] >= need:
            return
        layers, two, block, heads, dim = self._block_shape
        shape = (layers, two, need, block, heads, dim)
        self._slots = [
            torch.empty(shape, dtype=self.kv.dtype, device=self.kv.device) for _ in range(2)
        ]
        if self.host_staged:
            nbytes = self._slots[0].numel() * self.kv.element_size()
            self._host = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)]

    def _view(self, slot: int, n: int) -> torch.Tensor:
        """Slot ``slot`` as a contiguous ``[layers, 2, n, block, heads, dim]`` tensor."""
        flat = self._slots[slot].view(-1)
        layers, two, block, heads, dim = self._block_shape
        return flat[: layers * two * n * block * heads * dim].view(
            layers, two, n, block, heads, dim
        )

    def _wire(self, slot: int, n: int) -> torch.Tensor:
        """The flat bytes that travel for ``n`` blocks of ``slot`` (host copy when staged)."""
        nbytes = n * self.block_bytes
        if self.host_staged:
            return self._host[slot][:nbytes]
        return self._view(slot, n).view(-1).view(torch.uint8)[:nbytes]

    def _on_stream(self) -> contextlib.AbstractContextManager[Any]:
        return (
            torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        )

    def batches(self, count: int) -> list[tuple[int, int]]:
        """``[start, end)`` of each batch of a ``count``-block transfer (both sides agree)."""
        b = self.batch_blocks
        return [(a, min(a + b, count)) for a in range(0, count, b)]

    def _ids(self, block_ids: list[int]) -> torch.Tensor:
        return torch.tensor(block_ids, dtype=torch.long, device=self.kv.device)

    # -- the two directions ----------------------------------------------------------------
    def send(
        self, group: PairGroup, block_ids: list[int], deadline: float, ready: Any = None
    ) -> int:
        """Send the blocks ``block_ids`` of the cache, in batches; returns the bytes sent.
        ``ready``: a CUDA event recorded after the KV was written (the side stream waits)."""
        if not block_ids:
            return 0
        self._ensure_slots(len(block_ids))
        pending: list[Any] = [None, None]
        if self.stream is not None and ready is not None:
            self.stream.wait_event(ready)
        for k, (a, b) in enumerate(self.batches(len(block_ids))):
            slot = k % 2
            if pending[slot] is not None:  # the send that last read this slot must be done
                group.wait(pending[slot], deadline)
            view = self._view(slot, b - a)
            with self._on_stream():
                torch.index_select(self.kv, 2, self._ids(block_ids[a:b]), out=view)
                if self.host_staged:
                    self._host[slot][: view.numel() * view.element_size()].copy_(
                        view.view(-1).view(torch.uint8), non_blocking=True
                    )
                    assert self.stream is not None
                    self.stream.synchronize()  # gloo reads the host buffer from its thread
                pending[slot] = group.send(self._wire(slot, b - a), tag=k)
        for work in pending:
            if work is not None:
                group.wait(work, deadline)
        return len(block_ids) * self.block_bytes

    def recv(
        self, group: PairGroup, block_ids: list[int], deadline: float, ready: Any = None
    ) -> int:
        """Receive ``len(block_ids)`` blocks into the cache blocks ``block_ids``; returns the
        bytes received. ``ready``: a CUDA event after which the blocks may be overwritten.
        On return the blocks are in the cache (the side stream has been synchronized)."""
        if not block_ids:
            return 0
        self._ensure_slots(len(block_ids))
        spans = self.batches(len(block_ids))
        if self.stream is not None and ready is not None:
            self.stream.wait_event(ready)
        works: list[Any] = []

        def post(k: int) -> None:
            a, b = spans[k]
            with self._on_stream():  # NCCL: the recv waits for the slot's last scatter
                works.append(group.recv(self._wire(k % 2, b - a), tag=k))

        for k in range(min(2, len(spans))):
            post(k)
        for k, (a, b) in enumerate(spans):
            with self._on_stream():
                group.wait(works[k], deadline)
            slot = k % 2
            view = self._view(slot, b - a)
            with self._on_stream():
                if self.host_staged:
                    view.view(-1).view(torch.uint8).copy_(
                        self._wire(slot, b - a), non_blocking=True
                    )
                self.kv.index_copy_(2, self._ids(block_ids[a:b]), view)
            if k + 2 < len(spans):
                if self.host_staged:
                    assert self.stream is not None
                    self.stream.synchronize()  # the host slot is read before gloo refills it
                post(k + 2)
        if self.stream is not None:
            self.stream.synchronize()
        return len(block_ids) * self.block_bytes


def record_ready(kv: torch.Tensor) -> Any:
    """A CUDA event on the calling thread's current stream (the engine's), or None for a CPU
    cache: work queued so far on that stream — writes of the KV, or of blocks being reused —
    completes before a mover's side stream touches the blocks."""
    if kv.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(kv.device))
    return event
