"""Triton kernels for a decoder layer's element-wise work (see ``layer_ops.py``).

Each kernel replaces a chain of torch ops with one launch and rounds to the model dtype
exactly where the torch chain does: a value torch stores as bfloat16 between two ops is
rounded to bfloat16 here too (``_round``), so the results differ from ``TorchOps`` only by
the order of float32 sums.

The RoPE kernel can also store rotated k and v straight into the paged KV cache
(``rope_store_kv``), so a decode step skips the attention backend's separate write kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention.kv_quant import DEFAULT_SCALE, is_fp8
from engine.attention.triton_kernels import quantize_e4m3
from engine.models.layer_ops import TorchOps
from engine.models.triton_gemv import MAX_ROWS, prefers_cublas, supports_gemv
from engine.models.triton_gemv import _launch as _gemv


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    """float32 -> model dtype -> float32: what torch does when it stores an intermediate."""
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    stride_x,
    stride_res,
    stride_out,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        x = _round(x + r, dtype)
        tl.store(res_ptr + row * stride_res + cols, x.to(dtype), mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    y = w * _round(x * rstd, dtype)
    tl.store(out_ptr + row * stride_out + cols, y.to(dtype), mask=mask)


@triton.jit
def _silu_mul_kernel(gu_ptr, out_ptr, stride_gu, stride_out, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    s = _round(g / (1.0 + tl.exp(-g)), dtype)
    tl.store(out_ptr + row * stride_out + cols, (s * u).to(dtype), mask=mask)


@triton.jit
def _to_store(x, DTYPE: tl.constexpr, scale, QUANT: tl.constexpr, OUT: tl.constexpr):
    """float32 ``x`` as the destination holds it: the model dtype ``DTYPE``, or (QUANT, an
    fp8 cache) rounded to ``DTYPE`` first, as the unfused path stores it, then divided by
    the scale and rounded to e4m3 (``quantize_e4m3``, engine/attention/kv_quant.py)."""
    if QUANT:
        return quantize_e4m3(_round(x, DTYPE), scale).to(OUT)
    return x.to(OUT)


@triton.jit
def _rope_heads(
    src_ptr,
    dst_ptr,
    src_row,
    dst_row,
    c1,
    c2,
    s1,
    s2,
    n_heads,
    scale,  # QUANT only: the fp8 cache's k scale
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    HEADS_P2: tl.constexpr,
    DTYPE: tl.constexpr,  # the model dtype (intermediates are rounded to it)
    QUANT: tl.constexpr,
):
    """Rotate one token's ``n_heads`` heads: out = x * cos + rotate_half(x) * sin."""
    dtype = DTYPE
    heads = tl.arange(0, HEADS_P2)[:, None]
    cols = tl.arange(0, HALF)[None, :]
    mask = heads < n_heads
    src = src_ptr + src_row + heads * HEAD_DIM + cols
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    # rotate_half(x) = [-x2, x1]; each product is rounded before the sum, as in torch.
    out1 = _round(x1 * c1, dtype) + _round(-x2 * s1, dtype)
    out2 = _round(x2 * c2, dtype) + _round(x1 * s2, dtype)
    dst = dst_ptr + dst_row + heads * HEAD_DIM + cols
    out_ty = dst_ptr.dtype.element_ty
    tl.store(dst, _to_store(out1, dtype, scale, QUANT, out_ty), mask=mask)
    tl.store(dst + HALF, _to_store(out2, dtype, scale, QUANT, out_ty), mask=mask)


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    pos_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    stride_q,
    stride_k,
    n_q_heads,
    n_k_heads,
    v_ptr,  # STORE_KV only (as are the four after it)
    slot_ptr,
    stride_v,
    kv_half,  # elements between the K and the V half of the layer cache
    k_scale,  # QUANT only (an fp8 cache): the per-tensor scales
    v_scale,
    HEAD_DIM: tl.constexpr,
    HALF: tl.constexpr,
    Q_HEADS_P2: tl.constexpr,
    K_HEADS_P2: tl.constexpr,
    STORE_KV: tl.constexpr,  # k_out_ptr is the paged cache: rotated k and v go to the slot
    QUANT: tl.constexpr,  # STORE_KV into an fp8 cache: quantize on write
):
    tok = tl.program_id(0).to(tl.int64)
    dtype = q_out_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    cols = tl.arange(0, HALF)[None, :]
    table = pos * HEAD_DIM + cols
    c1 = _round(tl.load(cos_ptr + table), dtype)  # torch casts the tables to the dtype
    c2 = _round(tl.load(cos_ptr + table + HALF), dtype)
    s1 = _round(tl.load(sin_ptr + table), dtype)
    s2 = _round(tl.load(sin_ptr + table + HALF), dtype)
    _rope_heads(
        q_ptr, q_out_ptr, tok * stride_q, tok * n_q_heads * HEAD_DIM, c1, c2, s1, s2,
        n_q_heads, 1.0, HEAD_DIM, HALF, Q_HEADS_P2, dtype, False,
    )  # fmt: skip
    if STORE_KV:
        # The cache holds the model dtype or fp8 (the wrapper checks): rotated k is rounded
        # exactly as the unfused kernel rounds its output (then quantized, for fp8).
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        if slot >= 0:  # -1: padding, or a token whose KV is already cached
            row = slot * n_k_heads * HEAD_DIM
            _rope_heads(
                k_ptr, k_out_ptr, tok * stride_k, row, c1, c2, s1, s2,
                n_k_heads, k_scale, HEAD_DIM, HALF, K_HEADS_P2, dtype, QUANT,
            )  # fmt: skip
            heads = tl.arange(0, K_HEADS_P2)[:, None]
            offs = heads * HEAD_DIM + tl.arange(0, HEAD_DIM)[None, :]
            mask = heads < n_k_heads
            v = tl.load(v_ptr + tok * stride_v + offs, mask=mask).to(tl.float32)
            v = _to_store(v, dtype, v_scale, QUANT, k_out_ptr.dtype.element_ty)
            tl.store(k_out_ptr + kv_half + row + offs, v, mask=mask)
    else:
        _rope_heads(
            k_ptr, k_out_ptr, tok * stride_k, tok * n_k_heads * HEAD_DIM, c1, c2, s1, s2,
            n_k_heads, 1.0, HEAD_DIM, HALF, K_HEADS_P2, dtype, False,
        )  # fmt: skip


def _warps(block: int) -> int:
    return 4 if block <= 2048 else 8


class TritonOps(TorchOps):
    name = "triton"
    fuses_kv_write = True
    use_gemv = True  # False: every projection through cuBLAS (benchmarks' before/after rows)

    @staticmethod
    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """The Triton GEMV at 1-4 rows (decode), cuBLAS for anything larger (prefill)."""
        if (
            TritonOps.use_gemv
            and x.dim() == 2
            and x.shape[0] <= MAX_ROWS  # first: prefill calls leave here, no checks built
            and supports_gemv(x, weight, bias)
            and not prefers_cublas(weight.shape[0], x.shape[1], x.shape[0], x.dtype)
        ):
            return _gemv(x, weight, bias, None)
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
        n = rows.shape[-1]
        block = triton.next_power_of_2(n)
        if rows.shape[0]:
            _rms_norm_kernel[(rows.shape[0],)](
                rows, rows, weight, out, rows.stride(0), 0, out.stride(0), n, eps,
                HAS_RESIDUAL=False, BLOCK=block, num_warps=_warps(block),
            )  # fmt: skip
        return out.view(x.shape)

    @classmethod
    def add_rms_norm(
        cls, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Adds ``x`` into ``residual`` in place (the caller's residual stream) and
        returns its norm, one read and one write of each row."""
        if x.dim() != 2 or x.shape != residual.shape or residual.stride(-1) != 1:
            return TorchOps.add_rms_norm(x, residual, weight, eps)
        x = x if x.stride(-1) == 1 else x.contiguous()
        out = torch.empty_like(residual)
        n = x.shape[-1]
        block = triton.next_power_of_2(n)
        if x.shape[0]:
            _rms_norm_kernel[(x.shape[0],)](
                x, residual, weight, out, x.stride(0), residual.stride(0), out.stride(0), n, eps,
                HAS_RESIDUAL=True, BLOCK=block, num_warps=_warps(block),
            )  # fmt: skip
        return out, residual

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dim() != 2 or gate_up.stride(-1) != 1:
            return TorchOps.silu_mul(gate_up)
        rows, n = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((rows, n), dtype=gate_up.dtype, device=gate_up.device)
        block = min(1024, triton.next_power_of_2(n))
        if rows:
            _silu_mul_kernel[(rows, triton.cdiv(n, block))](
                gate_up, out, gate_up.stride(0), out.stride(0), n, BLOCK=block
            )
        return out

    @staticmethod
    def _rope_applies(
        q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> bool:
        """Shapes/strides the RoPE kernel handles: q/k may be strided views by token (the
        fused qkv output) but each token's heads must be dense."""
        dim = q.shape[2]
        half = dim // 2
        return not (
            dim % 2
            or half & (half - 1)  # tl.arange needs a power of two
            or q.stride(2) != 1
            or k.stride(2) != 1
            or q.stride(1) != dim
            or k.stride(1) != dim
            or cos.dtype != torch.float32
            or not cos.is_contiguous()
            or not sin.is_contiguous()
        )

    @staticmethod
    def rope(
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Reads ``q``/``k`` as strided views (e.g. of the fused qkv projection) and writes
        contiguous rotated copies."""
        if not TritonOps._rope_applies(q, k, cos, sin):
            return TorchOps.rope(positions, q, k, cos, sin)
        tokens, q_heads, dim = q.shape
        k_heads = k.shape[1]
        q_out = torch.empty((tokens, q_heads, dim), dtype=q.dtype, device=q.device)
        k_out = torch.empty((tokens, k_heads, dim), dtype=k.dtype, device=k.device)
        if tokens:
            _rope_kernel[(tokens,)](
                q, k, positions, cos, sin, q_out, k_out, q.stride(0), k.stride(0),
                q_heads, k_heads, q, positions, 0, 0, 1.0, 1.0, HEAD_DIM=dim, HALF=dim // 2,
                Q_HEADS_P2=triton.next_power_of_2(q_heads),
                K_HEADS_P2=triton.next_power_of_2(k_heads), STORE_KV=False, QUANT=False,
            )  # fmt: skip
        return q_out, k_out

    @classmethod
    def rope_store_kv(
        cls,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: float = DEFAULT_SCALE,
        v_scale: float = DEFAULT_SCALE,
    ) -> torch.Tensor:
        """``rope`` and the paged-cache store of rotated ``k`` and ``v`` in one launch (the
        cache layout of engine/attention/triton_kernels.py). ``v`` may be a strided view
        like ``q``/``k``. An fp8 cache is quantized on write with ``k_scale``/``v_scale``
        (engine/attention/kv_quant.py). Returns the rotated ``q``, contiguous."""
        quant = is_fp8(kv_cache.dtype)
        tokens, q_heads, dim = q.shape
        k_heads = k.shape[1]
        if (
            not cls._rope_applies(q, k, cos, sin)
            or v.shape != k.shape
            or v.stride(2) != 1
            or v.stride(1) != dim
            or not q.dtype == k.dtype == v.dtype  # one rounding, no casts
            or not (kv_cache.dtype == q.dtype or quant)
            or kv_cache.dim() != 5
            or kv_cache.shape[0] != 2
            or kv_cache.shape[3:] != (k_heads, dim)
            or not kv_cache.is_contiguous()
            or slot_mapping.shape != (tokens,)
        ):
            # The reference's store with TritonOps.rope (itself falling back where it must).
            return super().rope_store_kv(
                positions, q, k, v, cos, sin, kv_cache, slot_mapping, k_scale, v_scale
            )
        q_out = torch.empty((tokens, q_heads, dim), dtype=q.dtype, device=q.device)
        if tokens:
            _rope_kernel[(tokens,)](
                q, k, positions, cos, sin, q_out, kv_cache, q.stride(0), k.stride(0),
                q_heads, k_heads, v, slot_mapping, v.stride(0), kv_cache.stride(0),
                k_scale, v_scale, HEAD_DIM=dim, HALF=dim // 2,
                Q_HEADS_P2=triton.next_power_of_2(q_heads),
                K_HEADS_P2=triton.next_power_of_2(k_heads), STORE_KV=True, QUANT=quant,
            )  # fmt: skip
        return q_out
