"""Megatron-style sharding of the Llama family over ``size`` tensor-parallel ranks.

* q|k|v and gate|up are column-parallel: rank ``r`` holds its slice of the output columns
  (its query heads, its KV heads, its share of the intermediate size), so attention and
  SiLU·mul run on local heads/columns with no communication.
* o and down are row-parallel: rank ``r`` holds the matching input rows; each produces a
  partial sum of the full hidden vector, and one all-reduce per projection adds them.
* MoE experts (engine/models/moe.py) shard the same way, each expert on its own: rank
  ``r`` holds columns ``[r * I / size, (r + 1) * I / size)`` of every expert's gate|up and
  the matching rows of its down projection; the router is replicated, and the expert
  outputs' partial sums join the same single all-reduce.
* The embedding and the LM head are vocab-parallel: rank ``r`` holds a contiguous slice of
  ``ceil(vocab / size)`` rows (the last slice zero-padded). The embedding zeroes tokens
  outside its slice and all-reduces; the LM head's logits are all-gathered and the padding
  cut off, so every rank ends with the full ``[rows, vocab]`` logits.

KV heads: with ``num_kv_heads >= size`` each rank holds ``num_kv_heads / size`` of them;
with fewer KV heads than ranks each KV head is replicated on ``size / num_kv_heads`` ranks
(each rank then holds exactly one, the one its query heads attend with). Either way every
rank's paged KV cache holds only its own KV heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed.tp_group import TPGroup
from engine.models.config import ModelArgs


def check_tensor_parallel(args: ModelArgs, size: int) -> None:
    """``ValueError`` (saying what divides what) when ``args`` cannot be split ``size`` ways."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    if size == 1:
        return
    problems = []
    if args.num_heads % size:
        problems.append(f"num_attention_heads {args.num_heads} is not divisible by it")
    kv = args.num_kv_heads
    if kv >= size and kv % size:
        problems.append(f"num_key_value_heads {kv} is not divisible by it")
    if kv < size and size % kv:
        problems.append(
            f"it is not a multiple of num_key_value_heads {kv} (KV heads are replicated "
            "only when the size is a multiple of their number)"
        )
    dense = not args.is_moe or bool(args.dense_layers)
    if dense and args.intermediate_size % size:
        problems.append(f"intermediate_size {args.intermediate_size} is not divisible by it")
    if args.is_moe and args.moe_intermediate_size % size:
        # Megatron-style expert sharding: each rank holds a slice of every expert.
        problems.append(
            f"moe_intermediate_size {args.moe_intermediate_size} is not divisible by it"
        )
    if problems:
        raise ValueError(
            f"tensor_parallel_size {size} does not fit this model: " + "; ".join(problems)
        )


@dataclass(frozen=True, slots=True)
class Shard:
    """What rank ``rank`` of ``size`` holds of a model with ``args`` (global sizes)."""

    args: ModelArgs
    rank: int = 0
    size: int = 1

    @property
    def num_heads(self) -> int:
        return self.args.num_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.args.num_kv_heads // self.size)

    @property
    def kv_head_start(self) -> int:
        kv = self.args.num_kv_heads
        if kv >= self.size:
            return self.rank * self.num_kv_heads
        return self.rank // (self.size // kv)  # replicated: the head of this rank's queries

    @property
    def intermediate_size(self) -> int:
        return self.args.intermediate_size // self.size

    @property
    def moe_intermediate_size(self) -> int:
        """Each expert's intermediate columns on this rank (every rank holds every expert)."""
        return self.args.moe_intermediate_size // self.size

    @property
    def vocab_per_rank(self) -> int:
        return -(-self.args.vocab_size // self.size)

    @property
    def vocab_range(self) -> tuple[int, int]:
        """The token ids ``[start, end)`` this rank holds (``end - start`` may be short of
        ``vocab_per_rank`` on the last rank: the rest is padding)."""
        start = min(self.rank * self.vocab_per_rank, self.args.vocab_size)
        return start, min(start + self.vocab_per_rank, self.args.vocab_size)

    def slice_checkpoint(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's part of the Hugging Face tensor ``name`` (the whole of a replicated one)."""
        if self.size == 1:
            return tensor
        hd = self.args.head_dim
        if ".q_proj." in name:
            return _rows(tensor, self.rank * self.num_heads * hd, self.num_heads * hd)
        if ".k_proj." in name or ".v_proj." in name:
            return _rows(tensor, self.kv_head_start * hd, self.num_kv_heads * hd)
        if ".gate_proj." in name or ".up_proj." in name:
            i = self.intermediate_size
            return _rows(tensor, self.rank * i, i)
        if name.endswith(".sinks"):
            return _rows(tensor, self.rank * self.num_heads, self.num_heads)
        if name.endswith((".o_proj.bias", ".mlp.w2_bias")):
            # Row-parallel outputs are summed over the ranks: their bias is added once.
            return tensor if self.rank == 0 else torch.zeros_like(tensor)
        if name.endswith((".mlp.w13", ".mlp.w13_bias")):  # stacked experts (gpt-oss)
            i, full = self.moe_intermediate_size, self.args.moe_intermediate_size
            lo = self.rank * i
            return torch.cat((tensor[:, lo : lo + i], tensor[:, full + lo : full + lo + i]), dim=1)
        if name.endswith(".mlp.w2"):
            i = self.moe_intermediate_size
            return tensor[..., self.rank * i : (self.rank + 1) * i]
        if name.endswith(".weight_scale"):
            # FP8 per-channel scales (engine/models/fp8.py) follow the output channels:
            # o/down keep all of theirs, a column-parallel projection its rows.
            return tensor
        if ".o_proj." in name:
            q = self.num_heads * hd
            return tensor[:, self.rank * q : (self.rank + 1) * q]
        if ".down_proj." in name:
            i = self.intermediate_size
            return tensor[:, self.rank * i : (self.rank + 1) * i]
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            start, end = self.vocab_range
            return tensor[start:end]
        return tensor


def _rows(tensor: torch.Tensor, start: int, count: int) -> torch.Tensor:
    return tensor[start : start + count]


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` whose rows are this rank's vocab slice (``Shard.vocab_range``,
    padded to ``vocab_per_rank``); the lookup all-reduces across the ranks."""

    def __init__(self, shard: Shard, tp: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shard.vocab_per_rank, shard.args.hidden_size))
        nn.init.normal_(self.weight)
        self.start, self.end = shard.vocab_range
        self.tp = tp

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        mine = (input_ids >= self.start) & (input_ids < self.end)
        local = torch.where(mine, input_ids - self.start, 0)
        out = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.tp.all_reduce(out)


def gather_logits(tp: TPGroup, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Full ``[rows, vocab]`` logits from each rank's ``[rows, vocab_per_rank]`` slice."""
    if tp.size == 1:
        return local
    return tp.all_gather(local)[:, :vocab_size]
