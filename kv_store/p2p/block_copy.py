"""One Triton launch that copies paged-cache blocks from one cache into another (CUDA IPC
handoff, ``ipc.py``): each block is read once and written once.

``index_select`` + ``index_copy_`` move every byte twice through a temporary; for a handoff
of hundreds of MiB that doubles the time. Here program (i, plane, chunk) copies chunk
``chunk`` of block ``src_ids[i]`` of plane ``plane`` (a layer's K or V) to block
``dst_ids[i]``. Both caches must be contiguous ``[layers, 2, blocks, block, heads, dim]``
of one dtype; ``copy_blocks`` in ``ipc.py`` checks that and otherwise uses torch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 4096  # elements per program: 8 KiB of bf16, a 16-token x 8-head x 128 block in 4


@triton.jit
def _copy_blocks_kernel(
    src_ptr,
    dst_ptr,
    src_ids_ptr,
    dst_ids_ptr,
    src_plane_stride,
    dst_plane_stride,
    block_elems,
    CHUNK_SIZE: tl.constexpr,
):
    pair = tl.program_id(0)
    plane = tl.program_id(1).to(tl.int64)
    chunk = tl.program_id(2)
    src_block = tl.load(src_ids_ptr + pair).to(tl.int64)
    dst_block = tl.load(dst_ids_ptr + pair).to(tl.int64)
    offs = chunk * CHUNK_SIZE + tl.arange(0, CHUNK_SIZE)
    mask = offs < block_elems
    src = src_ptr + plane * src_plane_stride + src_block * block_elems
    dst = dst_ptr + plane * dst_plane_stride + dst_block * block_elems
    tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def copy_blocks_triton(
    src: torch.Tensor, src_ids: torch.Tensor, dst: torch.Tensor, dst_ids: torch.Tensor
) -> None:
    """``dst[:, :, dst_ids] = src[:, :, src_ids]`` in one launch (on the current stream).
    ``src_ids``/``dst_ids``: int32 or int64 tensors on the caches' device."""
    layers, two, _, *rest = src.shape
    block_elems = rest[0] * rest[1] * rest[2]
    n = src_ids.numel()
    if n == 0:
        return
    grid = (n, layers * two, triton.cdiv(block_elems, CHUNK))
    _copy_blocks_kernel[grid](
        src,
        dst,
        src_ids,
        dst_ids,
        src.stride(1),
        dst.stride(1),
        block_elems,
        CHUNK_SIZE=CHUNK,
    )
