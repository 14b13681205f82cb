"""The DeepSeek-V2 / V3 parts of ``ModelArgs`` (engine/models/config.py): multi-head latent
attention's sizes (``MLAArgs``, engine/models/mla.py) and the MoE's grouped routing with
shared experts (``GroupedRouting``, engine/models/deepseek_moe.py), read from a Hugging
Face config.json (DeepSeek's own names: ``kv_lora_rank``, ``n_routed_experts``,
``topk_method``, ...).

The KV cache of an MLA model holds one latent per token and layer (the normed
``kv_lora_rank`` part and the rotated ``qk_rope_head_dim`` key part, concatenated): it is
described to the rest of the engine as one KV "head" of ``kv_lora_rank +
qk_rope_head_dim`` values in a single plane (docs/design.md §3 "MLA latent cache")."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

DEEPSEEK_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")


@dataclass(frozen=True, slots=True)
class MLAArgs:
    """Multi-head latent attention. ``q_lora_rank`` None: one query projection (V2-Lite);
    else a low-rank query with its own norm (V2, V3). ``softmax_scale``: 1/sqrt(qk head
    dim), times YaRN's ``mscale_all_dim`` correction squared when the rope is YaRN."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values per token per layer in the cache: the latent, then the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True, slots=True)
class GroupedRouting:
    """DeepSeek's router. ``scoring``: "softmax" (V2) or "sigmoid" (V3, with a learned
    per-expert ``e_score_correction_bias`` added for the choice only). Experts fall into
    ``n_group`` groups; only the ``topk_group`` best groups are eligible (a group's score:
    its best expert for V2's group_limited_greedy, its two best summed for V3). The chosen
    experts' scores (without the bias) are renormalised when ``renormalize`` and then
    multiplied by ``routed_scaling_factor``. ``n_shared_experts`` always-on experts (one
    MLP of ``n_shared_experts * moe_intermediate_size``) add to the routed ones."""

    scoring: str
    n_group: int
    topk_group: int
    group_score: str  # "max" | "top2"
    routed_scaling_factor: float
    n_shared_experts: int

    @property
    def correction_bias(self) -> bool:
        return self.scoring == "sigmoid"


def deepseek_fields(
    arch: str, cfg: dict[str, Any], num_layers: int, rope: dict[str, Any]
) -> dict[str, Any]:
    """The ``ModelArgs`` fields of a DeepSeek-V2/V3 config (``rope``: its parsed scaling).
    ``ValueError`` for what this engine does not run."""
    nope, rope_dim = int(cfg["qk_nope_head_dim"]), int(cfg["qk_rope_head_dim"])
    q_lora = cfg.get("q_lora_rank")
    scale = (nope + rope_dim) ** -0.5
    if rope.get("rope_type") == "yarn":
        all_dim = float(rope.get("mscale_all_dim") or 0.0)
        if all_dim:
            m = yarn_mscale(float(rope["factor"]), all_dim)
            scale *= m * m
    mla = MLAArgs(
        q_lora_rank=int(q_lora) if q_lora else None,
        kv_lora_rank=int(cfg["kv_lora_rank"]),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=int(cfg["v_head_dim"]),
        softmax_scale=scale,
    )
    fields: dict[str, Any] = {
        "mla": mla,
        # The rope tables are the rope part's; the cache is one latent "head" (module doc).
        "head_dim": rope_dim,
        "num_kv_heads": 1,
        "qkv_bias": bool(cfg.get("attention_bias", False)),
    }
    experts = int(cfg.get("n_routed_experts") or 0)
    if experts:
        # V3's config may leave its router implicit (transformers' V3 has only one).
        default = "noaux_tc" if arch == "DeepseekV3ForCausalLM" else "greedy"
        fields |= _routing_fields(cfg, num_layers, experts, default)
    return fields


def _routing_fields(
    cfg: dict[str, Any], num_layers: int, experts: int, default_method: str
) -> dict[str, Any]:
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if not 1 <= top_k <= experts:
        raise ValueError(f"MoE config needs 1 <= num_experts_per_tok ({top_k}) <= {experts}")
    method = str(cfg.get("topk_method") or default_method)
    scoring = str(cfg.get("scoring_func") or ("sigmoid" if method == "noaux_tc" else "softmax"))
    if (method, scoring) not in (
        ("greedy", "softmax"),
        ("group_limited_greedy", "softmax"),
        ("noaux_tc", "sigmoid"),
    ):
        raise ValueError(f"DeepSeek routing {method!r} with {scoring!r} scores is not supported")
    groups = int(cfg.get("n_group") or 1) if method != "greedy" else 1
    topk_group = int(cfg.get("topk_group") or groups) if method != "greedy" else 1
    if experts % groups or not 1 <= topk_group <= groups:
        raise ValueError(
            f"n_group {groups} must divide {experts} experts, with 1 <= topk_group "
            f"({topk_group}) <= n_group"
        )
    first_dense = int(cfg.get("first_k_dense_replace") or 0)
    freq = int(cfg.get("moe_layer_freq") or 1)
    routing = GroupedRouting(
        scoring=scoring,
        n_group=groups,
        topk_group=topk_group,
        group_score="top2" if method == "noaux_tc" else "max",
        routed_scaling_factor=float(cfg.get("routed_scaling_factor") or 1.0),
        n_shared_experts=int(cfg.get("n_shared_experts") or 0),
    )
    return {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        "dense_layers": tuple(i for i in range(num_layers) if i < first_dense or i % freq),
        "routing": routing,
    }


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(factor) + 1`` (1 for factor <= 1)."""
    return 1.0 if factor <= 1.0 else 0.1 * mscale * math.log(factor) + 1.0
