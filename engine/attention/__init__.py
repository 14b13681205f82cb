"""Attention backends by name: ``torch_ref`` everywhere, ``triton`` on CUDA when available."""

from __future__ import annotations

import importlib.util

from engine.attention.base import AttentionBackend, AttentionMetadata

__all__ = ["AttentionBackend", "AttentionMetadata", "get_backend"]


def get_backend(name: str, device: str) -> AttentionBackend:
    """Build the named backend; "auto" picks triton on CUDA when it imports, else torch_ref."""
    if name == "auto":
        name = (
            "triton"
            if device.startswith("cuda") and importlib.util.find_spec("triton")
            else "torch_ref"
        )
    if name == "torch_ref":
        from engine.attention.torch_ref import TorchRefAttention

        return TorchRefAttention()
    if name == "triton":
        if not device.startswith("cuda"):
            raise ValueError("attention_backend 'triton' needs device 'cuda'")
        from engine.attention.triton_backend import TritonAttention

        return TritonAttention()
    raise ValueError(f"attention_backend must be 'auto', 'torch_ref' or 'triton', got {name!r}")
