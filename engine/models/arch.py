"""The per-architecture parts of ``ModelArgs`` (engine/models/config.py), read from a
Hugging Face config.json in either the transformers 4 layout (``rope_scaling``,
``rope_local_base_freq``, ``sliding_window_pattern``) or the 5 layout (``rope_parameters``,
per layer type for Gemma 3, ``layer_types``)."""

from __future__ import annotations

from typing import Any

from engine.models.deepseek_args import DEEPSEEK_ARCHITECTURES, deepseek_fields

GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM")

_ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def arch_fields(arch: str, cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    """The ``ModelArgs`` fields that differ by family; ``ValueError`` naming what a
    config asks for that this engine does not run."""
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    local_theta = None
    if "full_attention" in rope or "sliding_attention" in rope:  # Gemma 3, transformers 5
        local = dict(rope.get("sliding_attention") or {})
        rope = dict(rope.get("full_attention") or {})
        local_theta = float(local.get("rope_theta") or 10000.0)
        if _rope_kind(local) != "default":
            raise ValueError(f"scaled rope on the sliding layers is not supported: {local}")
    elif cfg.get("rope_local_base_freq") is not None:  # Gemma 3, transformers 4
        local_theta = float(cfg["rope_local_base_freq"])
    theta = float(rope.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0)
    partial = float(
        rope.pop("partial_rotary_factor", None) or cfg.get("partial_rotary_factor", 1.0)
    )
    if partial != 1.0:
        raise ValueError(
            f"partial_rotary_factor {partial} is not supported (rope over the whole head only)"
        )
    kind = _rope_kind(rope)
    if kind in ("su", "longrope"):
        rope = _longrope(rope, cfg)
    elif kind == "yarn":
        rope = _yarn(rope, cfg)
    elif kind == "default":
        rope = {}
    act = str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "silu")
    if act not in _ACTIVATIONS:
        raise ValueError(
            f"hidden activation {act!r} is not supported; supported: {sorted(_ACTIVATIONS)}"
        )
    windows = _layer_windows(arch, cfg, num_layers)
    gemma = arch in GEMMA_ARCHITECTURES
    fields: dict[str, Any] = {
        "rope_theta": theta,
        "rope_scaling": rope,
        "local_rope_theta": local_theta if arch == "Gemma3ForCausalLM" else None,
        # Which layers are of the sliding type, whatever the window's size (their rope).
        "local_layers": tuple(
            i
            for i, w in enumerate(_layer_windows(arch, cfg | {"sliding_window": 1}, num_layers))
            if w
        ),
        "qk_norm": arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
        "sliding_window": max(windows) or None,
        "layer_windows": windows,
        "hidden_act": _ACTIVATIONS[act],
    }
    if gemma:
        scalar = cfg.get("query_pre_attn_scalar")
        fields |= {
            "attn_softcap": float(cfg.get("attn_logit_softcapping") or 0.0),
            "final_softcap": float(cfg.get("final_logit_softcapping") or 0.0),
            "attn_scale": float(scalar) ** -0.5 if scalar else None,
            "embed_scale": True,
            "sandwich_norms": True,
        }
    if arch in MOE_ARCHITECTURES:
        fields |= _moe_fields(arch, cfg, num_layers)
    if arch in DEEPSEEK_ARCHITECTURES:
        fields |= deepseek_fields(arch, cfg, num_layers, rope)
    if arch == "GptOssForCausalLM":
        fields |= _gpt_oss_fields(cfg)
    return fields


def _gpt_oss_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss beyond the MoE sizes (engine/models/gpt_oss.py): sinks, biases, the
    clamped SwiGLU of its experts."""
    return {
        "attn_sinks": True,
        "o_proj_bias": bool(cfg.get("attention_bias", True)),
        "router_bias": True,
        "expert_bias": True,
        "swiglu_limit": float(cfg.get("swiglu_limit") or 7.0),
        "swiglu_alpha": float(cfg.get("swiglu_alpha") or 1.702),
    }


def _rope_kind(rope: dict[str, Any]) -> str:
    return str(rope.get("rope_type", rope.get("type", "default")))


def _longrope(rope: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """Phi-3's longrope ("su" in older configs): per-frequency short/long factors, an
    attention factor from the context extension ratio (as transformers computes it)."""
    orig = rope.get("original_max_position_embeddings") or cfg.get(
        "original_max_position_embeddings"
    )
    if not orig or "short_factor" not in rope or "long_factor" not in rope:
        raise ValueError(
            "longrope scaling needs short_factor, long_factor and original_max_position_embeddings"
        )
    factor = rope.get("factor") or int(cfg.get("max_position_embeddings", orig)) / int(orig)
    out = {
        "rope_type": "longrope",
        "short_factor": [float(x) for x in rope["short_factor"]],
        "long_factor": [float(x) for x in rope["long_factor"]],
        "original_max_position_embeddings": int(orig),
        "factor": float(factor),
    }
    if rope.get("attention_factor") is not None:
        out["attention_factor"] = float(rope["attention_factor"])
    return out


def _yarn(rope: dict[str, Any], cfg: dict[str, Any]) -> dict[str, Any]:
    """YaRN (DeepSeek's configs): ``factor`` (or the ratio of the context lengths) and the
    original context length are required; the rest keeps transformers' defaults."""
    out = {k: v for k, v in rope.items() if k != "type"} | {"rope_type": "yarn"}
    orig = rope.get("original_max_position_embeddings") or cfg.get(
        "original_max_position_embeddings"
    )
    if not orig:
        raise ValueError("yarn rope scaling needs original_max_position_embeddings")
    out["original_max_position_embeddings"] = int(orig)
    if out.get("factor") is None:
        out["factor"] = int(cfg.get("max_position_embeddings", orig)) / int(orig)
    return out


def _layer_windows(arch: str, cfg: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    """Each layer's window (0 = global), as transformers lays the layer types out."""
    window = int(cfg.get("sliding_window") or 0)
    if not cfg.get("use_sliding_window", True) or window <= 0:
        return (0,) * num_layers
    types = cfg.get("layer_types")
    if types:
        if len(types) != num_layers:
            raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise ValueError(f"layer types {sorted(unknown)} are not supported")
        return tuple(window if t == "sliding_attention" else 0 for t in types)
    if arch == "Gemma2ForCausalLM":
        return tuple(window if (i + 1) % 2 else 0 for i in range(num_layers))
    if arch == "Gemma3ForCausalLM":
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        return tuple(window if (i + 1) % pattern else 0 for i in range(num_layers))
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM"):
        first = int(cfg.get("max_window_layers") or 0)
        return tuple(window if i >= first else 0 for i in range(num_layers))
    return (window,) * num_layers


def _moe_fields(arch: str, cfg: dict[str, Any], num_layers: int) -> dict[str, Any]:
    experts = int(cfg.get("num_local_experts") or cfg.get("num_experts") or 0)
    top_k = int(cfg.get("num_experts_per_tok") or 0)
    if experts < 1 or not 1 <= top_k <= experts:
        raise ValueError(
            f"MoE config needs 1 <= num_experts_per_tok ({top_k}) <= experts ({experts})"
        )
    if arch in ("MixtralForCausalLM", "GptOssForCausalLM"):
        # gpt-oss: softmax over the top-k logits, which is the renormalised top-k.
        return {
            "num_experts": experts,
            "num_experts_per_tok": top_k,
            "moe_intermediate_size": int(cfg["intermediate_size"]),
            "norm_topk_prob": True,
        }
    step = int(cfg.get("decoder_sparse_step") or 1)
    only = {int(i) for i in cfg.get("mlp_only_layers") or []}
    dense = tuple(i for i in range(num_layers) if i in only or (i + 1) % step)
    return {
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        "dense_layers": dense,
    }
