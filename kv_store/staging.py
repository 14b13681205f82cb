"""Host staging of block batches between a (GPU) paged cache and a store, for
``BlockStoreConnector`` (one ``Staging`` per I/O thread)."""

from __future__ import annotations

import contextlib

import numpy as np
import torch

from kv_store.base import byte_view
from kv_store.record import cache_numpy


class Staging:
    """One I/O thread's host buffer (pinned for a GPU cache) and stream for moving a batch
    of blocks between the cache and the store: a save gathers the batch's blocks on the
    device and copies them out in one transfer, a load copies the verified records in with
    one transfer and scatters them on the device. Per-block ``.cpu()`` / ``copy_`` calls
    cost a synchronous small copy each (the two-GPU run moved 512 MiB of KV at ~1 GB/s);
    the side stream keeps these copies off the engine's compute stream."""

    def __init__(self, kv: torch.Tensor, max_blocks: int) -> None:
        layers, two, _, block_size, heads, dim = kv.shape
        self.block_dims = (layers, two, block_size, heads, dim)
        per_block = layers * two * block_size * heads * dim
        cuda = kv.device.type == "cuda"
        self.flat = torch.empty(max_blocks * per_block, dtype=kv.dtype, pin_memory=cuda)
        self.stream = torch.cuda.Stream(kv.device) if cuda else None

    def _view(self, count: int) -> torch.Tensor:
        layers, two, block_size, heads, dim = self.block_dims
        n = layers * two * count * block_size * heads * dim
        return self.flat[:n].view(layers, two, count, block_size, heads, dim)

    def _on_stream(self) -> contextlib.AbstractContextManager[object]:
        return (
            torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        )

    def host(self, count: int) -> np.ndarray:
        """The buffer for ``count`` blocks as an integer numpy array (for ``block_parts``)."""
        host = cache_numpy(self._view(count))
        assert host is not None
        return host

    def gather(self, kv: torch.Tensor, block_ids: list[int]) -> np.ndarray:
        """Copy the blocks ``block_ids`` of ``kv`` into the buffer (slots 0, 1, ...)."""
        # fp8 caches move as bytes: torch's CPU build has no float8 index_copy_.
        view, kv = byte_view(self._view(len(block_ids))), byte_view(kv)
        with self._on_stream():
            ids = torch.tensor(block_ids, dtype=torch.long, device=kv.device)
            view.copy_(kv.index_select(2, ids), non_blocking=True)
        if self.stream is not None:
            self.stream.synchronize()
        return self.host(len(block_ids))

    def scatter(
        self, kv: torch.Tensor, targets: list[tuple[int, int]], block_size: int, slots: int
    ) -> None:
        """Copy slot j of the buffer as last filled for ``slots`` blocks (``host(slots)``:
        the layout depends on the count) into block ``targets[j][0]`` of ``kv``, its first
        ``targets[j][1]`` tokens only (a partial block leaves the rest untouched)."""
        view, kv = byte_view(self._view(slots)), byte_view(kv)
        with self._on_stream():
            src = view.to(kv.device, non_blocking=True)
            full = [j for j, (_, n) in enumerate(targets) if n == block_size]
            if full:
                ids = torch.tensor(
                    [targets[j][0] for j in full], dtype=torch.long, device=kv.device
                )
                rows = src if len(full) == slots else src[:, :, full]
                kv.index_copy_(2, ids, rows)
            for j, (block_id, n) in enumerate(targets):
                if n != block_size:
                    kv[:, :, block_id, :n].copy_(src[:, :, j, :n])
        if self.stream is not None:
            self.stream.synchronize()
