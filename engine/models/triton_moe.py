"""Fused mixture-of-experts on CUDA: tokens sorted by expert, then one grouped GEMM launch
for every expert's gate|up and one for every expert's down projection.

1. ``align_by_expert``: the ``T * k`` (token, slot) pairs are sorted by their expert, and
   each expert's run is padded to a multiple of ``BLOCK_M`` (pad entries point past the
   end). Every ``BLOCK_M`` rows then belong to one expert (``block_expert``; -1 past the
   last used block). Device ops only, sized by a static bound (``T * k + E * (BLOCK_M - 1)``
   rows), so no host sync: the step can be captured in a CUDA graph.
2. ``_grouped_gemm_kernel`` (gate|up): program (block, n-tile) gathers its rows' tokens
   from ``x`` and multiplies them by its expert's ``w13`` tile; the result goes to the
   pairs' rows of ``[T * k, 2 * inter]``.
3. SiLU·mul on that, then the same kernel for ``w2``, with each row scaled by its routing
   weight; the ``k`` rows of a token are summed at the end.

FP8 weights (``w13``/``w2`` float8 e4m3 with one float32 scale per expert and output
channel): the kernel converts each weight tile to the activations' dtype as it loads it
and applies the scale to the output columns (weight-only FP8: half the bytes read, which
is what bounds a decode step).

Tile sizes are data: ``moe_configs.json`` maps a shape key to the measured best tiles
(``python -m benchmarks.gpu.moe_layer --tune`` writes it); a shape not in it gets ``default_config``.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import triton
import triton.language as tl

CONFIG_FILE = Path(__file__).with_name("moe_configs.json")


@triton.jit
def _grouped_gemm_kernel(
    a_ptr, b_ptr, c_ptr, b_scale_ptr, bias_ptr, weight_ptr, sorted_ptr, block_expert_ptr,
    num_pairs, N, K,
    stride_am, stride_be, stride_bn, stride_cm, stride_se, stride_bias,
    TOP_K: tl.constexpr,  # rows of ``a`` are tokens (pair // TOP_K); 1: rows are pairs
    MUL_WEIGHT: tl.constexpr,  # scale each output row by its pair's routing weight
    HAS_SCALE: tl.constexpr,  # FP8 weights with per-(expert, channel) scales
    HAS_BIAS: tl.constexpr,  # a per-(expert, channel) bias, before the routing weight
    UPCAST: tl.constexpr,  # interpreter: float32 dots (its bf16 dot is not exact)
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    blk = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + blk)
    if expert < 0:
        return
    rows = blk * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ptr + rows)
    ok = pair < num_pairs
    a_row = (pair // TOP_K).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    kk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + a_row[:, None] * stride_am + kk[None, :]
    b_ptrs = b_ptr + expert.to(tl.int64) * stride_be + n[None, :] * stride_bn + kk[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = kk + k0 < K
        a = tl.load(a_ptrs, mask=ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        b = b.to(a.dtype)
        if UPCAST:
            acc += tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
        else:
            acc += tl.dot(a, b)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    if HAS_SCALE:
        s = tl.load(b_scale_ptr + expert.to(tl.int64) * stride_se + n, mask=n_ok, other=0.0)
        acc = acc * s[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert.to(tl.int64) * stride_bias + n, mask=n_ok, other=0.0)
        acc = acc + bias[None, :].to(tl.float32)
    if MUL_WEIGHT:
        w = tl.load(weight_ptr + pair, mask=ok, other=0.0)
        acc = acc * w[:, None].to(tl.float32)
    c_ptrs = c_ptr + pair.to(tl.int64)[:, None] * stride_cm + n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=ok[:, None] & n_ok[None, :])


def default_config(num_pairs: int) -> dict[str, int]:
    """Tiles for a shape with no measured entry: small M tiles for decode-sized batches
    (few pairs per expert), larger ones when each expert gets many rows."""
    if num_pairs <= 64:
        return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 3}
    if num_pairs <= 1024:
        return {"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}


@functools.cache
def _table() -> dict[str, Any]:
    path = Path(os.environ.get("PDSERVE_MOE_CONFIGS", CONFIG_FILE))
    if not path.exists():
        return {}
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def shape_key(experts: int, n: int, k: int, dtype: torch.dtype, device_name: str) -> str:
    return f"{device_name}|E={experts}|N={n}|K={k}|{str(dtype).removeprefix('torch.')}"


def get_config(key: str, num_pairs: int) -> dict[str, int]:
    """The measured tiles for ``key`` at the nearest measured pair count, else defaults."""
    entries = _table().get(key)
    if not entries:
        return default_config(num_pairs)
    best = min(entries, key=lambda m: abs(int(m) - num_pairs))
    return dict(entries[best])


def align_by_expert(
    experts: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(sorted_pairs, block_expert)``: pair ids grouped by expert, each group padded to
    ``block_m`` with ``T * k`` (out of range), and the expert of each ``block_m`` rows
    (-1 for unused blocks). See the module docstring."""
    flat = experts.reshape(-1)
    pairs = flat.numel()
    # scatter_add, not bincount: bincount reads the max id back to the host (a sync).
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    rank = torch.arange(pairs, device=flat.device) - count_start[sorted_experts]
    capacity = pairs + num_experts * (block_m - 1)
    capacity = (capacity + block_m - 1) // block_m * block_m
    sorted_pairs = torch.full((capacity,), pairs, dtype=torch.int32, device=flat.device)
    sorted_pairs[padded_start[sorted_experts] + rank] = order.to(torch.int32)
    starts = torch.arange(0, capacity, block_m, device=flat.device)
    block_expert = torch.searchsorted(padded_end, starts, right=True).to(torch.int32)
    block_expert = torch.where(block_expert < num_experts, block_expert, -1)
    return sorted_pairs, block_expert


def _gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    b_scale: torch.Tensor | None,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    weights: torch.Tensor | None,
    sorted_pairs: torch.Tensor,
    block_expert: torch.Tensor,
    top_k: int,
    cfg: dict[str, int],
) -> None:
    num_pairs = out.shape[0]
    n, k = b.shape[1], b.shape[2]
    grid = (block_expert.numel(), triton.cdiv(n, cfg["BLOCK_N"]))
    _grouped_gemm_kernel[grid](
        a, b, out, b_scale if b_scale is not None else out, bias if bias is not None else out,
        weights if weights is not None else out, sorted_pairs, block_expert,
        num_pairs, n, k,
        a.stride(0), b.stride(0), b.stride(1), out.stride(0),
        b_scale.stride(0) if b_scale is not None else 0,
        bias.stride(0) if bias is not None else 0,
        TOP_K=top_k, MUL_WEIGHT=weights is not None, HAS_SCALE=b_scale is not None,
        HAS_BIAS=bias is not None,
        UPCAST=a.device.type == "cpu",
        BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )  # fmt: skip


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    act: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """What ``moe.experts_reference`` computes, in two grouped-GEMM launches. ``x``
    ``[T, H]``; ``w13`` ``[E, 2I, H]``, ``w2`` ``[E, H, I]`` (model dtype, or e4m3 with
    ``*_scale`` ``[E, 2I]`` / ``[E, H]``); ``weights``/``experts`` ``[T, k]``; optional
    biases ``[E, 2I]`` / ``[E, H]`` and activation of ``[gate | up]`` (default SiLU·mul)."""
    tokens, hidden = x.shape
    top_k = experts.shape[1]
    num_experts, two_inter = w13.shape[0], w13.shape[1]
    if tokens == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    pairs = tokens * top_k
    if config is None:
        name = torch.cuda.get_device_name(x.device) if x.is_cuda else "cpu"
        config = get_config(shape_key(num_experts, two_inter, hidden, w13.dtype, name), pairs)
    sorted_pairs, block_expert = align_by_expert(experts, num_experts, config["BLOCK_M"])
    gate_up = torch.empty((pairs, two_inter), dtype=x.dtype, device=x.device)
    _gemm(x, w13, w13_scale, w13_bias, gate_up, None, sorted_pairs, block_expert, top_k, config)
    if act is None:
        inter = two_inter // 2
        mid = torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    else:
        mid = act(gate_up).contiguous()
    down = torch.empty((pairs, hidden), dtype=x.dtype, device=x.device)
    flat_w = weights.reshape(-1).contiguous()
    _gemm(mid, w2, w2_scale, w2_bias, down, flat_w, sorted_pairs, block_expert, 1, config)
    return down.view(tokens, top_k, hidden).sum(dim=1)
