"""The per-token FP8 quantization of a projection's input fused into the kernel that makes
that input (docs/quantization.md "Fused activation quantization"):

* ``rms_norm_fp8``: (residual add +) RMSNorm + e4m3 quantization of the normed row, the
  input of ``qkv_proj`` and ``gate_up_proj``;
* ``silu_mul_fp8``: SiLU(gate) * up + quantization, the input of ``down_proj``.

Unfused, each is the layer op (``triton_ops.py``) writing the row in the model dtype, then
``triton_fp8_quant.py`` reading it twice and writing e4m3: one launch and a round trip of
the row more per projection, three per layer. Here one program per row computes the row
as the layer op rounds it (every intermediate rounded to the model dtype where torch
stores one), takes its largest magnitude, and writes the e4m3 row and its float32 scale:
the same bytes as the layer op followed by the quantizer the unfused GPU path runs
(``quantize_e4m3`` rounds to nearest even and saturates as its cast does; both divide with
Triton's float32 division, which on the GPU is within 2 ulp of torch's, so against
``fp8.quantize_rows`` a rare value sits one e4m3 step away). The result is an ``Fp8Act``
that ``Fp8Linear`` takes instead of a model-dtype tensor.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention.triton_kernels import quantize_e4m3
from engine.models.fp8 import _MIN_SCALE, FP8, FP8_MAX, Fp8Act
from engine.models.triton_ops import _warps  # the norm kernel's: the same reduction tree

_SILU_BLOCK = 2048  # columns per pass of the SiLU kernel: 14336 is 7 passes


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _norm_fp8_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    q_ptr,
    s_ptr,
    stride_x,
    stride_res,
    stride_q,
    n_cols,
    eps,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        x = _round(x + r, dtype)
        tl.store(res_ptr + row * stride_res + cols, x.to(dtype), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = _round(w * _round(x * rstd, dtype), dtype)  # what the norm kernel stores
    y = tl.where(mask, y, 0.0)
    scale = tl.maximum(tl.max(tl.abs(y), axis=0) / FP8_MAX, MIN_SCALE)
    tl.store(s_ptr + row, scale)
    q = quantize_e4m3(y, scale)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _silu_act(gu_row, cols, mask, n_cols, DTYPE: tl.constexpr):
    """``silu(gate) * up`` of one column tile, rounded as the SiLU·mul kernel stores it."""
    g = tl.load(gu_row + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_row + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    s = _round(g / (1.0 + tl.exp(-g)), DTYPE)
    return tl.where(mask, _round(s * u, DTYPE), 0.0)


@triton.jit
def _silu_mul_fp8_kernel(
    gu_ptr,
    q_ptr,
    s_ptr,
    stride_gu,
    stride_q,
    n_cols,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    gu_row = gu_ptr + row * stride_gu
    dtype = gu_ptr.dtype.element_ty
    amax = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        a = _silu_act(gu_row, cols, cols < n_cols, n_cols, dtype)
        amax = tl.maximum(amax, tl.abs(a))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, MIN_SCALE)
    tl.store(s_ptr + row, scale)
    for start in range(0, n_cols, BLOCK):  # recomputed: cheaper than a round trip
        cols = start + tl.arange(0, BLOCK)
        mask = cols < n_cols
        a = _silu_act(gu_row, cols, mask, n_cols, dtype)
        q = quantize_e4m3(a, scale)
        tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty), mask=mask)


def rms_norm_fp8(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> Fp8Act:
    """RMSNorm of ``residual + x`` (the sum written back into ``residual``, as
    ``TritonOps.add_rms_norm`` does) or of ``x`` (``residual`` None), quantized per row.
    ``x`` and ``residual`` are 2-D with contiguous rows."""
    m, n = x.shape
    q = torch.empty((m, n), dtype=FP8, device=x.device)
    scale = torch.empty((m,), dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(n)
    res = x if residual is None else residual
    if m:
        _norm_fp8_kernel[(m,)](
            x, res, weight, q, scale, x.stride(0), res.stride(0), q.stride(0), n, eps,
            FP8_MAX=FP8_MAX, MIN_SCALE=_MIN_SCALE, HAS_RESIDUAL=residual is not None,
            BLOCK=block, num_warps=_warps(block),
        )  # fmt: skip
    return Fp8Act(q, scale, x.dtype)


def silu_mul_fp8(gate_up: torch.Tensor) -> Fp8Act:
    """``silu(gate) * up`` of ``gate_up = [gate | up]`` (2-D, contiguous rows), quantized
    per row."""
    m, n = gate_up.shape[0], gate_up.shape[1] // 2
    q = torch.empty((m, n), dtype=FP8, device=gate_up.device)
    scale = torch.empty((m,), dtype=torch.float32, device=gate_up.device)
    if m:
        _silu_mul_fp8_kernel[(m,)](
            gate_up, q, scale, gate_up.stride(0), q.stride(0), n,
            FP8_MAX=FP8_MAX, MIN_SCALE=_MIN_SCALE, BLOCK=min(_SILU_BLOCK, triton.next_power_of_2(n)),
            num_warps=4,
        )  # fmt: skip
    return Fp8Act(q, scale, gate_up.dtype)
