"""Reference paged attention in plain torch (CPU and GPU): the correctness oracle.

Decode rows (one query per request) are batched into one padded SDPA call; prefill and
chunked-prefill requests are handled one by one with a causal mask offset by their context.
On the CPU in float32 or bfloat16, decode rows go to the C kernel of ``cpu_kernels``
instead (it reads the paged blocks in place rather than gathering them into a copy),
unless it is switched off (``PDSERVE_CPU_KERNELS=0``) or cannot be built.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.attention.base import AttentionBackend, AttentionMetadata
from engine.attention.cpu_kernels import (
    KERNEL_DTYPES,
    DecodeKernel,
    kernels_enabled,
    load_decode_kernel,
)
from engine.attention.kv_quant import DEFAULT_SCALE, byte_view, dequantize, quantize


def write_kv(
    kv_cache: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    slots: torch.Tensor,
    k_scale: float = DEFAULT_SCALE,
    v_scale: float = DEFAULT_SCALE,
) -> None:
    """Scatter new K/V rows into the paged cache ``[2, blocks, block, heads, dim]``,
    quantized for an fp8 cache (``kv_quant.quantize`` with ``k_scale``/``v_scale``)."""
    _, num_blocks, block_size, heads, dim = kv_cache.shape
    # As bytes for fp8: torch's CPU build has no float8 index_copy_.
    flat = byte_view(kv_cache).view(2, num_blocks * block_size, heads, dim)
    valid = slots >= 0
    if not bool(valid.all()):
        slots, key, value = slots[valid], key[valid], value[valid]
    flat[0].index_copy_(0, slots, byte_view(quantize(key, kv_cache.dtype, k_scale)))
    flat[1].index_copy_(0, slots, byte_view(quantize(value, kv_cache.dtype, v_scale)))


def gather_context(
    kv_cache: torch.Tensor, block_table: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of one request's first ``length`` tokens: ``[length, heads, dim]`` each."""
    block_size = kv_cache.shape[2]
    n_blocks = -(-length // block_size)
    # index_select copies whole blocks; advanced indexing (kv_cache[:, table]) copies
    # element by element on the CPU and was ~20x slower here.
    blocks = kv_cache.index_select(1, block_table[:n_blocks])  # [2, n, block, heads, dim]
    flat = blocks.view(2, n_blocks * block_size, *kv_cache.shape[3:])
    return flat[0, :length], flat[1, :length]


class TorchRefAttention(AttentionBackend):
    name = "torch_ref"

    def __init__(
        self,
        cpu_kernels: bool | None = None,
        k_scale: float = DEFAULT_SCALE,
        v_scale: float = DEFAULT_SCALE,
        batch_invariant: bool = False,
    ) -> None:
        """``batch_invariant`` (deterministic mode, docs/design.md §3): every request's rows
        are attended alone, decodes too (a padded decode batch, or the C kernel's
        threading, would make a row's bits depend on the other requests). ``cpu_kernels``: use the C decode kernel where it applies (None: unless
        ``PDSERVE_CPU_KERNELS=0``). Public so a benchmark can flip it on a live engine.
        ``k_scale``/``v_scale``: an fp8 cache's per-tensor scales (engine/attention/kv_quant.py;
        unused for a model-dtype cache). An fp8 cache never takes the C kernel (it reads
        float32/bf16 blocks only): its decode rows run the torch path."""
        self.cpu_kernels = kernels_enabled() if cpu_kernels is None else cpu_kernels
        self.k_scale, self.v_scale = k_scale, v_scale
        self.batch_invariant = batch_invariant

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
        write_kv(kv_cache, key, value, meta.slot_mapping, self.k_scale, self.v_scale)
        opts = _Opts(window, softcap, sinks)
        starts = meta.query_start_loc_cpu
        decode_reqs: list[int] = []
        prefill_reqs: list[int] = []
        for i in range(meta.num_reqs):
            one_row = starts[i + 1] - starts[i] == 1 and not self.batch_invariant
            (decode_reqs if one_row else prefill_reqs).append(i)
        # The C kernel attends over whole contexts with a plain softmax: windowed, capped
        # and sink layers take torch.
        plain = not (window or softcap or sinks is not None)
        kernel = self._kernel(query, kv_cache, meta) if decode_reqs and plain else None
        if not prefill_reqs:
            if kernel is not None:
                out = torch.empty_like(query)
                return kernel(query, kv_cache, meta.block_tables, meta.seq_lens, scale, out)
            # Pure decode step: query row i is request i, so no gather/scatter of rows (on a
            # busy CPU every extra op costs a thread-pool round trip).
            return self._decode_batch(query, kv_cache, meta, scale, None, opts)
        out = torch.empty_like(query)
        if kernel is not None:
            # The kernel writes the decode rows of ``out`` in place; prefill rows follow.
            reqs = torch.tensor(decode_reqs, dtype=torch.int64)
            rows = torch.tensor([starts[i] for i in decode_reqs], dtype=torch.int64)
            kernel(query, kv_cache, meta.block_tables, meta.seq_lens, scale, out, reqs, rows)
        elif decode_reqs:
            rows = torch.tensor([starts[i] for i in decode_reqs], device=query.device)
            o = self._decode_batch(
                query.index_select(0, rows), kv_cache, meta, scale, decode_reqs, opts
            )
            out.index_copy_(0, rows, o)
        for i in prefill_reqs:
            q0, q1 = starts[i], starts[i + 1]
            seq_len = meta.seq_lens_cpu[i]
            if seq_len == q1 - q0:
                # No cached context: the new rows are the whole context (same values the
                # cache now holds), so skip reading them back.
                k = quantize(key[q0:q1], kv_cache.dtype, self.k_scale)
                v = quantize(value[q0:q1], kv_cache.dtype, self.v_scale)
            else:
                k, v = gather_context(kv_cache, meta.block_tables[i], seq_len)
            k = dequantize(k, query.dtype, self.k_scale)
            v = dequantize(v, query.dtype, self.v_scale)
            out[q0:q1] = _sdpa(query[q0:q1], k, v, scale, seq_len - (q1 - q0), opts)
        return out

    def _kernel(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> DecodeKernel | None:
        """The C decode kernel when it is on, built, and every tensor fits it."""
        if not (
            self.cpu_kernels
            and query.device.type == "cpu"
            and query.dtype in KERNEL_DTYPES  # float32 or bf16 (docs/design.md §3)
            and kv_cache.dtype == query.dtype
            and query.is_contiguous()
            and kv_cache.is_contiguous()
            and meta.block_tables.device.type == "cpu"
            and meta.block_tables.dtype == torch.int32
            and meta.block_tables.is_contiguous()
            and meta.seq_lens.device.type == "cpu"
            and meta.seq_lens.dtype == torch.int32
            and meta.seq_lens.is_contiguous()
        ):
            return None
        return load_decode_kernel()

    def _decode_batch(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        reqs: list[int] | None,
        opts: _Opts | None = None,
    ) -> torch.Tensor:
        """Attention for one query row per request: ``query`` [B, Hq, D] holds the rows of
        requests ``reqs`` (None = every request, in order); returns [B, Hq, D]."""
        block_size = kv_cache.shape[2]
        lens = meta.seq_lens_cpu if reqs is None else [meta.seq_lens_cpu[i] for i in reqs]
        n_blocks = -(-max(lens) // block_size)
        tables = meta.block_tables if reqs is None else meta.block_tables[reqs]
        tables = tables[:, :n_blocks]  # [B, n]
        batch, kv_heads, dim = len(lens), kv_cache.shape[3], kv_cache.shape[4]
        ctx = kv_cache.index_select(1, tables.reshape(-1))  # [2, B*n, block, heads, dim]
        ctx = ctx.view(2, batch, n_blocks * block_size, kv_heads, dim).transpose(2, 3)
        k = dequantize(ctx[0], query.dtype, self.k_scale)  # [B, kv_heads, L, dim]
        v = dequantize(ctx[1], query.dtype, self.v_scale)
        # Grouped-query attention without repeating K/V: the query heads that share a KV
        # head become rows of one query block ([B, kv_heads, groups, dim]).
        groups = query.shape[1] // kv_heads
        q = query.reshape(batch, kv_heads, groups, dim)
        positions = torch.arange(n_blocks * block_size, device=query.device)
        ends = torch.tensor(lens, device=query.device)[:, None]
        mask = positions[None, :] < ends
        opts = opts or _Opts()
        if opts.window:
            mask &= positions[None, :] > ends - 1 - opts.window
        sinks = None if opts.sinks is None else opts.sinks.view(1, kv_heads, groups, 1)
        o = _attend(q, k, v, mask[:, None, None, :], scale, opts.softcap, sinks)
        return o.reshape(batch, kv_heads * groups, dim)


@dataclass(frozen=True, slots=True)
class _Opts:
    """A layer's sliding window (0 = none), score soft-cap (0 = none) and per-head
    attention sinks (None = none)."""

    window: int = 0
    softcap: float = 0.0
    sinks: torch.Tensor | None = None

    @property
    def plain(self) -> bool:
        return not (self.window or self.softcap or self.sinks is not None)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    softcap: float,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA over ``[..., L, D]`` tensors with a boolean ``mask``; with a soft-cap the
    scores are capped before the softmax (float32 softmax, as transformers' eager path).
    ``sinks`` (broadcast to ``[..., Lq, 1]``): one more logit per row in the softmax,
    dropped after it (gpt-oss; transformers' eager path concatenates it the same way)."""
    if not softcap and sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is None:
        p = torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype)
    else:
        sink = sinks.to(s.dtype).expand(*s.shape[:-1], 1)
        p = torch.softmax(torch.cat((s, sink), dim=-1), dim=-1, dtype=torch.float32)
        p = p[..., :-1].to(q.dtype)
    return torch.matmul(p, v)


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    causal_offset: int,
    opts: _Opts | None = None,
) -> torch.Tensor:
    """Attention of ``q`` [Lq, Hq, D] over ``k``/``v`` [Lk, Hkv, D]; query j sees keys <= offset + j
    (and, with a window, keys > offset + j - window)."""
    lq, lk = q.shape[0], k.shape[0]
    # 4-D inputs with enable_gqa: on the CPU this reaches the fused (flash) kernel and never
    # repeats K/V per query head; 3-D inputs fell back to the unfused math path, ~5-10x slower.
    qt = q.transpose(0, 1).unsqueeze(0)
    kt = k.transpose(0, 1).unsqueeze(0).to(q.dtype)
    vt = v.transpose(0, 1).unsqueeze(0).to(q.dtype)
    gqa = q.shape[1] != k.shape[1]
    if opts is not None and not opts.plain:
        qpos = torch.arange(lq, device=q.device)[:, None] + causal_offset
        kpos = torch.arange(lk, device=q.device)[None, :]
        mask = kpos <= qpos
        if opts.window:
            mask &= kpos > qpos - opts.window
        if gqa:
            rep = q.shape[1] // k.shape[1]
            kt, vt = kt.repeat_interleave(rep, dim=1), vt.repeat_interleave(rep, dim=1)
        sinks = None if opts.sinks is None else opts.sinks.view(1, -1, 1, 1)
        o = _attend(qt, kt, vt, mask, scale, opts.softcap, sinks)
        return o.squeeze(0).transpose(0, 1)
    if causal_offset == 0 and lq == lk:
        o = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        mask = torch.arange(lk, device=q.device)[None, :] <= (
            torch.arange(lq, device=q.device)[:, None] + causal_offset
        )
        o = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return o.squeeze(0).transpose(0, 1)
