"""Mixture-of-experts MLP (Mixtral, Qwen3-MoE): a replicated router, top-k routing, and the
experts' weights stacked into two tensors.

Routing (both families): softmax over the experts in float32, the top ``k`` kept, and
renormalised to sum to one when ``norm_topk_prob`` (always for Mixtral; Qwen3-MoE's
config flag), then cast to the activations' dtype, as transformers does.

Layout: ``w13`` ``[experts, 2 * inter, hidden]`` (gate rows then up rows, like the dense
``gate_up_proj``) and ``w2`` ``[experts, hidden, inter]``. Under tensor parallelism each
rank holds the slice ``inter / size`` of every expert (engine/models/parallel.py) and one
all-reduce adds the ranks' partial sums, as for a dense MLP. Expert parallelism (whole
experts per rank, all-to-all dispatch) is designed in docs/design.md, not built.

The expert computation here is the torch path (the reference, what runs on the CPU): per
expert, the tokens routed to it gathered, its two GEMMs, the weighted result added back.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import nn

from engine.distributed.tp_group import TPGroup
from engine.models.layer_ops import LayerOps
from engine.models.parallel import Shard


def route(
    logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(weights [T, k] in dtype, experts [T, k] int64)`` from router ``logits [T, E]``."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), experts


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU of ``gate_up = [gate | up]``: the experts' activation unless a model says."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


Activation = Callable[[torch.Tensor], torch.Tensor]


def experts_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    act: Activation = silu_mul,
) -> torch.Tensor:
    """``sum_k weights[t, k] * expert_{experts[t, k]}(x[t])`` with SwiGLU experts (or
    ``act``; biases after each projection when given, gpt-oss), one expert at a time in
    expert order (transformers' order of additions). FP8 experts (``*_scale`` given) are
    dequantized one expert at a time."""
    out = torch.zeros_like(x)
    hit = torch.unique(experts).tolist()
    for e in hit:
        tok, slot = torch.where(experts == e)
        h = x.index_select(0, tok)
        up_w, down_w = w13[e], w2[e]
        if w13_scale is not None and w2_scale is not None:
            up_w = (up_w.float() * w13_scale[e, :, None]).to(x.dtype)
            down_w = (down_w.float() * w2_scale[e, :, None]).to(x.dtype)
        gate_up = torch.nn.functional.linear(h, up_w, None if w13_bias is None else w13_bias[e])
        mid = act(gate_up)
        y = torch.nn.functional.linear(mid, down_w, None if w2_bias is None else w2_bias[e])
        y = y * weights[tok, slot, None]
        out.index_add_(0, tok, y.to(out.dtype))
    return out


class MoEBlock(nn.Module):
    """The MoE MLP of one layer (parameter names: ``gate`` the router, ``w13``, ``w2``)."""

    def __init__(self, shard: Shard, ops: LayerOps, tp: TPGroup) -> None:
        super().__init__()
        a = shard.args
        inter = shard.moe_intermediate_size
        self.gate = nn.Linear(a.hidden_size, a.num_experts, bias=a.router_bias)
        self.w13 = nn.Parameter(torch.empty(a.num_experts, 2 * inter, a.hidden_size))
        self.w2 = nn.Parameter(torch.empty(a.num_experts, a.hidden_size, inter))
        # gpt-oss: biases after each expert projection (``w2_bias`` is added by rank 0
        # only under tensor parallelism: its zero elsewhere, parallel.py) and the clamped
        # SwiGLU (engine/models/gpt_oss.py).
        self.w13_bias: nn.Parameter | None = None
        self.w2_bias: nn.Parameter | None = None
        if a.expert_bias:
            self.w13_bias = nn.Parameter(torch.empty(a.num_experts, 2 * inter))
            self.w2_bias = nn.Parameter(torch.empty(a.num_experts, a.hidden_size))
        self.act: Activation = silu_mul
        if a.swiglu_limit:
            from engine.models.gpt_oss import clamped_swiglu

            self.act = partial(clamped_swiglu, alpha=a.swiglu_alpha, limit=a.swiglu_limit)
        self.top_k = a.num_experts_per_tok
        self.renormalize = a.norm_topk_prob
        self.ops = ops
        self.tp = tp
        # FP8 experts (``quantize``): e4m3 w13/w2 and float32 per-(expert, channel) scales.
        self.w13_scale: torch.Tensor | None
        self.w2_scale: torch.Tensor | None
        self.register_buffer("w13_scale", None, persistent=False)
        self.register_buffer("w2_scale", None, persistent=False)

    def quantize(self) -> None:
        """Per output channel e4m3 of every expert (``quantization="fp8"``, docs/quantization.md),
        one expert at a time (the float32 temporaries stay one expert's size)."""
        from engine.models.fp8 import FP8, quantize_rows

        for name in ("w13", "w2"):
            w = getattr(self, name)
            q = torch.empty(w.shape, dtype=FP8, device=w.device)
            scale = torch.empty(w.shape[:2], dtype=torch.float32, device=w.device)
            for e in range(w.shape[0]):
                q[e], scale[e] = quantize_rows(w.data[e])
            setattr(self, name, nn.Parameter(q, requires_grad=False))
            self.register_buffer(f"{name}_scale", scale, persistent=False)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k], experts [T, k])`` of the tokens ``x`` (DeepSeek's grouped
        router overrides it: engine/models/deepseek_moe.py; gpt-oss's router has a bias)."""
        logits = self.ops.linear(x, self.gate.weight, self.gate.bias)
        return route(logits, self.top_k, self.renormalize, x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, experts = self.route(x)
        b13, b2 = self.w13_bias, self.w2_bias
        if x.is_cuda:
            from engine.models.triton_moe import fused_experts

            out = fused_experts(
                x, self.w13, self.w2, weights, experts, self.w13_scale, self.w2_scale,
                w13_bias=b13, w2_bias=b2, act=self.act,
            )  # fmt: skip
        else:
            out = experts_reference(
                x, self.w13, self.w2, weights, experts, self.w13_scale, self.w2_scale,
                w13_bias=b13, w2_bias=b2, act=self.act,
            )  # fmt: skip
        return self.tp.all_reduce(out) if self.tp.size > 1 else out
