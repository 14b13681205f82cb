"""Paged decode-attention cases for the C kernel's tests: a cache with each request's K/V
scattered over shuffled blocks, a float64 dense reference, and the step metadata."""

from __future__ import annotations

import torch

from engine.attention.base import AttentionMetadata


def paged_case(
    seq_lens: list[int], q_heads: int, kv_heads: int, dim: int, block: int, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """A cache with each request's K/V scattered over shuffled blocks (spare blocks hold
    noise, so reading a wrong block shows). Returns query [B, Hq, D], cache, block tables
    (padded with 0 past each request's blocks) and each request's dense K and V."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-n // block) for n in seq_lens]
    num_blocks = sum(need) + 5
    cache = torch.randn(2, num_blocks, block, kv_heads, dim, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(need) + 2
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    ks, vs = [], []
    for i, n in enumerate(seq_lens):
        ids = [perm.pop() for _ in range(need[i])]
        tables[i, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k = torch.randn(n, kv_heads, dim, generator=gen)
        v = torch.randn(n, kv_heads, dim, generator=gen)
        for p in range(n):
            cache[0, ids[p // block], p % block] = k[p]
            cache[1, ids[p // block], p % block] = v[p]
        ks.append(k)
        vs.append(v)
    query = torch.randn(len(seq_lens), q_heads, dim, generator=gen)
    return query, cache, tables, ks, vs


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """One query row [Hq, D] over dense k/v [L, Hkv, D], in float64."""
    groups = q.shape[0] // k.shape[1]
    kk = k.double().repeat_interleave(groups, dim=1).transpose(0, 1)  # [Hq, L, D]
    vv = v.double().repeat_interleave(groups, dim=1).transpose(0, 1)
    scores = torch.einsum("hd,hld->hl", q.double(), kk) * scale
    return torch.einsum("hl,hld->hd", scores.softmax(-1), vv).float()


def attention_meta(seq_lens: list[int], tables: torch.Tensor, new: list[int]) -> AttentionMetadata:
    starts = [0]
    for n in new:
        starts.append(starts[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.full((starts[-1],), -1, dtype=torch.long),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        max_query_len=max(new),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )
