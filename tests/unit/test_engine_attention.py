"""torch_ref paged attention against a dense, loop-per-head reference on scattered blocks."""

from __future__ import annotations

import math

import pytest
import torch

from engine.attention.base import AttentionMetadata
from engine.attention.torch_ref import TorchRefAttention

BLOCK, KV_HEADS, DIM = 4, 2, 8


def _dense(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int) -> torch.Tensor:
    """softmax(q k^T) v per query head, query j sees keys <= offset + j (GQA by h // groups)."""
    groups = q.shape[1] // k.shape[1]
    out = torch.empty_like(q)
    for h in range(q.shape[1]):
        kh, vh = k[:, h // groups].double(), v[:, h // groups].double()
        scores = q[:, h].double() @ kh.T / math.sqrt(q.shape[2])
        for j in range(q.shape[0]):
            scores[j, offset + j + 1 :] = float("-inf")
        out[:, h] = (scores.softmax(-1) @ vh).to(q.dtype)
    return out


MIXED = [(0, 7), (13, 1), (6, 5), (3, 1)]  # fresh prefill, decode, chunk over context, decode
DECODES = [(13, 1), (0, 1), (4, 1)]  # a pure decode step (the no-gather fast path)


@pytest.mark.parametrize("shapes", [MIXED, DECODES], ids=["mixed", "decode_only"])
@pytest.mark.parametrize("q_heads", [2, 4])
def test_batch_matches_dense_reference(q_heads: int, shapes: list[tuple[int, int]]) -> None:
    """Requests of one step, each (cached context tokens, new tokens), with their blocks
    scattered and shuffled through the pool."""
    gen = torch.Generator().manual_seed(0)
    num_blocks = 24
    cache = torch.zeros(2, num_blocks, BLOCK, KV_HEADS, DIM)
    perm = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    tables, full_k, full_v = [], [], []
    for ctx, new in shapes:
        n_blocks = -(-(ctx + new) // BLOCK)
        tables.append([perm.pop() for _ in range(n_blocks)])
        full_k.append(torch.randn(ctx + new, KV_HEADS, DIM, generator=gen))
        full_v.append(torch.randn(ctx + new, KV_HEADS, DIM, generator=gen))
    # Pre-fill the cached context directly into the cache.
    for (ctx, _), table, k, v in zip(shapes, tables, full_k, full_v, strict=True):
        for p in range(ctx):
            cache[0, table[p // BLOCK], p % BLOCK] = k[p]
            cache[1, table[p // BLOCK], p % BLOCK] = v[p]
    queries = [torch.randn(new, q_heads, DIM, generator=gen) for _, new in shapes]
    slots, starts = [], [0]
    for (ctx, new), table in zip(shapes, tables, strict=True):
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(ctx, ctx + new)]
        starts.append(starts[-1] + new)
    width = max(len(t) for t in tables)
    block_tables = torch.zeros(len(shapes), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        block_tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    seq_lens = [c + n for c, n in shapes]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start_loc=torch.tensor(starts, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=block_tables,
        max_query_len=max(n for _, n in shapes),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=starts,
        seq_lens_cpu=seq_lens,
    )
    new_k = torch.cat([k[c:] for (c, _), k in zip(shapes, full_k, strict=True)])
    new_v = torch.cat([v[c:] for (c, _), v in zip(shapes, full_v, strict=True)])
    out = TorchRefAttention().forward(
        torch.cat(queries), new_k, new_v, cache, meta, scale=DIM**-0.5
    )
    for i, ((ctx, _), k, v) in enumerate(zip(shapes, full_k, full_v, strict=True)):
        expect = _dense(queries[i], k, v, offset=ctx)
        torch.testing.assert_close(out[starts[i] : starts[i + 1]], expect, rtol=1e-5, atol=1e-5)
    # Every new token's K/V landed in its slot.
    flat = cache.view(2, -1, KV_HEADS, DIM)
    torch.testing.assert_close(flat[0, torch.tensor(slots)], new_k)
    torch.testing.assert_close(flat[1, torch.tensor(slots)], new_v)
