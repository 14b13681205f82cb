"""Batched multi-LoRA on CUDA as two Triton kernels per projection over the step's work
list (engine/lora/plan.py): the shrink/expand split of Punica and S-LoRA, our own kernels.

* shrink: ``y[t] += x[t] @ a[slot].T`` into a zeroed float32 ``y`` ``[T, subs * R]``. One
  program per (block of up to 16 tokens of one slot, K chunk): the block's rows of ``x``
  times the slot's A tile on the tensor cores, summed over K chunks by atomic adds. At
  decode a step has only a few blocks (batch 64 over 8 adapters: 8), so K is split until
  the grid covers the GPU about twice: the cost is then the bytes of A, once per slot.
* expand: ``out[t, n] += y[t, sub(n) * R : sub(n) * R + R] @ b[slot, n]``, where
  ``sub(n)`` is the sub-module (q/k/v, gate/up) owning output column ``n``. One program
  per (block, column tile); a tile never straddles two sub-modules (each sub-module's
  columns are tiled apart), so each program reads one R-wide slice of ``y``.

A merged projection (q|k|v, gate|up) is one shrink and one expand for all its
sub-modules. The grid depends only on the token count and the number of slots, and the
slot ids are data, so the launches go into CUDA graphs (engine/executor/model_runner.py).
``TRITON_INTERPRET=1`` runs them on the CPU (tests/unit/test_lora_triton.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.lora.plan import BLOCK_M, max_blocks

BLOCK_K = 128
BLOCK_N = 128


@triton.jit
def _shrink(
    x_ptr, a_ptr, y_ptr, blk_ptr, idx_ptr, K, NR, k_chunk,
    sx, sa_l, sa_r, sy,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
    UPCAST: tl.constexpr,  # interpreter only: its tl.dot multiplies bf16 bit patterns as ints
):  # fmt: skip
    blk = tl.program_id(0)
    count = tl.load(blk_ptr + blk * 3 + 2)
    if count == 0:
        return
    slot = tl.load(blk_ptr + blk * 3).to(tl.int64)
    start = tl.load(blk_ptr + blk * 3 + 1)
    ms = tl.arange(0, BLOCK_M)
    mmask = ms < count
    toks = tl.load(idx_ptr + start + ms, mask=mmask, other=0).to(tl.int64)
    rs = tl.arange(0, BLOCK_R)
    rmask = rs < NR
    a_base = a_ptr + slot * sa_l
    k_lo = tl.program_id(1) * k_chunk
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(k_lo, k_lo + k_chunk, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < K
        xv = tl.load(
            x_ptr + toks[:, None] * sx + ks[None, :],
            mask=mmask[:, None] & kmask[None, :],
            other=0.0,
        )
        av = tl.load(
            a_base + rs[:, None] * sa_r + ks[None, :],
            mask=rmask[:, None] & kmask[None, :],
            other=0.0,
        )
        if UPCAST:  # exact products, as the tensor cores' bf16 MMA with float32 sums
            acc += tl.dot(xv.to(tl.float32), tl.trans(av.to(tl.float32)), input_precision="ieee")
        elif IEEE:
            acc += tl.dot(xv, tl.trans(av), input_precision="ieee")
        else:
            acc += tl.dot(xv, tl.trans(av))
    tl.atomic_add(
        y_ptr + toks[:, None] * sy + rs[None, :], acc, mask=mmask[:, None] & rmask[None, :]
    )


@triton.jit
def _expand(
    y_ptr, b_ptr, out_ptr, blk_ptr, idx_ptr, R,
    off1, off2, end0, end1, end2, tile1, tile2,
    sy, sb_l, sb_n, so,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    blk = tl.program_id(0)
    count = tl.load(blk_ptr + blk * 3 + 2)
    if count == 0:
        return
    slot = tl.load(blk_ptr + blk * 3).to(tl.int64)
    start = tl.load(blk_ptr + blk * 3 + 1)
    ms = tl.arange(0, BLOCK_M)
    mmask = ms < count
    toks = tl.load(idx_ptr + start + ms, mask=mmask, other=0).to(tl.int64)
    # Which sub-module this column tile belongs to, its first column and tile, its end.
    tile = tl.program_id(1)
    sub = (tile >= tile1).to(tl.int32) + (tile >= tile2).to(tl.int32)
    col0 = tl.where(sub == 0, 0, tl.where(sub == 1, off1, off2))
    t0 = tl.where(sub == 0, 0, tl.where(sub == 1, tile1, tile2))
    end = tl.where(sub == 0, end0, tl.where(sub == 1, end1, end2))
    ns = col0 + (tile - t0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = ns < end
    rs = tl.arange(0, BLOCK_R)
    rmask = rs < R
    yv = tl.load(
        y_ptr + toks[:, None] * sy + sub * R + rs[None, :],
        mask=mmask[:, None] & rmask[None, :],
        other=0.0,
    )
    bv = tl.load(
        b_ptr + slot * sb_l + ns[:, None] * sb_n + rs[None, :],
        mask=nmask[:, None] & rmask[None, :],
        other=0.0,
    ).to(tl.float32)
    # float32 products (K = R is tiny): y is not rounded to the model dtype first.
    delta = tl.dot(yv, tl.trans(bv), input_precision="ieee")
    optr = out_ptr + toks[:, None] * so + ns[None, :]
    omask = mmask[:, None] & nmask[None, :]
    o = tl.load(optr, mask=omask, other=0.0)
    tl.store(optr, (o.to(tl.float32) + delta).to(o.dtype), mask=omask)


def target_programs(device: torch.device) -> int:
    """How many shrink programs to aim for: twice the SMs on a GPU; on the CPU (the
    interpreter runs programs one by one) no split."""
    if device.type != "cuda":
        return 1
    return 2 * torch.cuda.get_device_properties(device).multi_processor_count


def k_chunk(k: int, blocks: int, programs: int) -> int:
    """The K range of one shrink program: a multiple of ``BLOCK_K``, small enough that
    ``blocks`` x chunks reach ``programs``."""
    chunks = triton.cdiv(k, BLOCK_K)
    splits = max(1, min(chunks, triton.cdiv(programs, blocks)))
    return triton.cdiv(chunks, splits) * BLOCK_K


def lora_shrink_expand(
    x: torch.Tensor,
    out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    y: torch.Tensor,
    table: torch.Tensor,
    order: torch.Tensor,
    offsets: list[int],
    sizes: list[int],
    rank: int,
    programs: int | None = None,
) -> None:
    """``out += LoRA(x)`` per token (see the module docstring). ``a`` [S, subs * R, in],
    ``b`` [S, out, R]; ``y`` float32 [T, subs * R], zero (row stride free); ``table``
    int32 [>= max_blocks(T, S), 3] and ``order`` int32 (engine/lora/plan.py).
    ``programs``: the shrink grid to aim for (default ``target_programs``)."""
    t, k = x.shape
    if t == 0:
        return
    nr = a.shape[1]
    x = x if x.stride(1) == 1 else x.contiguous()
    assert out.stride(1) == 1 and y.stride(1) == 1 and a.stride(2) == 1 and b.stride(2) == 1
    assert x.dtype == a.dtype, f"x is {x.dtype}, the slots {a.dtype}"
    blocks = max_blocks(t, a.shape[0])
    assert table.shape[0] >= blocks and table.stride(0) == 3
    chunk = k_chunk(k, blocks, programs or target_programs(x.device))
    _shrink[(blocks, triton.cdiv(k, chunk))](
        x, a, y, table, order, k, nr, chunk, x.stride(0), a.stride(0), a.stride(1), y.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_R=max(16, triton.next_power_of_2(nr)), BLOCK_K=BLOCK_K,
        IEEE=x.dtype == torch.float32, UPCAST=x.device.type == "cpu" and x.dtype != torch.float32,
    )  # fmt: skip
    # Each sub-module's columns tiled apart: tiles [t_s, t_s+1) cover columns
    # [offsets[s], offsets[s] + sizes[s]).
    tiles = [triton.cdiv(s, BLOCK_N) for s in sizes]
    big = 1 << 30  # no such sub-module: past every tile and column
    starts = [sum(tiles[:i]) for i in range(len(tiles))] + [big] * (3 - len(tiles))
    offs = list(offsets) + [big] * (3 - len(offsets))
    ends = [o + s for o, s in zip(offsets, sizes, strict=True)] + [big] * (3 - len(sizes))
    _expand[(blocks, sum(tiles))](
        y, b, out, table, order, rank, offs[1], offs[2], ends[0], ends[1], ends[2],
        starts[1], starts[2], y.stride(0), b.stride(0), b.stride(1), out.stride(0),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_R=max(16, triton.next_power_of_2(rank)),
    )  # fmt: skip
