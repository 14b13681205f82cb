"""Rotary position embeddings (HF "rotate half" layout), with llama3 and linear scaling."""

from __future__ import annotations

import math

import torch

from engine.models.layer_ops import LayerOps, TorchOps


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, object]) -> torch.Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = str(scaling.get("rope_type", scaling.get("type", "default"))) if scaling else "default"
    if kind == "default":
        return inv_freq
    factor = float(scaling["factor"])  # type: ignore[arg-type]
    if kind == "linear":
        return inv_freq / factor
    if kind == "llama3":
        return _llama3(inv_freq, factor, scaling)
    raise ValueError(
        f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3)"
    )


def _llama3(inv_freq: torch.Tensor, factor: float, scaling: dict[str, object]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths are slowed by ``factor``,
    short ones kept, the band between blended smoothly."""
    low = float(scaling.get("low_freq_factor", 1.0))  # type: ignore[arg-type]
    high = float(scaling.get("high_freq_factor", 4.0))  # type: ignore[arg-type]
    old_len = float(scaling.get("original_max_position_embeddings", 8192))  # type: ignore[arg-type]
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return torch.where(medium, blended, scaled)


class RotaryEmbedding(torch.nn.Module):
    """Precomputed cos/sin tables indexed by position."""

    def __init__(
        self,
        head_dim: int,
        max_positions: int,
        theta: float,
        scaling: dict[str, object],
        ops: LayerOps = TorchOps,
    ) -> None:
        super().__init__()
        self.ops = ops
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` [T, Hq, D] and ``k`` [T, Hk, D] by their token positions [T]."""
        return self.ops.rope(positions, q, k, self.cos, self.sin)
