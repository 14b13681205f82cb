"""Batch-invariant layer ops for ``deterministic`` mode (docs/design.md §3 "Deterministic mode").

A matmul library picks its kernel by shape: one row goes to a GEMV, 64 rows to a blocked
GEMM with another summation order, so the same token's hidden state differs in its low
bits depending on how many other rows share the step. ``BatchInvariantTorchOps`` (the CPU,
or CUDA without Triton) removes that dependence: every projection and every norm runs on
row tiles of exactly ``ROW_TILE`` rows (the last tile zero-padded), so the library sees
one shape whatever the batch, and a row's output depends only on that row. A matmul's
output row reads only its own input row and the weight, and every row of a tile goes
through the same kernel, so a row's bits do not depend on its position in the tile or on
its neighbours. The cost is the padding (a decode step of one row computes ``ROW_TILE``)
and one library call per tile. On CUDA the Triton ops do the same with a fixed-tile
matmul kernel (``engine/models/triton_batch_invariant.py``).

The element-wise ops (SiLU·mul, RoPE, the residual add) are per element already.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.models.layer_ops import TorchOps

ROW_TILE = 16


def tiled_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn`` applied to ``x``'s rows (its last dim is the feature dim) in tiles of exactly
    ``ROW_TILE`` rows; ``fn`` must treat rows independently (a matmul, a row norm)."""
    rows = x.reshape(-1, x.shape[-1])
    n = rows.shape[0]
    pad = -n % ROW_TILE
    if pad:
        rows = torch.cat((rows, rows.new_zeros(pad, rows.shape[1])))
    elif not rows.is_contiguous():
        rows = rows.contiguous()
    out = torch.cat([fn(rows[i : i + ROW_TILE]) for i in range(0, n + pad, ROW_TILE)])
    return out[:n].reshape(*x.shape[:-1], out.shape[-1])


class BatchInvariantTorchOps(TorchOps):
    """``TorchOps`` whose matmuls and norms give a row the same bits in any batch."""

    name = "torch_batch_invariant"
    batch_invariant = True

    @staticmethod
    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return tiled_rows(lambda t: torch.nn.functional.linear(t, weight, bias), x)

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return tiled_rows(lambda t: TorchOps.rms_norm(t, weight, eps), x)

    @classmethod
    def add_rms_norm(
        cls, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        total = x + residual
        return cls.rms_norm(total, weight, eps), total

    @classmethod
    def logits(cls, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return cls.linear(x, weight, None)
