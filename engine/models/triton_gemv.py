"""A one-launch Triton GEMV for the decoder projections at 1-4 rows: ``y = x @ W.T (+ b)``.

At batch 1 a decode step's matmuls are weight streams: each weight byte is read once and
used for a handful of multiply-adds, so the only thing that matters is how close the read
gets to HBM bandwidth. For Llama-3.1-8B's qkv (6144x4096) and o (4096x4096) projections on
an H200, cuBLAS reads at ~3.1 TB/s, and for o and down (4096x14336) it splits K and adds a
second reduce kernel (~1.7 us each). Here each program owns ``BLOCK_N`` output columns and
walks the whole of K itself, so there is no split-K, no atomics and no second kernel; the
grid is made wide enough (small ``BLOCK_N``) that every SM holds a couple of programs.

Each program keeps a ``[BLOCK_N, BLOCK_K]`` float32 partial sum per row of ``x`` and reduces
it along K once, after the loop: a reduction per chunk would put a cross-warp exchange
(shared memory and a barrier) in the middle of the stream. The K loop is a ``tl.range`` with
``num_stages``, which makes Triton pipeline these plain loads (it otherwise only pipelines
loads that feed ``tl.dot``; the sm_90 PTX has cp.async copies at num_stages >= 2 and plain
16-byte loads at 1).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

# (BLOCK_N, BLOCK_K, num_warps, num_stages)
GemvConfig = tuple[int, int, int, int]

MAX_ROWS = 4  # the kernel unrolls one accumulator per row of x
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_SMS = 132  # H200; only sizes the default grid, any GPU runs any config

# Measured winners, keyed (N, K, M, element bytes); benchmarks/gpu/gemv_sweep.py prints the
# entries to paste here. Shapes not listed use the heuristic in gemv_config.
_TUNED: dict[tuple[int, int, int, int], GemvConfig] = {
    # Llama-3.1-8B at batch 1, bf16, H200 (benchmarks/results/gpu/gemv_h200.json; us with L2 flushed).
    (6144, 4096, 1, 2): (4, 512, 2, 4),  # qkv: 20.38 us vs cuBLAS 22.45 us
    (4096, 4096, 1, 2): (8, 512, 4, 4),  # o: 15.94 us vs cuBLAS 18.69 us
    (28672, 4096, 1, 2): (4, 1024, 4, 1),  # gate_up: 65.34 us vs cuBLAS 71.01 us
    (4096, 14336, 1, 2): (8, 512, 4, 3),  # down: 38.75 us vs cuBLAS 42.24 us
}
# Shapes where the sweep found cuBLAS faster than every config: TritonOps.linear leaves them
# to F.linear.
_CUBLAS_FASTER: set[tuple[int, int, int, int]] = set()


def prefers_cublas(n: int, k: int, m: int, dtype: torch.dtype) -> bool:
    return (n, k, m, dtype.itemsize) in _CUBLAS_FASTER


def load_sweep(path: str) -> None:
    """Take ``benchmarks/gpu/gemv_sweep.py``'s JSON as the table (benchmarks: measure with a
    sweep's winners before pasting them into ``_TUNED``)."""
    import json

    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    for row in data["shapes"]:
        key = (row["n"], row["k"], row["m"], 4 if row["dtype"] == "float32" else 2)
        best = row.get("best")
        if best and best["us"] < row["cublas_us"]:
            _TUNED[key] = tuple(best["config"])  # type: ignore[assignment]
            _CUBLAS_FASTER.discard(key)
        else:
            _CUBLAS_FASTER.add(key)
    gemv_config.cache_clear()


@triton.jit
def _row_fma(acc, w, x_row_ptr, cols, K, EVEN_K: tl.constexpr):
    """acc += w * x[cols] (x broadcast over the BLOCK_N rows of the weight tile)."""
    x = tl.load(x_row_ptr + cols) if EVEN_K else tl.load(x_row_ptr + cols, mask=cols < K, other=0.0)
    return acc + w * x.to(tl.float32)[None, :]


@triton.jit
def _row_store(acc, bias, y_row_ptr, offs_n, mask_n, HAS_BIAS: tl.constexpr):
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += bias
    tl.store(y_row_ptr + offs_n, y.to(y_row_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
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
    # The last program's rows past N re-read row N-1 instead of masking: the loads stay
    # unpredicated and vectorised, and those rows are never stored.
    rows = tl.minimum(offs_n, N - 1)
    offs_k = tl.arange(0, BLOCK_K)
    # int64 row offsets: lm_head-sized weights pass 2^31 elements.
    w_ptrs = w_ptr + rows.to(tl.int64)[:, None] * K + offs_k[None, :]
    # One accumulator per row of x; those for rows >= M are never used and compile away.
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
    bias = tl.zeros([BLOCK_N], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(b_ptr + rows).to(tl.float32)
    _row_store(acc0, bias, y_ptr, offs_n, mask_n, HAS_BIAS)
    if M > 1:
        _row_store(acc1, bias, y_ptr + stride_ym, offs_n, mask_n, HAS_BIAS)
    if M > 2:
        _row_store(acc2, bias, y_ptr + 2 * stride_ym, offs_n, mask_n, HAS_BIAS)
    if M > 3:
        _row_store(acc3, bias, y_ptr + 3 * stride_ym, offs_n, mask_n, HAS_BIAS)


def _pow2_floor(v: float) -> int:
    p = 1
    while p * 2 <= v:
        p *= 2
    return p


@functools.lru_cache(maxsize=256)  # called per launch when no config is given
def gemv_config(n: int, k: int, dtype: torch.dtype, m: int = 1) -> GemvConfig:
    """Default ``(BLOCK_N, BLOCK_K, num_warps, num_stages)`` for an ``[m, k] x [n, k]^T``.

    A measured entry when there is one; else BLOCK_N small enough for two programs per SM
    (the grid is the only source of parallelism without split-K), and BLOCK_K so a weight
    tile is ~16 KiB in flight per program, capped so the float32 accumulators (BLOCK_N *
    BLOCK_K * m values over the program's threads) stay within ~128 registers a thread.
    """
    size = dtype.itemsize
    tuned = _TUNED.get((n, k, m, size))
    if tuned is not None:
        return tuned
    block_n = min(32, max(4, _pow2_floor(n / (2 * _SMS))))
    block_k = min(1024, max(128, _pow2_floor(16384 / (block_n * size))))
    block_k = min(block_k, max(16, triton.next_power_of_2(k)))
    warps = 4
    rows = triton.next_power_of_2(m)
    if block_n * block_k * rows > 64 * 32 * warps:
        warps = 8
    while block_n * block_k * rows > 128 * 32 * warps and block_k > 16:
        block_k //= 2
    return block_n, block_k, warps, 2


def _problem(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> str | None:
    """Why ``gemv(x, weight, bias)`` cannot run, or None: one list of conditions for both
    ``supports_gemv`` (the model's routing) and ``gemv``'s ValueError."""
    if not (
        x.device.type == "cuda"
        or (x.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")
    ):
        return (
            f"the triton gemv needs CUDA tensors (got {x.device}); on the CPU use "
            "torch.nn.functional.linear (TRITON_INTERPRET=1 runs the kernel slowly, for tests)"
        )
    if x.dim() != 2 or weight.dim() != 2:
        return (
            f"gemv needs x [M, K] and weight [N, K], got {tuple(x.shape)} and {tuple(weight.shape)}"
        )
    if not 1 <= x.shape[0] <= MAX_ROWS:
        return f"gemv handles 1 to {MAX_ROWS} rows of x, got {x.shape[0]}"
    if x.shape[1] != weight.shape[1] or x.shape[1] < 1 or weight.shape[0] < 1:
        return f"shapes do not match: x {tuple(x.shape)}, weight {tuple(weight.shape)} (need [M, K], [N, K])"
    if x.dtype not in _DTYPES or weight.dtype != x.dtype:
        return f"dtypes: x {x.dtype}, weight {weight.dtype} (need one of {_DTYPES})"
    if x.device != weight.device:
        return f"x is on {x.device} but weight on {weight.device}"
    if x.stride(1) != 1:
        return f"x must be contiguous along K (strides {x.stride()})"
    if not weight.is_contiguous():
        return f"weight must be contiguous (strides {weight.stride()})"
    if bias is not None and (
        bias.shape != (weight.shape[0],)
        or not bias.is_contiguous()
        or bias.dtype != x.dtype
        or bias.device != x.device
    ):
        return (
            f"bias must be a contiguous [{weight.shape[0]}] {x.dtype} tensor on {x.device}, "
            f"got {tuple(bias.shape)} {bias.dtype} on {bias.device}"
        )
    return None


def supports_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether ``gemv(x, weight, bias)`` applies (else use ``F.linear``): 1-4 rows of ``x``
    contiguous along K, a contiguous ``[N, K]`` weight and a contiguous ``[N]`` bias of the
    same dtype (bf16/fp16/fp32) on one CUDA device (or the CPU under TRITON_INTERPRET=1)."""
    return _problem(x, weight, bias) is None


def _validate(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    problem = _problem(x, weight, bias)
    if problem is not None:
        raise ValueError(problem)


def _validate_config(config: GemvConfig) -> None:
    if len(config) != 4:
        raise ValueError(f"config is (BLOCK_N, BLOCK_K, num_warps, num_stages), got {config}")
    block_n, block_k, warps, stages = config
    for name, v in (("BLOCK_N", block_n), ("BLOCK_K", block_k), ("num_warps", warps)):
        if v < 1 or v & (v - 1):
            raise ValueError(f"{name} must be a power of two, got {v}")
    if block_k < 16 or warps > 32 or stages < 1:
        raise ValueError(f"need BLOCK_K >= 16, num_warps <= 32, num_stages >= 1: {config}")


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: GemvConfig | None = None,
) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` for 1-4 rows of ``x`` in one kernel: float32 sums, output
    in ``x``'s dtype. Raises ValueError where ``supports_gemv`` is False."""
    _validate(x, weight, bias)
    if config is not None:
        _validate_config(config)
    return _launch(x, weight, bias, config)


def _launch(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, config: GemvConfig | None
) -> torch.Tensor:
    """``gemv`` without the checks (the caller has run ``supports_gemv``)."""
    m, k = x.shape
    n = weight.shape[0]
    block_n, block_k, warps, stages = config or gemv_config(n, k, x.dtype, m)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, weight, weight if bias is None else bias, y, n, k, x.stride(0), y.stride(0),
        M=m, HAS_BIAS=bias is not None, EVEN_K=k % block_k == 0,
        BLOCK_N=block_n, BLOCK_K=block_k, NUM_STAGES=stages,
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return y
