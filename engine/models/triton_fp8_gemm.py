"""A split-K W8A8 FP8 GEMM for decode-sized row counts (5-256 rows), used only where it was
measured faster than ``torch._scaled_mm`` (docs/quantization.md, "FP8 GEMM choice").

Why: at decode row counts cuBLASLt's row-wise FP8 GEMM is latency-bound, no faster than
bf16 (benchmarks/results/peers/fp8_gemm_shapes_h200.json: qkv at 128 rows took 30.7 µs in
FP8 against 30.2 µs in bf16): its tiles cover M with few programs, so too few SMs stream
the weight. Splitting K gives each (M tile, N tile) ``SPLIT_K`` programs over disjoint
slices of K, so enough programs run to read the weight at bandwidth.

``y = (xq @ wq.T) * x_scale[:, None] * w_scale[None, :] (+ bias)``, with ``xq`` ``[M, K]``
and ``wq`` ``[N, K]`` float8_e4m3fn, ``x_scale`` ``[M]`` and ``w_scale`` ``[N]`` float32.
Both scales are per row of their operand, so each program scales its float32 partial sum
before adding it into a float32 output with atomics (the sum is linear); the bias is added
by the K slice 0 only. With ``SPLIT_K == 1`` the program writes the output dtype directly.
Atomic adds make the summation order vary run to run: ``--deterministic`` never takes this
path (docs/design.md §3, "Deterministic mode").

Tiles are data: ``fp8_gemm_configs.json`` holds one table per GPU kind (``"gpus"``, keyed
by ``torch.cuda.get_device_name()``), each mapping ``"N,K"`` to ``[max_rows, config or
null]`` buckets, written by ``python -m benchmarks.gpu.fp8_gemm_tune --write`` on that
kind: a config where this kernel beat ``torch._scaled_mm`` at that row count, null where it
did not. A GPU kind without a table of its own takes the first table in the file (the
winners of another kind beat nothing by measurement there, but were what every kind ran
before the tables were split); a shape or row count not in the table keeps
``torch._scaled_mm``. A file in the older one-table form (``"shapes"`` at the top) is that
table for every kind.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import triton
import triton.language as tl

CONFIG_FILE = Path(__file__).with_name("fp8_gemm_configs.json")
FP8 = torch.float8_e4m3fn


@dataclass(frozen=True, slots=True)
class Fp8GemmConfig:
    block_m: int = 16
    block_n: int = 64
    block_k: int = 128
    split_k: int = 4
    num_warps: int = 4
    num_stages: int = 3

    def check(self, k: int) -> None:
        for name in ("block_m", "block_n", "block_k"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"{name} must be a power of two >= 16, got {v}")
        if self.split_k < 1 or k % (self.split_k * self.block_k):
            raise ValueError(
                f"K={k} must split into {self.split_k} slices of whole {self.block_k}-wide tiles"
            )


@triton.jit
def _fp8_gemm_kernel(
    x_ptr, w_ptr, y_ptr, xs_ptr, ws_ptr, bias_ptr,
    M, N, K_PER_SPLIT,
    stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, ATOMIC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    split = tl.program_id(1)
    tiles_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // tiles_n
    pid_n = pid % tiles_n
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    kk = tl.arange(0, BLOCK_K)
    k0 = split * K_PER_SPLIT
    x_ptrs = x_ptr + rows.to(tl.int64)[:, None] * stride_xm + (k0 + kk)[None, :]
    w_ptrs = w_ptr + cols.to(tl.int64)[:, None] * stride_wn + (k0 + kk)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # K_PER_SPLIT is a multiple of BLOCK_K (checked on the host): no K mask.
    for _ in range(0, K_PER_SPLIT, BLOCK_K):
        x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
        w = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0)
        acc = tl.dot(x, tl.trans(w), acc, out_dtype=tl.float32)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    xs = tl.load(xs_ptr + rows, mask=row_ok, other=0.0)
    ws = tl.load(ws_ptr + cols, mask=col_ok, other=0.0)
    acc = acc * xs[:, None] * ws[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)
        acc += tl.where(split == 0, 1.0, 0.0) * bias[None, :]
    y_ptrs = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :]
    mask = row_ok[:, None] & col_ok[None, :]
    if ATOMIC:
        tl.atomic_add(y_ptrs, acc, mask=mask)
    else:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)


def fp8_gemm(
    xq: torch.Tensor,
    x_scale: torch.Tensor,
    weight: torch.Tensor,
    w_scale: torch.Tensor,
    config: Fp8GemmConfig,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """``[M, N]`` in ``out_dtype``: see the module docstring. ``x_scale`` ``[M]``."""
    m, k = xq.shape
    n = weight.shape[0]
    if xq.dtype != FP8 or weight.dtype != FP8 or weight.shape[1] != k:
        raise ValueError(f"need e4m3 [M, K] and [N, K], got {xq.dtype} {tuple(xq.shape)} "
                         f"and {weight.dtype} {tuple(weight.shape)}")  # fmt: skip
    if xq.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("both operands must be contiguous along K")
    config.check(k)
    atomic = config.split_k > 1
    y = torch.zeros((m, n), dtype=torch.float32, device=xq.device) if atomic else (
        torch.empty((m, n), dtype=out_dtype, device=xq.device)
    )  # fmt: skip
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n), config.split_k)
    _fp8_gemm_kernel[grid](
        xq, weight, y, x_scale.contiguous(), w_scale.contiguous(),
        bias if bias is not None else w_scale,  # never read without HAS_BIAS
        m, n, k // config.split_k,
        xq.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, ATOMIC=atomic,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    return y.to(out_dtype) if atomic else y


def gpu_tables(raw: dict) -> dict[str, dict]:
    """The file's tables by GPU name (the one-table form: one table under its ``gpu``)."""
    if "gpus" in raw:
        return dict(raw["gpus"])
    return {raw.get("gpu", ""): raw} if "shapes" in raw else {}


@functools.cache
def _gpu_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else ""


@functools.cache
def _tuned(gpu: str) -> dict[tuple[int, int], list[tuple[int, Fp8GemmConfig | None]]]:
    if not CONFIG_FILE.exists():
        return {}
    tables = gpu_tables(json.loads(CONFIG_FILE.read_text()))
    mine = tables.get(gpu) or next(iter(tables.values()), {})
    table: dict[tuple[int, int], list[tuple[int, Fp8GemmConfig | None]]] = {}
    for key, buckets in mine.get("shapes", {}).items():
        n, k = (int(v) for v in key.split(","))
        rows = [(int(r), Fp8GemmConfig(**c) if c else None) for r, c in buckets]
        table[(n, k)] = sorted(rows, key=lambda row: row[0])
    return table


def tuned_config(m: int, n: int, k: int) -> Fp8GemmConfig | None:
    """The measured winner for ``m`` rows of an ``[N, K]`` weight, or None (use cuBLAS)."""
    for max_rows, config in _tuned(_gpu_name()).get((n, k), ()):
        if m <= max_rows:
            return config
    return None


def config_rows(config: Fp8GemmConfig) -> dict[str, int]:
    """A config as the JSON table stores it."""
    return asdict(config)
