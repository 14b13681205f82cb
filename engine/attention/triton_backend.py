"""The Triton attention backend: paged KV write + varlen/decode paged attention on the GPU.

``TritonAttention`` implements ``AttentionBackend`` (engine/attention/base.py) with the
kernels in ``triton_kernels.py``. It reads only the host-side integers of the metadata
(``num_reqs``, ``max_query_len``, ``max_seq_len``) and never synchronises with the device,
so a decode step through it can be captured in a CUDA graph (engine/executor/cuda_graphs.py).
``forward_prewritten`` skips the KV write for a model whose RoPE kernel already stored K/V.

On a CPU tensor it runs only under ``TRITON_INTERPRET=1`` (Triton's interpreter; slow, for
the kernel tests CI runs): anything else is a ValueError with that advice.
"""

from __future__ import annotations

import os

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.kv_quant import DEFAULT_SCALE, is_fp8
from engine.attention.triton_kernels import (
    _merge_splits_kernel,
    _paged_attn_kernel,
    _write_kv_kernel,
)

# Re-exported: the kernel tests build their LaunchConfig from here.
from engine.attention.triton_launch import LaunchConfig as LaunchConfig
from engine.attention.triton_launch import choose_config, invariant_config, pow2

_LOG2E = 1.4426950408889634
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _check_device(t: torch.Tensor) -> None:
    if t.device.type == "cuda":
        return
    if t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return
    raise ValueError(
        f"the triton attention backend needs CUDA tensors (got {t.device}); on the CPU use "
        "attention_backend='torch_ref' (TRITON_INTERPRET=1 runs the kernels slowly, for tests)"
    )


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = DEFAULT_SCALE,
    v_scale: float = DEFAULT_SCALE,
) -> None:
    """Store ``key``/``value`` ``[tokens, kv_heads, head_dim]`` at ``slot_mapping`` (-1 = skip);
    an fp8 cache is quantized with ``k_scale``/``v_scale`` (engine/attention/kv_quant.py)."""
    num_tokens, kv_heads, head_dim = key.shape
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != (kv_heads, head_dim):
        raise ValueError(
            f"kv_cache shape {tuple(kv_cache.shape)} does not fit key {tuple(key.shape)}"
        )
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache layer view must be contiguous")
    if num_tokens == 0:
        return
    # Token rows may be strided (views into a fused QKV output); heads+dims must be dense.
    key = key if key.stride()[1:] == (head_dim, 1) else key.contiguous()
    value = value if value.stride()[1:] == (head_dim, 1) else value.contiguous()
    row = kv_heads * head_dim
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        kv_cache,
        slot_mapping,
        key.stride(0),
        value.stride(0),
        kv_cache.stride(0),
        k_scale,
        v_scale,
        ROW=row,
        ROW_P2=pow2(row),
        QUANT=is_fp8(kv_cache.dtype),
    )


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    num_sms: int | None,
    config: LaunchConfig | None = None,
    k_scale: float = DEFAULT_SCALE,
    v_scale: float = DEFAULT_SCALE,
    window: int = 0,
    softcap: float = 0.0,
    f16_kv: bool = False,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of ``query`` ``[tokens, heads, head_dim]`` over the paged context
    (an fp8 cache is read back as ``value * k_scale`` / ``value * v_scale``); ``window``,
    ``softcap`` and ``sinks`` as in ``AttentionBackend.forward``. ``f16_kv``: an fp8 cache
    under a bf16 query is converted to fp16 tiles (packed converts; triton_kernels.py)."""
    num_tokens, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    if query.stride(2) != 1:
        query = query.contiguous()
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_tokens == 0 or meta.num_reqs == 0:
        return out
    cfg = config or choose_config(
        max_query_len=meta.max_query_len,
        max_seq_len=meta.max_seq_len,
        num_reqs=meta.num_reqs,
        num_tokens=num_tokens,
        num_kv_heads=num_kv_heads,
        group=group,
        dtype=query.dtype,
        num_sms=num_sms,
    )
    if cfg.block_q * group > cfg.block_m or (cfg.decode_only and meta.max_query_len > 1):
        raise ValueError(
            f"launch config {cfg} does not fit group {group} / max_query_len {meta.max_query_len}"
        )
    # Request r owns programs [qsl[r] // block_q + r, ...): an upper bound on q tiles.
    grid0 = meta.num_reqs if cfg.decode_only else num_tokens // cfg.block_q + meta.num_reqs
    if cfg.num_splits > 1:
        part_out = torch.empty(
            (num_tokens, num_heads, cfg.num_splits, head_dim),
            dtype=torch.float32,
            device=query.device,
        )
        part_lse = torch.empty(
            (num_tokens, num_heads, cfg.num_splits), dtype=torch.float32, device=query.device
        )
    else:
        part_out = part_lse = out  # unused by the kernel
    bt = meta.block_tables if meta.block_tables.stride(1) == 1 else meta.block_tables.contiguous()
    kv_fp8 = is_fp8(kv_cache.dtype)
    if sinks is not None and (sinks.shape != (num_heads,) or sinks.device != query.device):
        raise ValueError(f"sinks must be [{num_heads}] on {query.device}, got {sinks.shape}")
    _paged_attn_kernel[(grid0, num_kv_heads, cfg.num_splits)](
        query,
        kv_cache[0],
        kv_cache[1],
        out,
        part_out,
        part_lse,
        meta.query_start_loc,
        meta.seq_lens,
        bt,
        sinks if sinks is not None else out,
        scale * k_scale * _LOG2E if kv_fp8 else scale * _LOG2E,
        v_scale,
        window,
        # The kernel's scores are in base 2 (times log2 e), so is the cap.
        softcap * _LOG2E if softcap else 1.0,
        meta.num_reqs,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        bt.stride(0),
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        HEAD_P2=pow2(head_dim),
        PAGE=kv_cache.shape[2],
        BLOCK_Q=cfg.block_q,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        NUM_SPLITS=cfg.num_splits,
        DECODE_ONLY=cfg.decode_only,
        IEEE=query.dtype == torch.float32,
        UPCAST=query.device.type == "cpu" and query.dtype != torch.float32,
        KV_FP8=kv_fp8,
        HAS_WINDOW=window > 0,
        HAS_SOFTCAP=softcap > 0,
        F16_KV=f16_kv and kv_fp8 and query.dtype == torch.bfloat16,
        HAS_SINKS=sinks is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    if cfg.num_splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            part_out,
            part_lse,
            out,
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            NUM_SPLITS=cfg.num_splits,
            SPLITS_P2=pow2(cfg.num_splits),
            HEAD_P2=pow2(head_dim),
        )
    return out


def validate_inputs(query: torch.Tensor, key: torch.Tensor, kv_cache: torch.Tensor) -> None:
    """Raise ValueError for shapes/dtypes the kernels do not handle."""
    if query.dim() != 3 or key.dim() != 3:
        raise ValueError(
            f"query/key must be [tokens, heads, head_dim], got {tuple(query.shape)}, {tuple(key.shape)}"
        )
    _validate(query, key.shape[1], kv_cache)


def validate_prewritten(query: torch.Tensor, kv_cache: torch.Tensor) -> None:
    """``validate_inputs`` for a cache the caller has written: the cache alone gives the
    KV head count, and it must have the layout the fused store writes."""
    if query.dim() != 3:
        raise ValueError(f"query must be [tokens, heads, head_dim], got {tuple(query.shape)}")
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[4] != query.shape[2]:
        raise ValueError(
            f"kv_cache shape {tuple(kv_cache.shape)} does not fit query {tuple(query.shape)}"
        )
    if not kv_cache.is_contiguous():
        raise ValueError("kv_cache layer view must be contiguous")
    _validate(query, kv_cache.shape[3], kv_cache)


def _validate(query: torch.Tensor, num_kv_heads: int, kv_cache: torch.Tensor) -> None:
    _check_device(query)
    head_dim = query.shape[2]
    if head_dim < 16 or head_dim > 256 or head_dim % 8:
        # Not a power of two (Phi-3-mini's 96): tiles are padded to the next one.
        raise ValueError(f"head_dim must be a multiple of 8 in [16, 256], got {head_dim}")
    if query.dtype not in _DTYPES or not (kv_cache.dtype == query.dtype or is_fp8(kv_cache.dtype)):
        raise ValueError(
            f"dtypes: query {query.dtype}, kv_cache {kv_cache.dtype} (need one of {_DTYPES}, "
            "and a cache of the same dtype or float8_e4m3fn)"
        )
    if is_fp8(kv_cache.dtype) and query.device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(query.device)
        if (major, minor) < (8, 9):
            raise ValueError(
                f"kv_cache_dtype 'fp8' needs a GPU with float8 support (compute capability "
                f">= 8.9, this one is {major}.{minor}); use kv_cache_dtype 'auto'"
            )
    if query.shape[1] % num_kv_heads:
        raise ValueError(
            f"num_heads {query.shape[1]} is not a multiple of num_kv_heads {num_kv_heads}"
        )
    page = kv_cache.shape[2]
    if page < 1 or page & (page - 1):
        raise ValueError(f"block_size must be a power of two, got {page}")


class TritonAttention(AttentionBackend):
    """Paged attention through Triton kernels; CUDA (or TRITON_INTERPRET=1 on the CPU)."""

    name = "triton"
    accepts_prewritten_kv = True
    captures_mixed = True

    def __init__(
        self,
        k_scale: float = DEFAULT_SCALE,
        v_scale: float = DEFAULT_SCALE,
        batch_invariant: bool = False,
        f16_kv: bool = True,
    ) -> None:
        """``k_scale``/``v_scale``: an fp8 cache's per-tensor scales (kv_quant.py).
        ``batch_invariant``: every launch with ``invariant_config`` (deterministic mode).
        ``f16_kv``: an fp8 cache's tiles converted to fp16, not bf16 (``paged_attention``):
        1.12-1.82x faster at the same error on an H100 80GB (benchmarks/gpu/fp8_kv_attention.py,
        docs/quantization.md "FP8 KV cache")."""
        self._num_sms: dict[int, int] = {}
        self.k_scale, self.v_scale = k_scale, v_scale
        self.batch_invariant = batch_invariant
        self.f16_kv = f16_kv

    def _config(self, query: torch.Tensor, kv_cache: torch.Tensor) -> LaunchConfig | None:
        if not self.batch_invariant:
            return None  # choose_config, per step shape
        group = query.shape[1] // kv_cache.shape[3]
        return invariant_config(group, query.dtype, self._sms(query.device))

    def _sms(self, device: torch.device) -> int | None:
        if device.type != "cuda":
            return None
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in self._num_sms:
            self._num_sms[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
        return self._num_sms[idx]

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        validate_inputs(query, key, kv_cache)
        write_kv_cache(key, value, kv_cache, meta.slot_mapping, self.k_scale, self.v_scale)
        return paged_attention(
            query, kv_cache, meta, scale, num_sms=self._sms(query.device),
            config=self._config(query, kv_cache), k_scale=self.k_scale, v_scale=self.v_scale, window=window, softcap=softcap,
            f16_kv=self.f16_kv,
            sinks=sinks,
        )  # fmt: skip

    def forward_prewritten(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        *,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        validate_prewritten(query, kv_cache)
        return paged_attention(
            query, kv_cache, meta, scale, num_sms=self._sms(query.device),
            config=self._config(query, kv_cache), k_scale=self.k_scale, v_scale=self.v_scale, window=window, softcap=softcap,
            f16_kv=self.f16_kv,
            sinks=sinks,
        )  # fmt: skip
