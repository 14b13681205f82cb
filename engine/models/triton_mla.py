"""The MLA latent store on CUDA: one launch writes every token's latent row at its slot,
skipping negative slots on the device (a captured decode graph's padding rows), with no
host synchronisation (engine/models/mla.py ``store_latent``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _store_latent(latent_ptr, cache_ptr, slots_ptr, dim, row_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, BLOCK)
        mask = offs < dim
        v = tl.load(latent_ptr + row * row_stride + offs, mask=mask)
        tl.store(cache_ptr + slot * dim + offs, v.to(cache_ptr.dtype.element_ty), mask=mask)


def store_latent_triton(kv_cache: torch.Tensor, latent: torch.Tensor, slots: torch.Tensor) -> None:
    """``latent [T, D]`` into the contiguous cache ``[1, blocks, block_size, 1, D]``."""
    rows, dim = latent.shape
    if rows == 0:
        return
    if not kv_cache.is_contiguous() or latent.stride(-1) != 1:
        raise ValueError("store_latent_triton needs a contiguous cache and latent rows")
    _store_latent[(rows,)](
        latent, kv_cache, slots, dim, latent.stride(0), BLOCK=triton.next_power_of_2(dim)
    )
