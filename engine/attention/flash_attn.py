"""The flash-attn backend: FlashAttention-4 (PyPI ``flash-attn-4``) on the paged KV cache.

``FlashAttention`` implements ``AttentionBackend`` (engine/attention/base.py). It keeps the
engine's own K/V store (the fused RoPE + K/V kernel writes the cache, or
``write_kv_cache`` here) and only swaps the attention kernel, per step, between FA4's
paged varlen entry point and our Triton kernel (engine/attention/triton_backend.py):

- ``policy="flash_attn"`` (``--attention-backend flash_attn``): FA4 for every step with a
  query longer than one token (prefill, chunked prefill, mixed batches); pure decode stays
  on Triton, which the H200 table (``SHAPE_TABLE``) measures as faster there.
- ``policy="auto"``: FA4 only for the step shapes where the table measured it faster in
  every run (on the H200: chunked prefill over a long cached context); Triton elsewhere,
  and wherever FA4 cannot run (float32, where auto uses Triton and flash_attn raises).

FA4 reads our cache as it is: ``kv_cache[0]``/``kv_cache[1]`` are
``[num_blocks, block_size, kv_heads, head_dim]`` pages, ``block_tables`` its ``page_table``,
``seq_lens`` its ``seqused_k``; its causal mask is aligned to the end of the context, which is
where our queries sit (base.py, ``AttentionMetadata``). The host integers
``max_query_len``/``max_seq_len`` are its ``max_seqlen_q``/``max_seqlen_k`` bounds.

CUDA graphs (engine/executor/cuda_graphs.py) capture pure-decode steps only, and those run on
Triton under both policies, so no FA4 call is ever inside a graph: FA4's integer bounds
never have to cover a replay (docs/design.md §3 "Attention backends"). A step captured
anyway (a graph that is being recorded) also goes to Triton, for the same reason.

Not handled by FA4 here, so always Triton: a float8 KV cache (FA4's FP8 path needs
descale tensors per head; kv_quant.py keeps one per-tensor scale), float32 activations
(``policy="auto"``; the explicit policy raises), and CPU tensors.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.triton_backend import (
    TritonAttention,
    validate_inputs,
    validate_prewritten,
    write_kv_cache,
)

logger = logging.getLogger(__name__)

PACKAGE = "flash-attn-4"  # what `pip install pdserve[flash-attn]` brings (pyproject.toml)
_FA4_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True, slots=True)
class ShapeRule:
    """One row of the measured table: the step shape it covers and the faster kernel."""

    shape: str  # "decode" | "prefill" | "chunked_prefill" | "long_chunked_prefill"
    winner: str  # "triton" | "flash_attn"
    evidence: str  # the measured kernel times, FA4 vs Triton (ms), for the reader


# Kernel times on one H200, 8B head shape (32 query heads, 8 KV heads, dim 128, bf16,
# 16-token pages), FA4 4.0.0b36 vs our Triton kernel on the same cache, from
# benchmarks/gpu/attention_backends.py (two runs of 2026-12-01, benchmarks/results/gpu/
# attention_backends_h200.json and attention_backends_h200_run2.json).
# A shape goes to FA4 only where it won in both runs: FA4's host-side launch is long
# enough that sub-0.25 ms kernels flip between runs (2k prefill 0.100 then 0.218 ms).
SHAPE_TABLE: tuple[ShapeRule, ...] = (
    ShapeRule("decode", "triton", "b1 x 512: 0.183/0.211 vs 0.121; b64 x 2k: 0.238 vs 0.155"),
    ShapeRule("prefill", "triton", "one 2k prompt: 0.100/0.218 vs 0.132/0.135"),
    ShapeRule("chunked_prefill", "triton", "4 x 512 over 2k: 0.122/0.211 vs 0.199/0.200"),
    ShapeRule("long_chunked_prefill", "flash_attn", "2k over 8k: 0.432/0.418 vs 0.700/0.706"),
)

# Cached context from which a chunked prefill counts as long (the 8k row above).
LONG_CONTEXT_TOKENS = 4096


def step_shape(meta: AttentionMetadata) -> str:
    """Classify a step from host integers only (no device sync): ``decode`` when every
    request brings one token, ``chunked_prefill`` when the longest context holds at least
    as many cached tokens as the longest query (``long_chunked_prefill`` from
    ``LONG_CONTEXT_TOKENS`` of them), else ``prefill``."""
    if meta.max_query_len <= 1:
        return "decode"
    cached = meta.max_seq_len - meta.max_query_len
    if cached >= meta.max_query_len:
        return "long_chunked_prefill" if cached >= LONG_CONTEXT_TOKENS else "chunked_prefill"
    return "prefill"


def table_winner(shape: str) -> str:
    for rule in SHAPE_TABLE:
        if rule.shape == shape:
            return rule.winner
    raise ValueError(f"no measured row for step shape {shape!r}")


@functools.cache
def fa4_available() -> bool:
    """Whether FA4 imports here (cached). Never raises: a broken install is logged once."""
    if importlib.util.find_spec("flash_attn") is None:
        return False
    try:
        _fa4_varlen()
    except Exception as exc:  # an install whose CUTLASS DSL libraries do not load
        logger.warning("flash-attn is installed but does not import (%s); using Triton", exc)
        return False
    return True


@functools.cache
def _fa4_varlen() -> Callable[..., Any]:
    from flash_attn.cute import flash_attn_varlen_func

    return flash_attn_varlen_func  # type: ignore[no-any-return]


def flash_attn_paged(
    query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal paged attention through FA4: ``query`` ``[tokens, heads, head_dim]`` against
    the context in ``kv_cache`` ``[2, blocks, block_size, kv_heads, head_dim]`` (already
    holding this step's K/V). Same contract and result as ``triton_backend.paged_attention``."""
    if query.shape[0] == 0 or meta.num_reqs == 0:
        return torch.empty_like(query)
    bt = meta.block_tables
    if bt.dtype != torch.int32 or bt.stride(-1) != 1:
        bt = bt.to(torch.int32).contiguous()
    out, _lse = _fa4_varlen()(
        query,
        kv_cache[0],
        kv_cache[1],
        cu_seqlens_q=meta.query_start_loc,
        seqused_k=meta.seq_lens,
        page_table=bt,
        max_seqlen_q=meta.max_query_len,
        max_seqlen_k=meta.max_seq_len,
        softmax_scale=scale,
        causal=True,
    )
    return out  # type: ignore[no-any-return]


def check_flash_attn_usable(device: str) -> None:
    """Raise ValueError (what to do instead) when ``--attention-backend flash_attn``
    cannot run here: not CUDA, package missing or broken, GPU older than sm80."""
    if not device.startswith("cuda"):
        raise ValueError(
            f"attention_backend 'flash_attn' needs device 'cuda' (got {device!r}); "
            "use 'auto' or 'torch_ref'"
        )
    if not fa4_available():
        raise ValueError(
            f"attention_backend 'flash_attn' needs the {PACKAGE} package: "
            "pip install 'pdserve[flash-attn]' (or use attention_backend 'auto' / 'triton')"
        )
    major, minor = torch.cuda.get_device_capability(torch.device(device))
    if major < 8:
        raise ValueError(
            f"attention_backend 'flash_attn' needs compute capability >= 8.0 "
            f"(this GPU is {major}.{minor}); use 'triton'"
        )


class FlashAttention(AttentionBackend):
    """FA4 or Triton per step (see the module docstring); K/V writes are ours."""

    accepts_prewritten_kv = True
    # Decode steps only touch Triton here, so they can be captured (engine/executor/cuda_graphs.py).
    captures_decode = True

    def __init__(self, policy: str = "flash_attn", triton: TritonAttention | None = None) -> None:
        """``policy``: "flash_attn" (FA4 for every multi-token step) or "auto" (the table).
        ``triton``: the Triton backend used for the other steps (its fp8 scales apply)."""
        if policy not in ("flash_attn", "auto"):
            raise ValueError(f"policy must be 'flash_attn' or 'auto', got {policy!r}")
        self.policy = policy
        self.name = "flash_attn" if policy == "flash_attn" else "auto(triton+flash_attn)"
        self.triton = triton or TritonAttention()

    def use_fa4(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> bool:
        """The per-step choice; raises for the explicit policy on a dtype FA4 lacks."""
        shape = step_shape(meta)
        if shape == "decode" or query.device.type != "cuda":
            return False
        hd = query.shape[-1]
        if hd & (hd - 1):
            return False  # FA4's tiles want a power-of-two head_dim; Triton pads (Phi-3-mini)
        if kv_cache.dtype != query.dtype or torch.cuda.is_current_stream_capturing():
            return False  # fp8 cache / a graph being recorded: Triton (module docstring)
        if query.dtype not in _FA4_DTYPES:
            if self.policy == "flash_attn":
                raise ValueError(
                    f"attention_backend 'flash_attn' needs bfloat16 or float16 (got "
                    f"{query.dtype}); set dtype=bfloat16 or use attention_backend 'triton'"
                )
            return False
        return self.policy == "flash_attn" or table_winner(shape) == "flash_attn"

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
        # Windowed and soft-capped layers always run on Triton (FA4 is called without them).
        if window or softcap or sinks is not None or not self.use_fa4(query, kv_cache, meta):
            return self.triton.forward(
                query,
                key,
                value,
                kv_cache,
                meta,
                scale,
                window=window,
                softcap=softcap,
                sinks=sinks,
            )
        validate_inputs(query, key, kv_cache)
        write_kv_cache(key, value, kv_cache, meta.slot_mapping)
        return flash_attn_paged(query, kv_cache, meta, scale)

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
        if window or softcap or sinks is not None or not self.use_fa4(query, kv_cache, meta):
            return self.triton.forward_prewritten(
                query, kv_cache, meta, scale, window=window, softcap=softcap, sinks=sinks
            )
        validate_prewritten(query, kv_cache)
        return flash_attn_paged(query, kv_cache, meta, scale)
