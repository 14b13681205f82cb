"""Rotary position embeddings (HF "rotate half" layout), with llama3, linear, longrope
(Phi-3) and YaRN (DeepSeek) scaling."""

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
    if kind == "yarn":
        return _yarn(head_dim, theta, factor, scaling)
    raise ValueError(
        f"rope scaling type {kind!r} is not supported (supported: default, linear, llama3, "
        "longrope, yarn)"
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
    kind = str(scaling.get("rope_type", ""))
    if kind != "longrope":
        freqs = positions * inverse_frequencies(head_dim, theta, scaling)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        if kind == "yarn":
            mag = yarn_attention_factor(scaling)
            return emb.cos() * mag, emb.sin() * mag
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


def _yarn(head_dim: int, theta: float, factor: float, scaling: dict[str, object]) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than ``beta_slow`` times over the original context
    are interpolated (divided by ``factor``), those turning more than ``beta_fast`` times
    kept, with a linear ramp between (the correction range rounded outwards unless
    ``truncate`` is false), as transformers computes it."""
    orig = float(scaling["original_max_position_embeddings"])  # type: ignore[arg-type]
    fast = float(scaling.get("beta_fast") or 32)  # type: ignore[arg-type]
    slow = float(scaling.get("beta_slow") or 1)  # type: ignore[arg-type]

    def dim_of(rotations: float) -> float:
        return head_dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_of(fast), dim_of(slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    keep = 1 - ramp  # the share of the original (extrapolated) frequency
    return (1.0 / (factor * pos_freqs)) * (1 - keep) + (1.0 / pos_freqs) * keep


def yarn_attention_factor(scaling: dict[str, object]) -> float:
    """The magnitude YaRN gives cos/sin: ``attention_factor`` when set, else the ratio of
    the ``mscale`` and ``mscale_all_dim`` corrections (DeepSeek), else ``0.1 ln(factor) + 1``."""
    from engine.models.deepseek_args import yarn_mscale

    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])  # type: ignore[arg-type]
    factor = float(scaling["factor"])  # type: ignore[arg-type]
    mscale, all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
    if mscale and all_dim:
        return yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(all_dim))  # type: ignore[arg-type]
    return yarn_mscale(factor)


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
        self._spec = (head_dim, max_positions, theta, scaling)
        if torch.empty(0).is_meta:
            # Built on the meta device (engine/models/loading.py): shapes only, ``rebuild``
            # computes the tables (their math on meta tensors costs seconds of imports).
            cos = sin = torch.empty(max_positions, head_dim)
        else:
            cos, sin = rope_tables(head_dim, max_positions, theta, scaling)
        self.cos: torch.Tensor
        self.sin: torch.Tensor
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def rebuild(self, device: torch.device | str) -> None:
        """The float32 tables computed again on ``device`` (a model built on the meta
        device, engine/models/loading.py, has none until then)."""
        with torch.device(device):
            cos, sin = rope_tables(*self._spec)
        self.cos, self.sin = cos.float(), sin.float()

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q`` [T, Hq, D] and ``k`` [T, Hk, D] by their token positions [T]."""
        return self.ops.rope(positions, q, k, self.cos, self.sin)
