"""Rotary position embeddings (HF "rotate half" layout), with llama3, linear and longrope
(Phi-3) scaling."""

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
        f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3, "
        "longrope)"
    )


def rope_tables(
    head_dim: int, max_positions: int, theta: float, scaling: dict[str, object]
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``cos``/``sin`` tables ``[max_positions, head_dim]``.

    longrope (Phi-3): positions below ``original_max_position_embeddings`` rotate with the
    short factors, later ones with the long factors, both scaled by the attention factor.
    transformers switches the whole forward pass to the long factors once any position
    passes the original length; with a KV cache that means tokens cached earlier keep their
    short-factor keys, which is what a per-position table gives (a prompt that is longer
    than the original length in one piece differs: its early tokens use the short
    factors here)."""
    positions = torch.arange(max_positions, dtype=torch.float32)[:, None]
    if str(scaling.get("rope_type", "")) != "longrope":
        freqs = positions * inverse_frequencies(head_dim, theta, scaling)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()
    orig = int(scaling["original_max_position_embeddings"])  # type: ignore[call-overload]
    factor = float(scaling["factor"])  # type: ignore[arg-type]
    attn = scaling.get("attention_factor")
    if attn is None:
        attn = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    tables = []
    for key in ("short_factor", "long_factor"):
        ext = torch.tensor(scaling[key], dtype=torch.float32)
        if ext.numel() != head_dim // 2:
            raise ValueError(f"longrope {key} has {ext.numel()} entries, need {head_dim // 2}")
        freqs = positions * (1.0 / (ext * theta**shape))[None, :]
        tables.append(torch.cat((freqs, freqs), dim=-1))
    emb = torch.where(positions < orig, tables[0], tables[1])
    return emb.cos() * float(attn), emb.sin() * float(attn)  # type: ignore[arg-type]


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
        cos, sin = rope_tables(head_dim, max_positions, theta, scaling)
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` [T, Hq, D] and ``k`` [T, Hk, D] by their token positions [T]."""
        return self.ops.rope(positions, q, k, self.cos, self.sin)
