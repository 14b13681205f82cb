"""A one-launch Triton GEMV over FP8 (e4m3) weights for decode at 1-4 rows:
``y = (x @ Wq.T) * scale (+ b)``, ``Wq`` ``[N, K]`` float8_e4m3fn, ``scale`` ``[N]`` float32.

Batch-1 decode streams every weight byte once, so halving the bytes is what FP8 buys; the
layout of the work is the bf16 GEMV's (``triton_gemv.py``: each program owns ``BLOCK_N``
output channels and walks all of K, float32 partial sums reduced once after the loop).
The per-channel weight scale is applied once per output in the epilogue, not per element.

Activations stay in the model dtype here (weight-only FP8): at 1-4 rows quantizing them
saves no bandwidth and costs accuracy, so decode through this kernel is slightly more
accurate than the W8A8 ``torch._scaled_mm`` path larger batches take (docs/quantization.md).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from engine.models.triton_gemv import MAX_ROWS, GemvConfig, _row_fma, gemv_config

FP8 = torch.float8_e4m3fn
_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _row_store_scaled(acc, scale, bias, y_row_ptr, offs_n, mask_n, HAS_BIAS: tl.constexpr):
    y = tl.sum(acc, axis=1) * scale
    if HAS_BIAS:
        y += bias
    tl.store(y_row_ptr + offs_n, y.to(y_row_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    N,
    K,
    stride_xm,
    stride_ym,
    M: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    # Rows past N re-read row N-1 (unpredicated, vectorised loads); they are never stored.
    rows = tl.minimum(offs_n, N - 1)
    offs_k = tl.arange(0, BLOCK_K)
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * K + offs_k[None, :]
    acc0 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        cols = k + offs_k
        if EVEN_K:
            w = tl.load(w_ptrs + k)
        else:
            w = tl.load(w_ptrs + k, mask=(cols < K)[None, :], other=0.0)
        w = w.to(tl.float32)
        acc0 = _row_fma(acc0, w, x_ptr, cols, K, EVEN_K)
        if M > 1:
            acc1 = _row_fma(acc1, w, x_ptr + stride_xm, cols, K, EVEN_K)
        if M > 2:
            acc2 = _row_fma(acc2, w, x_ptr + 2 * stride_xm, cols, K, EVEN_K)
        if M > 3:
            acc3 = _row_fma(acc3, w, x_ptr + 3 * stride_xm, cols, K, EVEN_K)
    scale = tl.load(s_ptr + rows)
    bias = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + rows).to(tl.float32)
    _row_store_scaled(acc0, scale, bias, y_ptr, offs_n, mask_n, HAS_BIAS)
    if M > 1:
        _row_store_scaled(acc1, scale, bias, y_ptr + stride_ym, offs_n, mask_n, HAS_BIAS)
    if M > 2:
        _row_store_scaled(acc2, scale, bias, y_ptr + 2 * stride_ym, offs_n, mask_n, HAS_BIAS)
    if M > 3:
        _row_store_scaled(acc3, scale, bias, y_ptr + 3 * stride_ym, offs_n, mask_n, HAS_BIAS)


def fp8_gemv_problem(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None
) -> str | None:
    """Why ``fp8_gemv`` cannot run on these tensors, or None."""
    if not (
        x.device.type == "cuda"
        or (x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")
    ):
        return f"the FP8 gemv needs CUDA tensors (got {x.device}; TRITON_INTERPRET=1 for tests)"
    if x.dim() != 2 or weight.dim() != 2 or not 1 <= x.shape[0] <= MAX_ROWS:
        return f"need x [1..{MAX_ROWS}, K] and weight [N, K], got {tuple(x.shape)}, {tuple(weight.shape)}"
    n, k = weight.shape
    if x.shape[1] != k or k < 1 or n < 1:
        return f"shapes do not match: x {tuple(x.shape)}, weight {tuple(weight.shape)}"
    if weight.dtype != FP8 or x.dtype not in _X_DTYPES:
        return f"need a float8_e4m3fn weight and x in {_X_DTYPES}, got {weight.dtype}, {x.dtype}"
    if scale.shape != (n,) or scale.dtype != torch.float32 or not scale.is_contiguous():
        return f"scale must be a contiguous [{n}] float32 tensor, got {tuple(scale.shape)} {scale.dtype}"
    if x.stride(1) != 1 or not weight.is_contiguous():
        return "x must be contiguous along K and weight contiguous"
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        return f"bias must be a contiguous [{n}] tensor, got {tuple(bias.shape)}"
    if any(t.device != x.device for t in (weight, scale, *(() if bias is None else (bias,)))):
        return "x, weight, scale and bias must be on one device"
    return None


def fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """``(x @ weight.T) * scale (+ bias)`` in ``x``'s dtype, float32 sums; 1-4 rows of
    ``x``. ``ValueError`` where ``fp8_gemv_problem`` names a problem."""
    problem = fp8_gemv_problem(x, weight, scale, bias)
    if problem is not None:
        raise ValueError(problem)
    return launch_fp8_gemv(x, weight, scale, bias, config)


def launch_fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """``fp8_gemv`` without the checks (the caller checked ``fp8_gemv_problem`` once)."""
    m, k = x.shape
    n = weight.shape[0]
    block_n, block_k, warps, stages = config or gemv_config(n, k, FP8, m)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _fp8_gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, scale, scale if bias is None else bias, y, n, k, x.stride(0), y.stride(0),
        M=m, HAS_BIAS=bias is not None, EVEN_K=k % block_k == 0,
        BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y
