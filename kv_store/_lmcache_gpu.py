"""LMCache's GPU-connector interface implemented for pdserve's paged cache (CPU or GPU).

Imported only by ``lmcache_connector`` after LMCache itself is imported (lazily). LMCache
hands us memory objects in its ``KV_2LTD`` format, ``[2, layers, tokens, kv_heads *
head_dim]``; our cache is ``[layers, 2, blocks, block_size, kv_heads, head_dim]``. Both
directions are one ``index_select`` / ``index_copy_`` over the flattened slot axis, where
slot = block_id * block_size + offset (``slot_mapping``, one entry per token).
"""

from __future__ import annotations

from typing import Any

import torch
from lmcache.v1.gpu_connector import GPUConnectorInterface

from kv_store.base import byte_view
from kv_store.record import copy_into


class PagedCacheConnector(GPUConnectorInterface):  # type: ignore[misc]
    """Gathers/scatters token ranges between LMCache memory objects and our paged cache.

    Every call receives ``kvcaches`` (the bound cache) and ``slot_mapping`` (int64, one
    slot per token of the request) as keyword arguments from ``store``/``retrieve``.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, planes: int = 2) -> None:
        self.num_layers = num_layers
        self.hidden = num_kv_heads * head_dim
        self.planes = planes  # 2: K and V; 1: an MLA latent cache
        self.kvcaches: torch.Tensor | None = None

    def _slots_view(self, kv: torch.Tensor) -> torch.Tensor:
        # [layers, P, blocks, block, heads, dim] -> [P, layers, slots, heads*dim] (a view)
        return kv.view(kv.shape[0], self.planes, -1, self.hidden).transpose(0, 1)

    @staticmethod
    def _planes(t: torch.Tensor) -> torch.Tensor:
        """A memory object as ``[planes, layers, tokens, hidden]``: LMCache's MLA format
        drops the plane axis (``[layers, tokens, hidden]``)."""
        return t.unsqueeze(0) if t.dim() == 3 else t

    @staticmethod
    def _run(slots: torch.Tensor) -> slice | None:
        """The slot range as a slice when it is consecutive — always the case when a chunk
        is one of our blocks — so copies are plain strided copies, not gathers."""
        first, last = int(slots[0]), int(slots[-1])
        if last - first + 1 == len(slots) and bool((slots.diff() == 1).all()):
            return slice(first, last + 1)
        return None

    def from_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        kv, slots = kwargs["kvcaches"], kwargs["slot_mapping"][start:end]
        dst = self._planes(memory_obj.tensor)[:, :, : end - start]
        run = self._run(slots)
        if run is not None:
            copy_into(dst, self._slots_view(kv)[:, :, run])
        else:
            # As bytes: torch's CPU build has no float8 index_select/index_copy_ (fp8 cache).
            byte_view(dst).copy_(self._slots_view(byte_view(kv)).index_select(2, slots))

    def to_gpu(self, memory_obj: Any, start: int, end: int, **kwargs: Any) -> None:
        kv, slots = kwargs["kvcaches"], kwargs["slot_mapping"][start:end]
        src = self._planes(memory_obj.tensor)[:, :, : end - start]
        run = self._run(slots)
        if run is not None:
            copy_into(self._slots_view(kv)[:, :, run], src)
        else:
            self._slots_view(byte_view(kv)).index_copy_(2, slots, byte_view(src))

    def batched_from_gpu(
        self, memory_objs: Any, starts: list[int], ends: list[int], **kwargs: Any
    ) -> None:
        for obj, s, e in zip(memory_objs, starts, ends, strict=True):
            self.from_gpu(obj, s, e, **kwargs)

    def batched_to_gpu(
        self,
        memory_objs: Any = None,
        starts: list[int] | None = None,
        ends: list[int] | None = None,
        **kwargs: Any,
    ) -> None:
        assert memory_objs is not None and starts is not None and ends is not None
        for obj, s, e in zip(memory_objs, starts, ends, strict=True):
            self.to_gpu(obj, s, e, **kwargs)

    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([self.planes, self.num_layers, num_tokens, self.hidden])
