"""Batched multi-LoRA on CUDA as two Triton kernels over the step's token -> slot index
(the shrink/expand split of Punica and S-LoRA; our own kernels).

* shrink: ``y[t] = x[t] @ a[slot[t]].T``: ``[T, in] -> [T, subs * R]`` in float32;
* expand: ``out[t, n] += y[t, sub(n) * R : sub(n) * R + R] @ b[slot[t], n]``, where
  ``sub(n)`` is the sub-module (q/k/v, gate/up) owning output column ``n``.

One program per (token, tile): a batch mixing any number of adapters and base-model tokens
(slot -1, skipped) is two launches per projection, no sorting and no host sync, so the
step can run under a CUDA graph later. Tokens of one adapter read the same A/B tiles,
which stay in L2 across programs. ``TRITON_INTERPRET=1`` runs them on the CPU (tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink(
    x_ptr, a_ptr, y_ptr, slot_ptr, K, NR,
    sx, sa_l, sa_r, sy,
    BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    rows = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    a_base = a_ptr + slot.to(tl.int64) * sa_l
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        xv = tl.load(x_ptr + t * sx + ks, mask=ks < K, other=0.0).to(tl.float32)
        av = tl.load(
            a_base + rows[:, None] * sa_r + ks[None, :],
            mask=(rows[:, None] < NR) & (ks[None, :] < K),
            other=0.0,
        ).to(tl.float32)
        acc += tl.sum(av * xv[None, :], axis=1)
    tl.store(y_ptr + t * sy + rows, acc, mask=rows < NR)


@triton.jit
def _expand(
    y_ptr, b_ptr, out_ptr, slot_ptr, N, R, off1, off2,
    sy, sb_l, sb_n, so,
    BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    ns = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rs = tl.arange(0, BLOCK_R)
    sub = (ns >= off1).to(tl.int32) + (ns >= off2).to(tl.int32)
    nmask = ns < N
    m2 = nmask[:, None] & (rs[None, :] < R)
    yv = tl.load(y_ptr + t * sy + sub[:, None] * R + rs[None, :], mask=m2, other=0.0)
    bv = tl.load(
        b_ptr + slot.to(tl.int64) * sb_l + ns[:, None] * sb_n + rs[None, :], mask=m2, other=0.0
    ).to(tl.float32)
    delta = tl.sum(yv * bv, axis=1)
    o = tl.load(out_ptr + t * so + ns, mask=nmask, other=0.0)
    tl.store(out_ptr + t * so + ns, (o.to(tl.float32) + delta).to(o.dtype), mask=nmask)


def lora_shrink_expand(
    x: torch.Tensor,
    out: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    token_slots: torch.Tensor,
    offsets: list[int],
    rank: int,
) -> None:
    """``out += LoRA(x)`` per token (see the module docstring). ``a`` [L, subs * R, in],
    ``b`` [L, out, R], ``token_slots`` int32 [>= T] (-1: no adapter). ``x`` and ``out``
    must be row-major in their last dim."""
    t, k = x.shape
    n = out.shape[1]
    nr = a.shape[1]
    if t == 0:
        return
    x = x if x.stride(1) == 1 else x.contiguous()
    assert out.stride(1) == 1 and a.stride(2) == 1 and b.stride(2) == 1
    y = torch.empty((t, nr), dtype=torch.float32, device=x.device)
    block_r = min(64, triton.next_power_of_2(nr))
    _shrink[(t, triton.cdiv(nr, block_r))](
        x, a, y, token_slots, k, nr, x.stride(0), a.stride(0), a.stride(1), y.stride(0),
        BLOCK_R=block_r, BLOCK_K=128,
    )  # fmt: skip
    big = n + 1  # past every column: no such sub-module
    off1 = offsets[1] if len(offsets) > 1 else big
    off2 = offsets[2] if len(offsets) > 2 else big
    block_n = 64
    _expand[(t, triton.cdiv(n, block_n))](
        y, b, out, token_slots, n, rank, off1, off2,
        y.stride(0), b.stride(0), b.stride(1), out.stride(0),
        BLOCK_N=block_n, BLOCK_R=triton.next_power_of_2(rank),
    )  # fmt: skip
