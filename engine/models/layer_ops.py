"""The element-wise work of a decoder layer: RMSNorm (optionally fused with the residual
add), SiLU·mul and rotary embeddings.

Two implementations with one interface. ``TorchOps`` is plain torch, the reference (it is
what runs on the CPU, where float32 outputs match Hugging Face token for token).
``TritonOps`` (``engine/models/triton_ops.py``) does each op in one kernel; at batch 1 an
8B model's decode step on a GPU is otherwise ~35 short kernels per layer, whose launch and
tail time inside a CUDA graph cost about as much as streaming the weights. The Triton
kernels round where torch rounds (every intermediate that torch keeps in the model dtype is
rounded to it), so both give the same values up to float32 summation order.
"""

from __future__ import annotations

import importlib.util

import torch


class TorchOps:
    name = "torch"

    @staticmethod
    def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """``weight * normalise(x)`` over the last dim; statistics in float32 (as HF)."""
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
        return weight * x32.to(dtype)

    @classmethod
    def add_rms_norm(
        cls, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual + x`` (the new residual stream) and its RMSNorm."""
        total = x + residual
        return cls.rms_norm(total, weight, eps), total

    @staticmethod
    def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(gate) * up`` for ``gate_up = [gate | up]`` along the last dim."""
        gate, up = gate_up.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up

    @staticmethod
    def rope(
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` [T, Hq, D] and ``k`` [T, Hk, D] ("rotate half" layout) by the float32
        tables ``cos``/``sin`` [max_positions, D] at ``positions`` [T]."""
        c = cos[positions].unsqueeze(1).to(q.dtype)
        s = sin[positions].unsqueeze(1).to(q.dtype)
        return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


LayerOps = type[TorchOps]


def get_layer_ops(device: str, fused: bool) -> LayerOps:
    """Triton kernels on CUDA when asked for and importable, else the torch reference."""
    if fused and device.startswith("cuda") and importlib.util.find_spec("triton") is not None:
        from engine.models.triton_ops import TritonOps

        return TritonOps
    return TorchOps
