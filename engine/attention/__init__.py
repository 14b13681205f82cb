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

        backend = TorchRefAttention()
        if device == "cpu" and backend.cpu_kernels:
            # Build (or load the cached) C decode kernel at start-up, not inside the first
            # request's decode step (a first build takes a few seconds).
            from engine.attention.cpu_kernels import load_decode_kernel

            load_decode_kernel()
        return backend
    if name == "triton":
        if not device.startswith("cuda"):
            raise ValueError("attention_backend 'triton' needs device 'cuda'")
        from engine.attention.triton_backend import TritonAttention

        return TritonAttention()
    raise ValueError(f"attention_backend must be 'auto', 'torch_ref' or 'triton', got {name!r}")
