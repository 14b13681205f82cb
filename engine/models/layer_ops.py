"""The element-wise work of a decoder layer: RMSNorm (optionally fused with the residual
add), SiLU·mul and rotary embeddings (optionally fused with the store of K/V into the
paged cache), and the projections' matmuls (``linear``).

Two implementations with one interface. ``TorchOps`` is plain torch, the reference (it is
what runs on the CPU, where float32 outputs match Hugging Face token for token).
``TritonOps`` (``engine/models/triton_ops.py``) does each op in one kernel; at batch 1 an
8B model's decode step on a GPU is otherwise ~35 short kernels per layer, whose launch and
tail time inside a CUDA graph cost about as much as streaming the weights. The Triton
kernels round where torch rounds (every intermediate that torch keeps in the model dtype is
rounded to it), so both give the same values up to float32 summation order.
``TritonOps.linear`` is a one-launch GEMV (``triton_gemv.py``) at 1-4 rows, where cuBLAS
reads the weights below HBM bandwidth and splits K over two kernels, and cuBLAS otherwise.
``TritonOps`` builds on ``TorchOps``, so this module never imports it: the choice between
them is ``engine.models.get_layer_ops``.
"""

from __future__ import annotations

import torch

from engine.attention.kv_quant import DEFAULT_SCALE, byte_view, quantize


class TorchOps:
    name = "torch"
    # True where ``rope_store_kv`` writes the cache inside the RoPE kernel (one launch
    # fewer per layer); the model then hands the backend a prewritten cache. Here it is
    # the reference, so the model keeps the backend's own write.
    fuses_kv_write = False
    # True for the ops of deterministic mode (engine/models/batch_invariant.py): a row's
    # result does not depend on the rows computed with it.
    batch_invariant = False

    @staticmethod
    def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight.T + bias``, what ``nn.Linear`` computes (the weight in its layout)."""
        return torch.nn.functional.linear(x, weight, bias)

    @classmethod
    def logits(cls, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """The LM head's ``x @ weight.T`` (``nn.Linear``'s own matmul, not ``linear``: the
        GEMV of the Triton ops is for the decoder's projections)."""
        return torch.nn.functional.linear(x, weight)

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

    @classmethod
    def rope_store_kv(
        cls,
        positions: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
        k_scale: float = DEFAULT_SCALE,
        v_scale: float = DEFAULT_SCALE,
    ) -> torch.Tensor:
        """``rope`` of ``q``/``k``, then rotated ``k`` and ``v`` [T, Hk, D] stored into one
        layer's paged cache ``kv_cache`` [2, blocks, block_size, Hk, D] at ``slot_mapping``
        [T] (slot < 0: not stored; an fp8 cache stores them quantized with
        ``k_scale``/``v_scale``, engine/attention/kv_quant.py). Returns the rotated ``q``."""
        q, k = cls.rope(positions, q, k, cos, sin)
        store_kv(kv_cache, k, v, slot_mapping, k_scale, v_scale)
        return q


def store_kv(
    kv_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = DEFAULT_SCALE,
    v_scale: float = DEFAULT_SCALE,
) -> None:
    """Scatter ``k``/``v`` rows into the cache at their slots, skipping negative slots.

    The boolean selection synchronises with the device: this is the reference, the fused
    kernel is what a CUDA graph runs."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != k.shape[1:]:
        raise ValueError(f"kv_cache shape {tuple(kv_cache.shape)} does not fit k {tuple(k.shape)}")
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = kv_cache.shape[2]
    blocks, offsets = slots // block_size, slots % block_size
    raw = byte_view(kv_cache)  # float8 moves as bytes (no float8 index_put on the CPU)
    raw[0, blocks, offsets] = byte_view(quantize(k[keep], kv_cache.dtype, k_scale))
    raw[1, blocks, offsets] = byte_view(quantize(v[keep], kv_cache.dtype, v_scale))


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


LayerOps = type[TorchOps]
