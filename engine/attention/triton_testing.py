"""Random paged-attention problems and a float64 reference, for kernel tests and benchmarks.

``make_case`` builds one flattened batch the way the model runner does: each request has
``cached`` tokens already in the paged cache (a prefix hit or earlier chunks) and
``q_len`` new tokens whose K/V the backend must write. Physical blocks are shuffled so no
request's blocks are contiguous, and every unused cache slot holds NaN: a kernel that reads
outside a request's context, or a write that misses, turns the result into NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.base import AttentionMetadata


@dataclass(slots=True)
class PagedCase:
    query: torch.Tensor  # [tokens, heads, head_dim]
    key: torch.Tensor  # [tokens, kv_heads, head_dim] (the new tokens only)
    value: torch.Tensor
    kv_cache: torch.Tensor  # [2, num_blocks, block_size, kv_heads, head_dim]
    meta: AttentionMetadata
    scale: float
    full_k: list[torch.Tensor]  # per request, [seq_len, kv_heads, head_dim], ground truth
    full_v: list[torch.Tensor]


def make_case(
    q_lens: list[int],
    cached: list[int],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    seed: int,
    pad_tokens: int = 0,
    num_blocks: int | None = None,
) -> PagedCase:
    """One batch; ``pad_tokens`` extra query rows belong to no request (slot -1).

    ``num_blocks`` sizes the cache (default: what the batch needs + 3 spare blocks).
    """
    if len(q_lens) != len(cached):
        raise ValueError("q_lens and cached must have one entry per request")
    gen = torch.Generator().manual_seed(seed)
    # Big tensors are drawn on the target device (CPU generation dominates GPU test time).
    dgen = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=dgen, device=device).to(dtype)

    seq_lens = [c + q for c, q in zip(cached, q_lens, strict=True)]
    blocks_per = [-(-s // block_size) for s in seq_lens]
    need = sum(blocks_per)
    if num_blocks is None:
        num_blocks = need + 3  # spare blocks stay NaN
    elif num_blocks < need:
        raise ValueError(f"num_blocks {num_blocks} < {need} needed by the batch")
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per) + 1  # one padding column, like a real block table
    table = torch.zeros((len(q_lens), width), dtype=torch.int32)
    shape = (2, num_blocks, block_size, num_kv_heads, head_dim)
    cache = torch.full(shape, float("nan"), dtype=dtype, device=device)
    full_k: list[torch.Tensor] = []
    full_v: list[torch.Tensor] = []
    new_k: list[torch.Tensor] = []
    new_v: list[torch.Tensor] = []
    slots: list[torch.Tensor] = []
    for r, (c, s) in enumerate(zip(cached, seq_lens, strict=True)):
        ids = [perm.pop() for _ in range(blocks_per[r])]
        table[r, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        k, v = randn(s, num_kv_heads, head_dim), randn(s, num_kv_heads, head_dim)
        full_k.append(k)
        full_v.append(v)
        pos = torch.arange(s, device=device)
        ids_t = torch.tensor(ids, dtype=torch.int64, device=device)
        slot = ids_t[pos // block_size] * block_size + pos % block_size
        cache[0].view(-1, num_kv_heads, head_dim)[slot[:c]] = k[:c]
        cache[1].view(-1, num_kv_heads, head_dim)[slot[:c]] = v[:c]
        slots.append(slot[c:])
        new_k.append(k[c:])
        new_v.append(v[c:])
    slots.append(torch.full((pad_tokens,), -1, dtype=torch.int64, device=device))
    new_k.append(randn(pad_tokens, num_kv_heads, head_dim))
    new_v.append(randn(pad_tokens, num_kv_heads, head_dim))
    query = randn(sum(q_lens) + pad_tokens, num_heads, head_dim)
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots).to(device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=table.to(device),
        max_query_len=max(q_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens,
    )
    return PagedCase(
        query=query,
        key=torch.cat(new_k),
        value=torch.cat(new_v),
        kv_cache=cache,
        meta=meta,
        scale=head_dim**-0.5,
        full_k=full_k,
        full_v=full_v,
    )


def reference_attention(case: PagedCase, device: torch.device | str = "cpu") -> torch.Tensor:
    """Float64 causal attention of each request over its ground-truth K/V, on ``device``."""
    q_all = case.query.detach().to(device).double()
    out = torch.zeros_like(q_all)
    qsl = case.meta.query_start_loc_cpu
    heads = q_all.shape[1]
    for r, (k, v) in enumerate(zip(case.full_k, case.full_v, strict=True)):
        q = q_all[qsl[r] : qsl[r + 1]]
        q_len, seq_len = q.shape[0], k.shape[0]
        group = heads // k.shape[1]
        kk = k.to(device).double().repeat_interleave(group, dim=1)  # [seq, heads, dim]
        vv = v.to(device).double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, kk) * case.scale
        pos = torch.arange(seq_len - q_len, seq_len, device=device)[:, None]
        scores = scores.masked_fill(
            torch.arange(seq_len, device=device)[None, :] > pos, float("-inf")
        )
        out[qsl[r] : qsl[r + 1]] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), vv)
    return out


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ in float64 (NaN anywhere gives NaN)."""
    diff = out.detach().to(ref.device).double() - ref
    return float(diff.norm() / ref.norm())


def cache_error(case: PagedCase) -> float:
    """Largest |cache − truth| over every token of every request (after the backend wrote)."""
    cache = case.kv_cache.detach()
    bs, kvh, hd = cache.shape[2], cache.shape[3], cache.shape[4]
    table = case.meta.block_tables
    worst = 0.0
    for r, (k, v) in enumerate(zip(case.full_k, case.full_v, strict=True)):
        pos = torch.arange(k.shape[0], device=cache.device)
        slots = table[r, pos // bs].long() * bs + pos % bs
        got_k = cache[0].reshape(-1, kvh, hd)[slots].double()
        got_v = cache[1].reshape(-1, kvh, hd)[slots].double()
        err_k = float((got_k - k.to(cache.device).double()).abs().max())
        err_v = float((got_v - v.to(cache.device).double()).abs().max())
        for err in (err_k, err_v):
            if err != err:
                return err
            worst = max(worst, err)
    return worst
