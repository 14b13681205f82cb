"""DeepSeek-V2/V3's MoE layer: the routed experts of ``MoEBlock`` (engine/models/moe.py:
stacked ``w13``/``w2``, the same expert kernels) with DeepSeek's grouped router and
always-on shared experts (``GroupedRouting``, engine/models/deepseek_args.py).

The router runs in float32 from float32 weights, as transformers runs it: its gate and
V3's ``e_score_correction_bias`` stay float32 whatever the model dtype (a bf16 bias would
round away the small differences that decide the top-k)."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from engine.distributed.tp_group import TPGroup
from engine.models.deepseek_args import GroupedRouting
from engine.models.layer_ops import LayerOps
from engine.models.moe import MoEBlock
from engine.models.parallel import Shard


class RouterGate(nn.Module):
    """``weight [experts, hidden]`` and (V3) ``e_score_correction_bias [experts]``, kept
    float32 through ``model.to(dtype)``: a cast keeps the float32 values, a device move
    moves them."""

    def __init__(self, hidden: int, experts: int, correction_bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden, dtype=torch.float32))
        self.e_score_correction_bias: nn.Parameter | None = None
        if correction_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(experts, dtype=torch.float32))

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def]
        saved = {n: p.data for n, p in self._parameters.items() if p is not None}
        out = super()._apply(fn, recurse)
        for name, data in saved.items():
            p = self._parameters[name]
            assert p is not None
            p.data = data.to(device=p.device, dtype=torch.float32)
        return out


def grouped_route(
    logits: torch.Tensor,
    routing: GroupedRouting,
    top_k: int,
    renormalize: bool,
    bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k] float32, experts [T, k])`` from float32 ``logits [T, E]``."""
    scores = logits.softmax(-1) if routing.scoring == "softmax" else logits.sigmoid()
    choice = scores + bias if bias is not None else scores
    if routing.n_group > 1:
        tokens, experts = choice.shape
        grouped = choice.view(tokens, routing.n_group, experts // routing.n_group)
        if routing.group_score == "max":
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        best = group_scores.topk(routing.topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        keep = keep.repeat_interleave(experts // routing.n_group, dim=1)
        choice = choice.masked_fill(~keep, float("-inf"))
    chosen = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, chosen)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routing.routed_scaling_factor, chosen


class SharedExperts(nn.Module):
    """The always-on experts as one SwiGLU MLP (``gate_up_proj`` merged on load)."""

    def __init__(self, hidden: int, inter: int, ops: LayerOps, tp: TPGroup) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.ops = ops
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        act = self.ops.silu_mul(self.ops.linear(x, self.gate_up_proj.weight, None))
        out = self.ops.linear(act, self.down_proj.weight, None)
        return self.tp.all_reduce(out) if self.tp.size > 1 else out


class DeepseekMoE(MoEBlock):
    """Routed experts (``MoEBlock``) + shared experts, with the grouped router."""

    def __init__(self, shard: Shard, ops: LayerOps, tp: TPGroup) -> None:
        super().__init__(shard, ops, tp)
        a = shard.args
        assert a.routing is not None
        self.routing = a.routing
        # ``gate``: the checkpoint's name (MoEBlock's plain router is replaced).
        self.gate = RouterGate(a.hidden_size, a.num_experts, a.routing.correction_bias)  # type: ignore[assignment]
        self.shared_experts: SharedExperts | None = None
        if a.routing.n_shared_experts:
            inter = shard.moe_intermediate_size * a.routing.n_shared_experts
            self.shared_experts = SharedExperts(a.hidden_size, inter, ops, tp)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gate = cast(RouterGate, self.gate)
        logits = torch.nn.functional.linear(x.float(), gate.weight)
        bias = gate.e_score_correction_bias
        weights, experts = grouped_route(logits, self.routing, self.top_k, self.renormalize, bias)
        # On the CPU the float32 weights scale each expert's output in float32 before it
        # joins the sum, as transformers does; the CUDA kernel takes the model dtype.
        return (weights.to(x.dtype) if x.is_cuda else weights), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        return out if self.shared_experts is None else out + self.shared_experts(x)
