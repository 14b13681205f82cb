"""Attention backends by name: ``torch_ref`` everywhere; ``triton`` and ``flash_attn`` on
CUDA; ``auto`` = Triton on CUDA, with FA4 for the step shapes where it measured faster
when the optional ``flash-attn-4`` package is installed (engine/attention/flash_attn.py)."""

from __future__ import annotations

import importlib.util
import logging

from engine.attention.base import AttentionBackend, AttentionMetadata

__all__ = ["BACKEND_NAMES", "AttentionBackend", "AttentionMetadata", "get_backend"]

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", "torch_ref", "triton", "flash_attn")


def get_backend(name: str, device: str, *, deterministic: bool = False) -> AttentionBackend:
    """Build the named backend (ValueError with the alternatives when it cannot run here).

    "auto": on CUDA with Triton, Triton plus FA4 per step shape when FA4 imports (else
    Triton alone, said once in the log); elsewhere torch_ref. ``deterministic``: the
    backend's batch-invariant form (docs/design.md §3 "Deterministic mode"); "auto" is
    then Triton alone on CUDA, and flash_attn is refused."""
    if name not in BACKEND_NAMES:
        raise ValueError(f"attention_backend must be one of {BACKEND_NAMES}, got {name!r}")
    if deterministic:
        return _deterministic_backend(name, device)
    if name == "auto":
        if not (device.startswith("cuda") and importlib.util.find_spec("triton")):
            return _torch_ref(device)
        from engine.attention.flash_attn import FlashAttention, fa4_available

        if fa4_available():
            return FlashAttention(policy="auto")
        _log_no_fa4()
        name = "triton"
    if name == "torch_ref":
        return _torch_ref(device)
    if name == "flash_attn":
        from engine.attention.flash_attn import FlashAttention, check_flash_attn_usable

        check_flash_attn_usable(device)
        return FlashAttention(policy="flash_attn")
    if not device.startswith("cuda"):
        raise ValueError("attention_backend 'triton' needs device 'cuda'")
    from engine.attention.triton_backend import TritonAttention

    return TritonAttention()


def _deterministic_backend(name: str, device: str) -> AttentionBackend:
    if name == "flash_attn":
        raise ValueError(
            "deterministic mode has no flash_attn form (its split sizes follow the batch); "
            "use attention_backend 'auto' or 'triton'"
        )
    if name == "torch_ref" or not (
        device.startswith("cuda") and importlib.util.find_spec("triton")
    ):
        if name == "triton":
            raise ValueError("attention_backend 'triton' needs device 'cuda'")
        from engine.attention.torch_ref import TorchRefAttention

        # Per request, never the C decode kernel or the padded decode batch.
        return TorchRefAttention(cpu_kernels=False, batch_invariant=True)
    from engine.attention.triton_backend import TritonAttention

    return TritonAttention(batch_invariant=True)


_said_no_fa4 = False


def _log_no_fa4() -> None:
    global _said_no_fa4
    if not _said_no_fa4:
        _said_no_fa4 = True
        logger.info(
            "flash-attn is not installed: attention runs on Triton alone "
            "(pip install 'pdserve[flash-attn]' adds FA4 for chunked prefill)"
        )


def _torch_ref(device: str) -> AttentionBackend:
    from engine.attention.torch_ref import TorchRefAttention

    backend = TorchRefAttention()
    if device == "cpu" and backend.cpu_kernels:
        # Build (or load the cached) C decode kernel at start-up, not inside the first
        # request's decode step (a first build takes a few seconds).
        from engine.attention.cpu_kernels import load_decode_kernel

        load_decode_kernel()
    return backend
