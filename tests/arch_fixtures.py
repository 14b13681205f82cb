"""Tiny random models of the non-Llama architectures (Phi-3, Gemma 2/3, Mixtral,
Qwen3-MoE, DeepSeek-V2/V3, gpt-oss) and a windowed Mistral, saved with transformers in float32 with SmolLM2's
tokenizer (``tests/model_fixtures.save_tiny_model``). Windows are 16 tokens, so every
test prompt longer than that attends through a real sliding window; soft-caps are small
enough that tanh is far from linear on these weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.model_fixtures import _TINY_SHAPE, save_tiny_model

WINDOW = 16
ARCHS = (
    "phi3",
    "gemma2",
    "gemma3",
    "mixtral",
    "qwen3_moe",
    "mistral_window",
    "deepseek_v2",
    "deepseek_v3",
    "gpt_oss",
)
# DeepSeek's YaRN original context: the longer test prompts pass it.
DEEPSEEK_ORIGINAL_MAX = 64
# gpt-oss's SwiGLU clamp, low enough that these tiny random activations cross it (7 in
# the released models) so the clamp is exercised; YaRN over a short original context,
# the model's context being the factor times it (as in the released configs;
# transformers warns of the mismatch otherwise).
GPT_OSS_LIMIT = 0.5
GPT_OSS_ORIGINAL_MAX = 64
GPT_OSS_YARN_FACTOR = 8.0
# Phi-3's longrope switches to the long factors at this position (tests cross it).
PHI3_ORIGINAL_MAX = 128


def _spec(arch: str) -> tuple[Any, Any, dict[str, Any]]:
    import transformers as tf

    half = _TINY_SHAPE["head_dim"] // 2
    if arch == "phi3":
        rope = {
            "rope_type": "longrope",
            "short_factor": [1.0 + 0.1 * i for i in range(half)],
            "long_factor": [2.0 + 0.5 * i for i in range(half)],
            "rope_theta": 10000.0,
        }
        extra = {
            "rope_parameters": rope,
            "original_max_position_embeddings": PHI3_ORIGINAL_MAX,
            "sliding_window": None,
        }
        return tf.Phi3Config, tf.Phi3ForCausalLM, extra
    gemma = {
        "sliding_window": WINDOW,
        "query_pre_attn_scalar": 24,
        "hidden_activation": "gelu_pytorch_tanh",
        "tie_word_embeddings": True,
    }
    if arch == "gemma2":
        extra = gemma | {"attn_logit_softcapping": 0.5, "final_logit_softcapping": 3.0}
        return tf.Gemma2Config, tf.Gemma2ForCausalLM, extra
    if arch == "gemma3":
        rope = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
        }
        extra = gemma | {
            "rope_parameters": rope,
            "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
            "num_hidden_layers": 3,
        }
        return tf.Gemma3TextConfig, tf.Gemma3ForCausalLM, extra
    if arch == "mixtral":
        extra = {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}
        return tf.MixtralConfig, tf.MixtralForCausalLM, extra
    if arch == "qwen3_moe":
        extra = {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "norm_topk_prob": True,
            "mlp_only_layers": [1],
        }
        return tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM, extra
    if arch in ("deepseek_v2", "deepseek_v3"):
        return _deepseek(arch)
    if arch == "gpt_oss":
        rope = {
            "rope_type": "yarn", "factor": GPT_OSS_YARN_FACTOR, "beta_fast": 32.0,
            "beta_slow": 1.0, "truncate": False, "rope_theta": 10000.0,
            "original_max_position_embeddings": GPT_OSS_ORIGINAL_MAX,
        }  # fmt: skip
        extra = {
            "max_position_embeddings": int(GPT_OSS_YARN_FACTOR * GPT_OSS_ORIGINAL_MAX),
            "num_local_experts": 4, "num_experts_per_tok": 2, "intermediate_size": 32,
            "sliding_window": WINDOW, "rope_parameters": rope, "swiglu_limit": GPT_OSS_LIMIT,
            "num_hidden_layers": 3,  # sliding, full, sliding
            "initializer_range": 0.1,  # signals above the biases (random tokens, not one)
        }  # fmt: skip
        return tf.GptOssConfig, tf.GptOssForCausalLM, extra
    if arch == "mistral_window":
        return tf.MistralConfig, tf.MistralForCausalLM, {"sliding_window": WINDOW}
    raise ValueError(f"unknown architecture {arch!r}; choose one of {ARCHS}")


def _deepseek(arch: str) -> tuple[Any, Any, dict[str, Any]]:
    """MLA with a latent of 32 + 8 rope dims, 8 routed experts in 4 groups (2 eligible),
    shared experts, one dense layer first, YaRN rope. V2: no query low rank (V2-Lite's
    shape), softmax scores with group-limited greedy; V3: a query low rank, sigmoid
    scores with the correction bias, renormalised and scaled."""
    import transformers as tf

    common = {
        "num_hidden_layers": 3,
        "max_position_embeddings": 4 * DEEPSEEK_ORIGINAL_MAX,
        "num_key_value_heads": _TINY_SHAPE["num_attention_heads"],
        "kv_lora_rank": 32,
        "qk_rope_head_dim": 8,
        "head_dim": 8,  # transformers rotates head_dim values: the rope part
        "qk_nope_head_dim": 16,
        "v_head_dim": 16,
        "n_routed_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "n_group": 4,
        "topk_group": 2,
        "first_k_dense_replace": 1,
    }
    yarn = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": DEEPSEEK_ORIGINAL_MAX,
        "beta_fast": 32,
        "beta_slow": 1,
        "rope_theta": 10000.0,
    }
    if arch == "deepseek_v2":
        extra = common | {
            "q_lora_rank": None,
            "topk_method": "group_limited_greedy",
            "n_shared_experts": 2,
            "routed_scaling_factor": 1.5,
            "norm_topk_prob": False,
            "rope_parameters": yarn | {"mscale": 0.707, "mscale_all_dim": 0.707},
        }
        return tf.DeepseekV2Config, tf.DeepseekV2ForCausalLM, extra
    extra = common | {
        "q_lora_rank": 48,
        "n_shared_experts": 1,
        "routed_scaling_factor": 2.5,
        "norm_topk_prob": True,
        "rope_parameters": yarn | {"mscale": 1.0, "mscale_all_dim": 0.8},
    }
    return tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM, extra


def make_tiny_arch(arch: str, out_dir: str | Path, seed: int = 0, **overrides: Any) -> Path:
    """A tiny random model of ``arch`` (one of ARCHS) saved into ``out_dir``."""
    config_cls, model_cls, extra = _spec(arch)
    return save_tiny_model(config_cls, model_cls, out_dir, seed, _TINY_SHAPE | extra | overrides)


def load_reference(model_dir: str | Path, dtype: Any = None) -> Any:
    """transformers' model of a tiny architecture in ``dtype`` (float32 by default) with
    eager attention (the reference path for windows, soft-caps and sinks), in eval mode,
    holding the checkpoint's own gpt-oss SwiGLU constants (``match_swiglu_to_config``)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=dtype or torch.float32, attn_implementation="eager"
    ).eval()
    match_swiglu_to_config(model)
    return model


def match_swiglu_to_config(model: Any) -> int:
    """Give transformers' gpt-oss experts the ``swiglu_limit``/``swiglu_alpha`` of the
    model's config; returns how many expert modules there are.

    Some transformers releases (5.17, the GPU machines' image) fix them at 7.0 and 1.702 in
    ``GptOssExperts`` and ignore the config's fields, which later ones read. The tiny
    gpt-oss sets the limit to ``GPT_OSS_LIMIT`` so that its clamp is crossed, and the
    engine honours the config, so under such a release the reference is another model:
    the bf16 GPU test saw a top-1 agreement of 0.25 from this alone (docs/models.md)."""
    cfg = model.config
    experts = [m for m in model.modules() if type(m).__name__ == "GptOssExperts"]
    for m in experts:
        m.limit = float(getattr(cfg, "swiglu_limit", None) or 7.0)
        m.alpha = float(getattr(cfg, "swiglu_alpha", None) or 1.702)
    return len(experts)
