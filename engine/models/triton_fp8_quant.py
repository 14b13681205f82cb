"""Dynamic e4m3 quantization of activations in Triton, per token or per tensor.

``fp8.quantize_rows`` in torch is eight elementwise/reduction kernels with float32
intermediates (cast, abs, amax, divide, clamp, divide, clamp, cast). At decode, under CUDA
graphs, those launches dominate an FP8 projection: 4 projections x 32 layers x 8 kernels
is ~1,000 small kernels a step, which is what kept W8A8 slower than bf16 at batch 128
(issue 23). Here one program per row reads the row twice (once for its largest magnitude,
once to scale, round and store) and writes the e4m3 row and its float32 scale: the same
values as ``quantize_rows`` (round to nearest even, saturated at +-448, the same scale
floor), checked against it in tests/unit/test_fp8_quant_kernel.py.

Per tensor (``fp8_scales="tensor"``, docs/quantization.md): one program per row folds its
row's largest magnitude into a float32 scalar on the device by an atomic max, then a second
launch derives the one scale from it and quantizes every row (``fp8.quantize_tensor``'s
values, tests/unit/test_fp8_tensor_scales.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
_BLOCK = 1024  # columns per pass: K=4096 is 4 passes, K=14336 is 14


def _checked_rows(rows: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """``(M, K, an empty e4m3 [M, K])`` of a 2-D ``rows`` whose last dim is contiguous (what
    both kernels index), else ValueError."""
    if rows.dim() != 2 or rows.stride(1) != 1:
        raise ValueError(f"rows must be 2-D with contiguous rows, got {tuple(rows.shape)}")
    m, k = rows.shape
    return m, k, torch.empty((m, k), dtype=FP8, device=rows.device)


@triton.jit
def _row_amax(x_row, K, BLOCK: tl.constexpr):
    """The largest magnitude of one row of ``K`` elements, as float32."""
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, K, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        v = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(v))
    return tl.max(amax, axis=0)


@triton.jit
def _store_quantized_row(x_row, q_row, K, scale, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
    """One row divided by ``scale``, saturated at +-FP8_MAX and stored as e4m3."""
    for start in range(0, K, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < K
        v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(v / scale, -FP8_MAX), FP8_MAX)
        tl.store(q_row + offs, q.to(q_row.dtype.element_ty), mask=mask)


@triton.jit
def _quant_rows_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    K,
    stride_x,
    stride_q,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    q_row = q_ptr + row.to(tl.int64) * stride_q
    scale = tl.maximum(_row_amax(x_row, K, BLOCK) / FP8_MAX, MIN_SCALE)
    tl.store(s_ptr + row, scale)
    _store_quantized_row(x_row, q_row, K, scale, FP8_MAX, BLOCK)


def quantize_rows_triton(
    rows: torch.Tensor, fp8_max: float, min_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [M, K] e4m3, scale [M] float32)`` of a 2-D ``rows`` whose last dim is contiguous."""
    m, k, q = _checked_rows(rows)
    scale = torch.empty((m,), dtype=torch.float32, device=rows.device)
    if m:
        _quant_rows_kernel[(m,)](
            rows,
            q,
            scale,
            k,
            rows.stride(0),
            q.stride(0),
            FP8_MAX=fp8_max,
            MIN_SCALE=min_scale,
            BLOCK=_BLOCK,
            num_warps=4,
        )
    return q, scale


@triton.jit
def _amax_rows_kernel(x_ptr, amax_ptr, K, stride_x, BLOCK: tl.constexpr):
    """Each program the largest magnitude of its row, folded into one float32 by an
    atomic max (magnitudes are >= 0, so the float max is order-free and exact)."""
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    tl.atomic_max(amax_ptr, _row_amax(x_row, K, BLOCK))


@triton.jit
def _quant_tensor_kernel(
    x_ptr,
    q_ptr,
    amax_ptr,
    s_ptr,
    K,
    stride_x,
    stride_q,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    scale = tl.maximum(tl.load(amax_ptr) / FP8_MAX, MIN_SCALE)
    if row == 0:
        tl.store(s_ptr, scale)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    q_row = q_ptr + row.to(tl.int64) * stride_q
    _store_quantized_row(x_row, q_row, K, scale, FP8_MAX, BLOCK)


def quantize_tensor_triton(
    rows: torch.Tensor, fp8_max: float, min_scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q [M, K] e4m3, scale [1] float32)``: ONE dynamic scale for the whole 2-D ``rows``
    (its largest magnitude maps to ``fp8_max``), as ``fp8.quantize_tensor``. Two launches
    and a memset, no host sync: safe inside a CUDA graph (the amax lives on the device)."""
    m, k, q = _checked_rows(rows)
    amax = torch.zeros((1,), dtype=torch.float32, device=rows.device)
    scale = torch.empty((1,), dtype=torch.float32, device=rows.device)
    if not m:
        scale.fill_(min_scale)
        return q, scale
    _amax_rows_kernel[(m,)](rows, amax, k, rows.stride(0), BLOCK=_BLOCK, num_warps=4)
    _quant_tensor_kernel[(m,)](
        rows,
        q,
        amax,
        scale,
        k,
        rows.stride(0),
        q.stride(0),
        FP8_MAX=fp8_max,
        MIN_SCALE=min_scale,
        BLOCK=_BLOCK,
        num_warps=4,
    )
    return q, scale
