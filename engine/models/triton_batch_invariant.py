"""Deterministic mode on CUDA: a batch-invariant matmul and the Triton ops that use it
(docs/design.md §3 "Deterministic mode").

cuBLAS picks its algorithm by shape, and for few rows it splits K over thread blocks and
adds the partial sums in a second pass, so one row's result changes with the number of
rows around it. ``bi_linear`` computes ``x @ W.T (+ b)`` with one tile configuration for
every shape: a program owns a ``BLOCK_M x BLOCK_N`` output tile and walks the whole of K
itself in ``BLOCK_K`` steps from 0 upward, accumulating in float32. Nothing about the
reduction depends on M (no split-K, no autotuning, no shape heuristics), and every row of
a tile goes through the same ``tl.dot`` instructions, so a row's output bits depend only
on that row and the weight. The price is the tile padding at small batches and a kernel
that is simpler than cuBLAS at large ones (not yet measured on the H200:
benchmarks/gpu/deterministic_cost.py).

``BatchInvariantTritonOps`` is ``TritonOps`` with every projection and the LM head
through ``bi_linear``; its RMSNorm kernel already reduces one row per program with a block
set by the hidden size alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.models.triton_ops import TritonOps

# One configuration for every shape (docs/design.md §3): changing any of these changes
# the bits of every output, never their dependence on the batch.
GPU_TILES = (64, 64, 64)  # BLOCK_M, BLOCK_N, BLOCK_K
INTERPRETER_TILES = (16, 16, 16)  # Triton's interpreter (tests): small tiles, same logic
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _bi_matmul_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,  # exact fp32 products (no tf32) for float32 models
    UPCAST: tl.constexpr,  # interpreter only: its tl.dot multiplies bf16 bit patterns as ints
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # K from 0 upward in fixed steps: the same order for every row and every M.
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        x = tl.load(
            x_ptr + rows64[:, None] * stride_xm + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + cols64[None, :] * stride_wn + ks[:, None],
            mask=col_ok[None, :] & k_ok[:, None],
            other=0.0,
        )
        if UPCAST:
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols64, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + rows64[:, None] * stride_om + cols64[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def bi_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` (``x`` [..., K], ``weight`` [N, K]) whose every output row
    depends only on its input row: the same reduction order for any number of rows."""
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        raise ValueError(
            f"bi_linear: dtypes x {x.dtype}, weight {weight.dtype} (need one of {_DTYPES}, equal)"
        )
    n, k = weight.shape
    rows = x.reshape(-1, x.shape[-1])
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    w = weight if weight.stride(-1) == 1 else weight.contiguous()
    m = rows.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m:
        interpreted = x.device.type == "cpu"
        bm, bn, bk = INTERPRETER_TILES if interpreted else GPU_TILES
        b = bias if bias is not None else out
        _bi_matmul_kernel[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
            rows, w, b, out, m, n, k, rows.stride(0), w.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
            IEEE=x.dtype == torch.float32, UPCAST=interpreted and x.dtype != torch.float32,
            num_warps=4, num_stages=3,
        )  # fmt: skip
    return out.reshape(*x.shape[:-1], n)


class BatchInvariantTritonOps(TritonOps):
    """``TritonOps`` whose projections and LM head go through ``bi_linear``."""

    name = "triton_batch_invariant"
    batch_invariant = True

    @staticmethod
    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return bi_linear(x, weight, bias)

    @classmethod
    def logits(cls, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return bi_linear(x, weight, None)
