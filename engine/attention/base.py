"""Attention-backend interface over the paged KV cache.

A backend gets one flattened batch ("super sequence") of new tokens from several requests.
It writes each new token's K/V into the cache at ``slot_mapping`` and attends every query to
its own request's context (cached tokens + new tokens up to itself, causal). A backend with
``accepts_prewritten_kv`` also attends over a cache the model has already written (the
fused RoPE + KV-store kernel, engine/models/triton_ops.py), skipping its own write.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step layout of the flattened batch. All tensors live on the model's device.

    Request ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``; its context
    (after this step's writes) is ``seq_lens[i]`` tokens long, stored in the blocks listed in
    ``block_tables[i]`` (padded with 0). Its queries are the last ``query_len`` positions of
    that context, so query row j of request i sits at position ``seq_lens[i] - query_len + j``.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64, -1 = do not write
    query_start_loc: torch.Tensor  # [num_reqs + 1] int32
    seq_lens: torch.Tensor  # [num_reqs] int32
    block_tables: torch.Tensor  # [num_reqs, max_blocks_per_req] int32
    max_query_len: int
    max_seq_len: int
    # Host copies, so CPU backends need no device->host sync.
    query_start_loc_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens_cpu)


class AttentionBackend(abc.ABC):
    """Computes paged attention for one layer."""

    name: str = "base"
    # Whether ``forward_prewritten`` is implemented (the caller then stores K/V itself).
    accepts_prewritten_kv: bool = False
    # Whether a pure-decode step through it reads only device tensors plus the fixed host
    # integers, so it can be captured in a CUDA graph (engine/executor/cuda_graphs.py's contract).
    captures_decode: bool = False
    # Whether any step through it (prefill chunks included) reads the lengths only as device
    # data and takes its grid from the token and request counts alone, so one graph per
    # padded token count serves every mix of lengths (engine/executor/mixed_graphs.py).
    captures_mixed: bool = False

    @abc.abstractmethod
    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        *,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write ``key``/``value`` into ``kv_cache`` and return ``[num_tokens, num_heads, head_dim]``.

        ``window`` > 0: sliding-window attention, a query at position p sees the keys at
        (p - window, p] only. ``softcap`` > 0: scores become ``softcap * tanh(s / softcap)``
        before the softmax (Gemma 2). ``sinks`` ``[num_heads]`` (gpt-oss): one more logit
        per head in the softmax's denominator, a key with no value (the weights of the real
        keys sum to less than one). docs/design.md §3 "Sliding windows", "Attention sinks"."""

    def forward_prewritten(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        *,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``forward`` for a cache that already holds this step's K/V at ``slot_mapping``."""
        raise NotImplementedError(f"attention backend {self.name!r} writes its own KV")
