"""Multi-head latent attention (DeepSeek-V2/V3) over the paged latent cache.

Per token a layer caches one row of ``kv_lora_rank + qk_rope_head_dim`` values: the
normed latent ``c`` (from ``kv_a_proj_with_mqa``) and the rotated rope key ``k_pe`` shared
by every head. The layer's cache is ``[1, blocks, block_size, 1, latent_dim]``: one plane
and one "head" (docs/design.md §3 "MLA latent cache"). Head ``h``'s key is
``[W_UK[h] c | k_pe]`` and its value ``W_UV[h] c``, with ``W_UK``/``W_UV`` the two halves of
``kv_b_proj``.

Two ways to attend, equal in exact arithmetic:

* expanded (a prefill chunk): the context's latents are up-projected to per-head keys and
  values once, then ordinary attention; cheaper when many queries share the context.
* absorbed (decode rows): ``W_UK`` is folded into the query (``q_nope W_UK[h]``, a
  ``kv_lora_rank`` vector per head) and ``W_UV`` applied after the weighted sum of the
  latents, so the step reads the cached latents as they are (one shared "head" of
  ``latent_dim``) and never expands the context: per decode token it costs
  ``heads * latent_dim`` multiply-adds per context token instead of up-projecting every
  context token through ``kv_b_proj``.

Pure decode steps take one padded batch that reads only device tensors (the block
tables and sequence lengths), so a CUDA graph can capture it; mixed steps go request by
request with the host copies of the metadata.

The rope is DeepSeek's interleaved-pair rotation; the checkpoint's rope rows are permuted
at load (engine/models/deepseek_weights.py) so the engine's "rotate half" rope applies.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.attention.base import AttentionMetadata
from engine.distributed.tp_group import TPGroup
from engine.models.deepseek_args import MLAArgs
from engine.models.layer_ops import LayerOps
from engine.models.parallel import Shard
from engine.models.rope import RotaryEmbedding

# Masked scores: finite, so a padded row of a captured batch (no context) stays finite.
_MASKED = -1e30
# DeepSeek's q_a/kv_a norms use their class default, not the config's rms_norm_eps.
_LATENT_NORM_EPS = 1e-6


class _Norm(nn.Module):
    def __init__(self, dim: int, ops: LayerOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ops.rms_norm(x, self.weight, _LATENT_NORM_EPS)


class MLAttention(nn.Module):
    """One layer's MLA (parameter names as the checkpoint's, ``self_attn.*``)."""

    def __init__(self, shard: Shard, rope: RotaryEmbedding, tp: TPGroup) -> None:
        super().__init__()
        args = shard.args
        assert args.mla is not None
        m: MLAArgs = args.mla
        self.m = m
        self.num_heads = shard.num_heads
        hidden, heads, bias = args.hidden_size, self.num_heads, args.qkv_bias
        ops = rope.ops
        self.ops = ops
        self.q_proj: nn.Linear | None = None
        self.q_a_proj: nn.Linear | None = None
        self.q_a_layernorm: _Norm | None = None
        self.q_b_proj: nn.Linear | None = None
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, heads * m.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, m.q_lora_rank, bias=bias)
            self.q_a_layernorm = _Norm(m.q_lora_rank, ops)
            self.q_b_proj = nn.Linear(m.q_lora_rank, heads * m.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, m.latent_dim, bias=bias)
        self.kv_a_layernorm = _Norm(m.kv_lora_rank, ops)
        self.kv_b_proj = nn.Linear(
            m.kv_lora_rank, heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(heads * m.v_head_dim, hidden, bias=bias)
        self.rope = rope
        self.tp = tp
        self.lora = None  # LoRA is refused for MLA models (engine/models/support.py)

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_proj is not None:
            q = self.ops.linear(x, self.q_proj.weight, None)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None
            assert self.q_b_proj is not None
            qa = self.ops.linear(x, self.q_a_proj.weight, self.q_a_proj.bias)
            q = self.ops.linear(self.q_a_layernorm(qa), self.q_b_proj.weight, None)
        return q.view(-1, self.num_heads, self.m.qk_head_dim)

    def _up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK [heads, nope, rank]`` and ``W_UV [heads, v, rank]`` (views of kv_b)."""
        m = self.m
        w = self.kv_b_proj.weight.view(self.num_heads, m.qk_nope_head_dim + m.v_head_dim, -1)
        return w[:, : m.qk_nope_head_dim], w[:, m.qk_nope_head_dim :]

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        m = self.m
        q = self._query(x)
        q_nope, q_pe = q.split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        kv = self.ops.linear(x, self.kv_a_proj_with_mqa.weight, self.kv_a_proj_with_mqa.bias)
        c, k_pe = kv.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        q_pe, k_pe = self.rope(positions, q_pe, k_pe.unsqueeze(1))
        latent = torch.cat((self.kv_a_layernorm(c), k_pe.squeeze(1)), dim=-1)
        store_latent(kv_cache, latent, meta.slot_mapping)
        if meta.max_query_len == 1:
            out = self._decode_batch(q_nope, q_pe, kv_cache, meta)
        else:
            out = self._per_request(q_nope, q_pe, kv_cache, meta)
        attn = out.reshape(-1, self.num_heads * m.v_head_dim)
        res = self.ops.linear(attn, self.o_proj.weight, self.o_proj.bias)
        return self.tp.all_reduce(res) if self.tp.size > 1 else res

    def _absorb(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """``[rows, heads, latent_dim]``: each head's query in the latent's coordinates."""
        w_uk, _ = self._up_weights()
        q_lat = torch.einsum("thn,hnr->thr", q_nope, w_uk)
        return torch.cat((q_lat, q_pe), dim=-1)

    def _from_latent(self, o_lat: torch.Tensor) -> torch.Tensor:
        """Per-head values ``[rows, heads, v]`` from weighted latents ``[rows, heads, rank]``."""
        _, w_uv = self._up_weights()
        return torch.einsum("thr,hvr->thv", o_lat, w_uv)

    def _decode_batch(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """One query per request, row i = request i: absorbed attention over each request's
        blocks gathered to the table's width, positions past its length masked. Only
        device tensors are read (capturable)."""
        m = self.m
        table = meta.block_tables.long()
        rows, width = table.shape
        block_size = kv_cache.shape[2]
        ctx = kv_cache[0].index_select(0, table.reshape(-1))  # [rows*width, bs, 1, D]
        ctx = ctx.view(rows, width * block_size, m.latent_dim)
        q = self._absorb(q_nope[:rows], q_pe[:rows])
        scores = torch.einsum("bhd,bsd->bhs", q, ctx).float() * m.softmax_scale
        pos = torch.arange(width * block_size, device=ctx.device)
        live = pos[None, :] < meta.seq_lens.long()[:, None]
        scores = scores.masked_fill(~live[:, None, :], _MASKED)
        probs = torch.softmax(scores, dim=-1).to(ctx.dtype)
        o_lat = torch.einsum("bhs,bsr->bhr", probs, ctx[..., : m.kv_lora_rank])
        return self._from_latent(o_lat)

    def _per_request(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Mixed steps: each request over its own context, causal within its new rows."""
        m = self.m
        out = q_nope.new_empty(q_nope.shape[0], self.num_heads, m.v_head_dim)
        starts = meta.query_start_loc_cpu
        for i, length in enumerate(meta.seq_lens_cpu):
            lo, hi = starts[i], starts[i + 1]
            if hi == lo:
                continue
            ctx = gather_latent(kv_cache, meta.block_tables[i], length)
            if hi - lo == 1:
                q = self._absorb(q_nope[lo:hi], q_pe[lo:hi])
                scores = torch.einsum("thd,sd->ths", q, ctx).float() * m.softmax_scale
                probs = torch.softmax(scores, dim=-1).to(ctx.dtype)
                o_lat = torch.einsum("ths,sr->thr", probs, ctx[:, : m.kv_lora_rank])
                out[lo:hi] = self._from_latent(o_lat)
            else:
                out[lo:hi] = self._expanded(q_nope[lo:hi], q_pe[lo:hi], ctx)
        return out

    def _expanded(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, ctx: torch.Tensor
    ) -> torch.Tensor:
        """Ordinary attention of ``n`` new rows (the context's last ``n`` positions) with
        keys and values up-projected from the context's latents."""
        m = self.m
        length, n = ctx.shape[0], q_nope.shape[0]
        kv = self.ops.linear(ctx[:, : m.kv_lora_rank], self.kv_b_proj.weight, None)
        kv = kv.view(length, self.num_heads, m.qk_nope_head_dim + m.v_head_dim)
        k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        k_pe = ctx[:, m.kv_lora_rank :]
        scores = torch.einsum("thn,shn->hts", q_nope, k_nope)
        scores = scores + torch.einsum("thr,sr->hts", q_pe, k_pe)
        scores = scores.float() * m.softmax_scale
        rows = torch.arange(length - n, length, device=ctx.device)[:, None]
        cols = torch.arange(length, device=ctx.device)[None, :]
        scores = scores.masked_fill(cols > rows, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(ctx.dtype)
        return torch.einsum("hts,shv->thv", probs, v)


def gather_latent(kv_cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """One request's first ``length`` cached latents ``[length, latent_dim]``."""
    block_size = kv_cache.shape[2]
    n_blocks = -(-length // block_size)
    blocks = kv_cache[0].index_select(0, block_table[:n_blocks].long())
    return blocks.view(n_blocks * block_size, kv_cache.shape[-1])[:length]


def store_latent(kv_cache: torch.Tensor, latent: torch.Tensor, slots: torch.Tensor) -> None:
    """Write each token's latent row at its slot of the layer's cache
    ``[1, blocks, block_size, 1, latent_dim]`` (slot < 0: not written). On CUDA one Triton
    launch that skips negative slots on the device (capturable); elsewhere torch."""
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 1 or kv_cache.shape[3] != 1:
        raise ValueError(f"not an MLA latent cache: {tuple(kv_cache.shape)}")
    if latent.is_cuda:
        from engine.models.triton_mla import store_latent_triton

        store_latent_triton(kv_cache, latent, slots)
        return
    flat = kv_cache.view(-1, kv_cache.shape[-1])
    valid = slots >= 0
    if not bool(valid.all()):
        slots, latent = slots[valid], latent[valid]
    flat.index_copy_(0, slots.long(), latent.to(flat.dtype))
